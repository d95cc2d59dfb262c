"""model_type -> family; ``family_of`` also tells the families that share a model_type apart."""
from __future__ import annotations

from ..errors import UserError
from . import dream, llada, llada2, llada_moe, sdar
from .family import Family

FAMILIES: dict[str, Family] = {
    f.model_type: f for f in (llada.FAMILY, dream.FAMILY, sdar.FAMILY, llada2.FAMILY, llada_moe.FAMILY)}
# other model_type spellings of a family (ZHZisZZ/dllm rewrites LLaDA-MoE's "llada" to "lladamoe")
ALIASES = {"lladamoe": llada_moe.MODEL_TYPE}


def get_family(model_type: str | None) -> Family:
    model_type = ALIASES.get(model_type, model_type)
    if model_type not in FAMILIES:
        raise UserError(f"unknown model_type {model_type!r} in config.json; "
                        f"supported: {', '.join(FAMILIES)}")
    return FAMILIES[model_type]


def family_of(hf: dict) -> Family:
    """The family of a config.json: its model_type, except that LLaDA-MoE's released config says
    ``llada`` as the dense LLaDA's does (told apart by architecture and keys)."""
    model_type = hf.get("model_type")
    if model_type == llada.FAMILY.model_type and llada_moe.is_llada_moe(hf):
        return llada_moe.FAMILY
    return get_family(model_type)
