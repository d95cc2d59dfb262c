"""LLaDA-8B / LLaDA-1.5 (``model_type: llada``): Llama blocks under OLMo-style names,
full bidirectional attention, no logit shift, untied head."""
from __future__ import annotations

from ..config import ModelConfig
from .family import FULL_ATTENTION_METHODS, Family, first_id, renamed_checkpoint_names

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


def config_from_hf(hf: dict) -> ModelConfig:
    eos = first_id(hf.get("eos_token_id"))
    return ModelConfig(
        model_type="llada",
        vocab_size=hf.get("embedding_size") or hf["vocab_size"],
        hidden_size=hf["d_model"],
        num_layers=hf["n_layers"],
        num_heads=hf["n_heads"],
        num_kv_heads=hf.get("n_kv_heads") or hf["n_heads"],
        intermediate_size=hf["mlp_hidden_size"],
        rope_theta=hf.get("rope_theta", 10000.0),
        rms_norm_eps=hf.get("rms_norm_eps", 1e-5),
        qkv_bias=bool(hf.get("include_qkv_bias") or hf.get("include_bias")),
        tie_word_embeddings=hf.get("weight_tying", False),
        max_position_embeddings=hf.get("max_sequence_length", 4096),
        mask_token_id=hf.get("mask_token_id", -1),
        eos_token_id=eos if eos is not None else -1,
        pad_token_id=hf.get("pad_token_id") if hf.get("pad_token_id") is not None else -1,
        bos_token_id=first_id(hf.get("bos_token_id")),
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
                FULL_ATTENTION_METHODS)
