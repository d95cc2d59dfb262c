"""LLaDA2.0-mini (``model_type: llada2_moe``, inclusionAI LLaDA2.0 report): a Ling-2.0 MoE
block-diffusion model. Fused ``query_key_value`` (rows Q | K | V), per-head q/k RMSNorm, partial
NeoX RoPE (first ``head_dim * partial_rotary_factor`` dims), a sigmoid group-limited router with a
selection-only ``expert_bias``, shared experts, dense MLP below ``first_k_dense_replace``,
block-causal attention, no logit shift, untied head.

Everything model-specific is config (``ModelConfig.moe``, ``rotary_dim``, ``fused_qkv``); this
file only maps config keys and tensor names.
"""
from __future__ import annotations

from ..errors import UserError
from ..config import ModelConfig, MoEConfig
from ..methods import BLOCK_METHODS
from .family import (Family, check_unsupported, qwen_config_from_hf, qwen_config_to_hf,
                     renamed_checkpoint_names, rope_settings)

DEFAULT_BLOCK_SIZE = 32  # the released models' block length (dFactory / SGLang defaults)

# our module name inside a layer -> the LLaDA2 name; any other layer name is unchanged
_ATTENTION_NAMES = {
    "self_attn.qkv_proj": "attention.query_key_value",
    "self_attn.o_proj": "attention.dense",
    "self_attn.q_norm": "attention.query_layernorm",
    "self_attn.k_norm": "attention.key_layernorm",
}
_TOP_NAMES = {"embed_tokens": "model.word_embeddings", "norm": "model.norm", "lm_head": "lm_head"}


# ``layers.3.self_attn.qkv_proj.weight`` -> ``model.layers.3.attention.query_key_value.weight``
checkpoint_name = renamed_checkpoint_names("model.layers", _ATTENTION_NAMES, _TOP_NAMES, strict=False)


def moe_from_hf(hf: dict) -> MoEConfig | None:
    if not hf.get("num_experts"):
        return None
    if hf.get("score_function", "sigmoid") != "sigmoid":
        raise UserError(f"score_function {hf['score_function']!r} is not supported; "
                        f"LLaDA2 routers use 'sigmoid'")
    return MoEConfig(
        num_experts=hf["num_experts"], num_experts_per_tok=hf["num_experts_per_tok"],
        moe_intermediate_size=hf["moe_intermediate_size"],
        num_shared_experts=hf.get("num_shared_experts") or 0,
        n_group=hf.get("n_group") or 1, topk_group=hf.get("topk_group") or 1,
        routed_scaling_factor=hf.get("routed_scaling_factor", 1.0),
        norm_topk_prob=hf.get("norm_topk_prob", True),
        first_k_dense_replace=hf.get("first_k_dense_replace", 0),
        expert_bias=hf.get("moe_router_enable_expert_bias", True))


def rotary_dim_from_hf(hf: dict) -> int:
    head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    factor = hf.get("partial_rotary_factor") or rope_settings(hf).get("partial_rotary_factor") or 1.0
    return hf.get("rotary_dim") or int(head_dim * factor)


def config_from_hf(hf: dict) -> ModelConfig:
    check_unsupported(hf, "llada2_moe", {"norm_head": bool})  # a normalised LM head: not implemented
    return qwen_config_from_hf(
        hf, model_type="llada2_moe", qkv_bias=hf.get("use_qkv_bias", False),
        attn_out_bias=hf.get("use_bias", False), qk_norm=hf.get("use_qk_norm", True),
        fused_qkv=True, rotary_dim=rotary_dim_from_hf(hf), moe=moe_from_hf(hf),
        attention="block_causal", block_size=hf.get("block_size", DEFAULT_BLOCK_SIZE))


def moe_to_hf(moe: MoEConfig | None) -> dict:
    if moe is None:
        return {"num_experts": None}
    return {
        "num_experts": moe.num_experts, "num_experts_per_tok": moe.num_experts_per_tok,
        "moe_intermediate_size": moe.moe_intermediate_size,
        "num_shared_experts": moe.num_shared_experts, "n_group": moe.n_group,
        "topk_group": moe.topk_group, "routed_scaling_factor": moe.routed_scaling_factor,
        "norm_topk_prob": moe.norm_topk_prob, "first_k_dense_replace": moe.first_k_dense_replace,
        "moe_router_enable_expert_bias": moe.expert_bias, "score_function": "sigmoid",
        "router_dtype": "fp32",
    }


def config_to_hf(cfg: ModelConfig) -> dict:
    return qwen_config_to_hf(
        cfg, architectures=["LLaDA2MoeModelLM"], model_type="llada2_moe",
        use_qkv_bias=cfg.qkv_bias, use_bias=cfg.attn_out_bias, use_qk_norm=cfg.qk_norm,
        partial_rotary_factor=cfg.rotary_dim / cfg.head_dim, rotary_dim=cfg.rotary_dim,
        norm_head=False, block_size=cfg.block_size,
        attention_dropout=0.0, use_sliding_window=False, **moe_to_hf(cfg.moe))


FAMILY = Family("llada2_moe", config_from_hf, config_to_hf, checkpoint_name,
                BLOCK_METHODS, mask_token="<|mask|>", end_of_turn_token="<|role_end|>")
