"""Model code: one shared transformer stack, one small file per family, a loader."""
from .layers import DiffusionLM
from .loader import load_model, read_config, save_model
from .registry import FAMILIES, family_of, get_family

__all__ = ["DiffusionLM", "FAMILIES", "family_of", "get_family", "load_model", "read_config", "save_model"]
