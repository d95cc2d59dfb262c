"""LLaDA-MoE-7B-A1B Base / Instruct (inclusionAI, arXiv 2509.24389): a masked-diffusion LM with
full bidirectional attention (as LLaDA) and an OLMoE-style sparse MoE FFN in every layer.

What the released checkpoint is, as verified from the released modeling code (two copies that
agree: ``inclusionAI/dInfer tools/modeling_fused_lladamoe.py`` (the non-fused
``LLaDAMoESparseMoeBlock`` and the layers, which its converter ``tools/transfer.py`` reads with
the released names) and the vendored HF file ``ZHZisZZ/dllm-trainer
dllm/pipelines/llada/models/modeling_lladamoe.py``), its config class
(``dInfer tools/configuration_lladamoe.py``) and llama.cpp's port (``src/models/llada-moe.cpp``
and its converter's ``LLaDAMoEModel``):

- config.json says ``model_type: "llada"`` (the dense LLaDA's type) with ``architectures:
  ["LLaDAMoEModelLM"]`` and HF-style keys (``hidden_size``, ``num_hidden_layers``,
  ``expert_intermediate_size``, ``moe_layer_freq``, ``qk_layernorm`` ...); the registry tells it
  from the dense LLaDA by its architecture / keys (``is_llada_moe``).
- Tensors: Qwen/OLMoE names under ``model.``: ``embed_tokens``, ``layers.N.{input_layernorm,
  post_attention_layernorm}``, ``self_attn.{q,k,v,o}_proj`` (bias only with ``attention_bias``),
  ``self_attn.{q,k}_norm`` [head_dim], ``mlp.gate`` [E, d], ``mlp.experts.{e}.{gate,up,down}_proj``,
  ``mlp.expert_bias`` (a buffer, only with ``moe_router_enable_expert_bias``), ``model.norm``;
  an untied ``lm_head`` unless ``tie_word_embeddings``.
- QK-norm: RMSNorm over each head's ``head_dim`` (reshaped to [-1, head_dim]), before RoPE; unlike
  OLMoE's, which normalises the whole projection. head_dim = hidden_size / num_attention_heads.
- RoPE: rotate-half, ``rope_theta`` from config.json; ``partial_rotary_factor`` rotates that
  fraction of each head (llama.cpp's port requires the whole head: the release uses 1).
- Router: softmax of the gate logits over all experts in fp32, ``+ expert_bias`` when present
  (added to the probabilities, so it changes the weights too: ``MoEConfig.bias_weights``), top-k,
  no renormalisation (``norm_topk_prob`` is hard-coded False in the forward, whatever config.json
  says), no scaling factor, no expert groups; ``moe_router_score_function``, ``norm_topk_prob``,
  ``routed_scaling_factor`` and ``router_*_group`` are read by the config class and unused by the
  forward, so they are ignored here too. No shared expert (``shared_expert_intermediate_size``
  null; one is refused); a layer with ``moe_layer_freq[i] == 0`` has a dense MLP of
  ``dense_intermediate_size`` (the release: every layer MoE).
- Attention is never causal; the released forward drops ``attention_mask`` entirely, so padding
  is attended to there; the engine masks padding keys (identical on unpadded rows).
- No logit shift. Ids (llama.cpp's converter writes mask 156895; dInfer ``tests/test_llada_moe.py``
  decodes with mask 156895, eos 156892): mask ``<|mask|>`` (absent from config.json: looked up by
  name), eos ``<|endoftext|>``; chat turns end with ``<|role_end|>``; the tokenizer is LLaDA2.0's.
- Released shape: 16 layers, d 2048, 16 MHA heads x 128, 64 experts of 1024, top-8; bf16.
"""
from __future__ import annotations

from ..errors import UserError
from ..config import ModelConfig, MoEConfig
from ..methods import FULL_ATTENTION_METHODS
from .family import (Family, check_rope, check_unsupported, qwen_checkpoint_name,
                     rope_settings, rope_theta, token_id)

MODEL_TYPE = "llada_moe"  # ours; config.json says "llada" (and dllm's rewrites "lladamoe")
ARCHITECTURES = ("LLaDAMoEModelLM", "LLaDAMoEModel")

# options of the released config class whose other values change the math (not implemented)
_REFUSED = {
    "clip_qkv": lambda v: v is not None,
    "hidden_act": lambda v: v != "silu",
    "shared_expert_intermediate_size": lambda v: v is not None and v > 0,
}


def is_llada_moe(hf: dict) -> bool:
    """A ``model_type: llada`` config that is LLaDA-MoE's: its architecture, or MoE keys without
    the dense LLaDA's OLMo-style ``d_model``."""
    if any(a in ARCHITECTURES for a in hf.get("architectures") or []):
        return True
    return "num_experts" in hf and "d_model" not in hf


def checkpoint_name(name: str) -> str:
    """Our ``layers.N.mlp.gate.expert_bias`` is the released ``layers.N.mlp.expert_bias`` (a
    buffer of the MoE block, not of its gate); every other name is the Qwen layout's."""
    return qwen_checkpoint_name(name.replace(".mlp.gate.expert_bias", ".mlp.expert_bias"))


