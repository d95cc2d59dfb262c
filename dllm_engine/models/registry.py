"""model_type -> family."""
from __future__ import annotations

from . import dream, llada, llada2, sdar
from .family import Family

FAMILIES: dict[str, Family] = {
    f.model_type: f for f in (llada.FAMILY, dream.FAMILY, sdar.FAMILY, llada2.FAMILY)}


def get_family(model_type: str | None) -> Family:
    if model_type not in FAMILIES:
        raise ValueError(f"unknown model_type {model_type!r} in config.json; "
                         f"supported: {', '.join(FAMILIES)}")
    return FAMILIES[model_type]
