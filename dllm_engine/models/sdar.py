"""SDAR (``model_type: sdar``): Qwen3 layout with per-head q/k RMSNorm before RoPE,
block-causal attention (bidirectional inside a block, causal across blocks), no logit shift."""
from __future__ import annotations

from ..config import ModelConfig
from ..methods import BLOCK_METHODS
from .family import Family, qwen_checkpoint_name, qwen_config_from_hf, qwen_config_to_hf


def config_from_hf(hf: dict) -> ModelConfig:
    return qwen_config_from_hf(hf, model_type="sdar", qkv_bias=hf.get("attention_bias", False),
                               qk_norm=True, attention="block_causal",
                               block_size=hf.get("block_size", 4))


def config_to_hf(cfg: ModelConfig) -> dict:
    return qwen_config_to_hf(cfg, architectures=["SDARForCausalLM"], model_type="sdar",
                             attention_bias=cfg.qkv_bias, block_size=cfg.block_size,
                             attention_dropout=0.0, sliding_window=None, use_sliding_window=False)


FAMILY = Family("sdar", config_from_hf, config_to_hf, qwen_checkpoint_name,
                BLOCK_METHODS, mask_token="<|MASK|>", end_of_turn_token="<|im_end|>")