def dense_layers(hf: dict) -> int:
    """How many leading layers are dense: ``moe_layer_freq`` is 0 (dense) / 1 (MoE) per layer;
    the engine implements dense layers first, MoE after (DecoderLayer's first_k_dense_replace)."""
    freq = hf.get("moe_layer_freq")
    if freq is None:
        return 0
    if not isinstance(freq, list) or len(freq) != hf["num_hidden_layers"]:
        raise UserError(f"moe_layer_freq {freq!r} must list 0 (dense) or 1 (MoE) for each of the "
                        f"{hf['num_hidden_layers']} layers")
    k = next((i for i, f in enumerate(freq) if f), len(freq))
    if any(not f for f in freq[k:]):
        raise UserError(f"moe_layer_freq {freq!r} is not supported: the engine runs dense layers "
                        f"only before the first MoE layer")
    return k


def moe_from_hf(hf: dict) -> MoEConfig:
    return MoEConfig(
        num_experts=hf["num_experts"], num_experts_per_tok=hf["num_experts_per_tok"],
        moe_intermediate_size=hf["expert_intermediate_size"], norm_topk_prob=False,
        first_k_dense_replace=dense_layers(hf), score_function="softmax",
        expert_bias=bool(hf.get("moe_router_enable_expert_bias")), bias_weights=True)


def rotary_dim_from_hf(hf: dict) -> int:
    head_dim = hf["hidden_size"] // hf["num_attention_heads"]
    factor = hf.get("partial_rotary_factor") or rope_settings(hf).get("partial_rotary_factor")
    return int(head_dim * factor) if factor and 0 < factor < 1 else head_dim


def config_from_hf(hf: dict) -> ModelConfig:
    check_rope(hf, MODEL_TYPE)
    check_unsupported(hf, MODEL_TYPE, _REFUSED)
    dense = hf.get("dense_intermediate_size") or -1
    bias = bool(hf.get("attention_bias", False))
    return ModelConfig(
        model_type=MODEL_TYPE, vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
        num_layers=hf["num_hidden_layers"], num_heads=hf["num_attention_heads"],
        num_kv_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
        # the dense MLP's width (only dense layers use it); the expert width when every layer is MoE
        intermediate_size=dense if dense > 0 else hf["expert_intermediate_size"],
        rope_theta=rope_theta(hf), rotary_dim=rotary_dim_from_hf(hf),
        rms_norm_eps=hf.get("rms_norm_eps", 1e-5), qkv_bias=bias, attn_out_bias=bias,
        qk_norm=bool(hf.get("qk_layernorm")), tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        max_position_embeddings=hf.get("max_position_embeddings", 4096),
        mask_token_id=token_id(hf.get("mask_token_id")), eos_token_id=token_id(hf.get("eos_token_id")),
        pad_token_id=token_id(hf.get("pad_token_id")), bos_token_id=token_id(hf.get("bos_token_id"), None),
        moe=moe_from_hf(hf))


def config_to_hf(cfg: ModelConfig) -> dict:
    """The released config.json's keys (``model_type: llada``, ``LLaDAMoEModelLM``); the ids
    are written only when set (the release has no mask id in its config)."""
    m = cfg.moe
    dense = m.first_k_dense_replace
    out = {
        "architectures": ["LLaDAMoEModelLM"], "model_type": "llada",
        "auto_map": {"AutoConfig": "configuration_lladamoe.LLaDAConfig",
                     "AutoModel": "modeling_lladamoe.LLaDAMoEModelLM",
                     "AutoModelForCausalLM": "modeling_lladamoe.LLaDAMoEModelLM"},
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
        "dense_intermediate_size": cfg.intermediate_size, "expert_intermediate_size": m.moe_intermediate_size,
        "shared_expert_intermediate_size": None, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
        "hidden_act": "silu", "max_position_embeddings": cfg.max_position_embeddings,
        "initializer_range": 0.02, "rms_norm_eps": cfg.rms_norm_eps, "use_cache": False,
        "tie_word_embeddings": cfg.tie_word_embeddings, "rope_theta": cfg.rope_theta,
        "partial_rotary_factor": cfg.rotary_dim / cfg.head_dim, "rope_scaling": None,
        "attention_bias": cfg.qkv_bias, "attention_dropout": 0.0, "clip_qkv": None,
        "num_experts_per_tok": m.num_experts_per_tok, "num_experts": m.num_experts,
        "output_router_logits": False, "router_aux_loss_coef": 0.01, "norm_topk_prob": False,
        "qk_layernorm": cfg.qk_norm, "moe_layer_freq": [0] * dense + [1] * (cfg.num_layers - dense),
        "moe_router_enable_expert_bias": m.expert_bias, "moe_router_score_function": "softmax",
        "routed_scaling_factor": 1, "torch_dtype": "float32",
    }
    ids = {"mask_token_id": cfg.mask_token_id, "eos_token_id": cfg.eos_token_id,
           "pad_token_id": cfg.pad_token_id, "bos_token_id": cfg.bos_token_id}
    out.update({k: v for k, v in ids.items() if v is not None and v >= 0})
    return out


FAMILY = Family(MODEL_TYPE, config_from_hf, config_to_hf, checkpoint_name,
                FULL_ATTENTION_METHODS, mask_token="<|mask|>", end_of_turn_token="<|role_end|>")
