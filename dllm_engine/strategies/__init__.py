"""Accelerations, one file each, entering the engine through ``base.Strategy``'s hooks.

This package init stays import-light: ``sampling_params`` reads the registry from here."""
from .registry import REGISTRY

__all__ = ["REGISTRY"]
