"""Dream-v0-7B (``model_type: Dream``): Qwen2 layout (q/k/v bias), full bidirectional attention,
logits shifted right by one (position i reads the output at i - 1)."""
from __future__ import annotations

from ..config import ModelConfig
from ..methods import FULL_ATTENTION_METHODS
from .family import Family, qwen_checkpoint_name, qwen_config_from_hf, qwen_config_to_hf


def config_from_hf(hf: dict) -> ModelConfig:
    return qwen_config_from_hf(hf, model_type="Dream", qkv_bias=True, logit_shift=1)


def config_to_hf(cfg: ModelConfig) -> dict:
    return qwen_config_to_hf(cfg, architectures=["DreamModel"], model_type="Dream",
                             sliding_window=None, use_sliding_window=False)


FAMILY = Family("Dream", config_from_hf, config_to_hf, qwen_checkpoint_name,
                FULL_ATTENTION_METHODS, mask_token="<|mask|>", end_of_turn_token="<|im_end|>")
