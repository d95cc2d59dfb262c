"""LLaDA-8B / LLaDA-1.5 (``model_type: llada``): Llama blocks under OLMo-style names,
full bidirectional attention, no logit shift, untied head."""
from __future__ import annotations

from ..config import ModelConfig
from ..methods import FULL_ATTENTION_METHODS
from .family import (Family, check_rope, check_unsupported, renamed_checkpoint_names, rope_theta,
                     token_id)

# our module name (inside a layer) -> LLaDA block tensor name
_BLOCK_NAMES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "q_proj",
    "self_attn.k_proj": "k_proj",
    "self_attn.v_proj": "v_proj",
    "self_attn.o_proj": "attn_out",
    "post_attention_layernorm": "ff_norm",
    "mlp.gate_proj": "ff_proj",
    "mlp.up_proj": "up_proj",
    "mlp.down_proj": "ff_out",
}
_TOP_NAMES = {"embed_tokens": "model.transformer.wte", "norm": "model.transformer.ln_f",
              "lm_head": "model.transformer.ff_out"}
checkpoint_name = renamed_checkpoint_names("model.transformer.blocks", _BLOCK_NAMES, _TOP_NAMES)

# OLMo-style options of the LLaDA config that change the math, and the values the engine
# implements (those of every released LLaDA): any other value is refused, not ignored
_REFUSED = {
    "block_type": lambda v: v != "llama",
    "attention_layer_norm": bool,  # q/k LayerNorm
    "scale_logits": bool,  # logits * 1/sqrt(d_model)
    "clip_qkv": lambda v: v is not None,
    "alibi": bool,
    "rope": lambda v: v is False,
    "layer_norm_type": lambda v: v != "rms",
    "activation_type": lambda v: v != "silu",
    "input_emb_norm": bool,
}


def config_from_hf(hf: dict) -> ModelConfig:
    check_rope(hf, "llada")
    check_unsupported(hf, "llada", _REFUSED)
    return ModelConfig(
        model_type="llada",
        vocab_size=hf.get("embedding_size") or hf["vocab_size"],
        hidden_size=hf["d_model"],
        num_layers=hf["n_layers"],
        num_heads=hf["n_heads"],
        num_kv_heads=hf.get("n_kv_heads") or hf["n_heads"],
        intermediate_size=hf["mlp_hidden_size"],
        rope_theta=rope_theta(hf),
        rms_norm_eps=hf.get("rms_norm_eps", 1e-5),
        qkv_bias=bool(hf.get("include_qkv_bias") or hf.get("include_bias")),
        tie_word_embeddings=bool(hf.get("weight_tying", False)),
        max_position_embeddings=hf.get("max_sequence_length", 4096),
        mask_token_id=token_id(hf.get("mask_token_id")),
        eos_token_id=token_id(hf.get("eos_token_id")),
        pad_token_id=token_id(hf.get("pad_token_id")),
        bos_token_id=token_id(hf.get("bos_token_id"), None),
    )


def config_to_hf(cfg: ModelConfig) -> dict:
    return {
        "architectures": ["LLaDAModelLM"], "model_type": "llada",
        "d_model": cfg.hidden_size, "n_layers": cfg.num_layers, "n_heads": cfg.num_heads,
        "n_kv_heads": cfg.num_kv_heads, "mlp_hidden_size": cfg.intermediate_size,
        "mlp_ratio": cfg.intermediate_size // cfg.hidden_size,
        "vocab_size": cfg.vocab_size, "embedding_size": cfg.vocab_size,
        "max_sequence_length": cfg.max_position_embeddings, "rope": True,
        "rope_theta": cfg.rope_theta, "rope_full_precision": True,
        "layer_norm_type": "rms", "rms_norm_eps": cfg.rms_norm_eps,
        "activation_type": "silu", "block_type": "llama", "block_group_size": 1,
        "attention_layer_norm": False, "include_bias": False, "include_qkv_bias": cfg.qkv_bias,
        "weight_tying": cfg.tie_word_embeddings, "scale_logits": False, "alibi": False,
        "flash_attention": False, "init_device": "meta",
        "mask_token_id": cfg.mask_token_id, "eos_token_id": cfg.eos_token_id,
        "pad_token_id": cfg.pad_token_id, "bos_token_id": cfg.bos_token_id,
        "use_cache": False, "torch_dtype": "float32",
    }


FAMILY = Family("llada", config_from_hf, config_to_hf, checkpoint_name,
                FULL_ATTENTION_METHODS, mask_token="<|mdm_mask|>", end_of_turn_token="<|eot_id|>")
