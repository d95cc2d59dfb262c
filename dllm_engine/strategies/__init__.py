"""Accelerations, one file each, entering the engine through ``base.Strategy``'s hooks."""
from .base import REGISTRY, Pipeline, Strategy, strategy_class

__all__ = ["REGISTRY", "Pipeline", "Strategy", "strategy_class"]
