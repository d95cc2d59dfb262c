"""DiffusionGemma (``google/diffusiongemma-26B-A4B-it``, ``model_type: diffusion_gemma``): a
uniform-noise block-diffusion LM on a Gemma-4 MoE stack. The math below was read from
transformers' own implementation (>= 5.23, ``models/diffusion_gemma``); this is our own code.

One parameter stack runs two ways:

- ``encode``: causally over the prompt and the canvases already finished, writing an exact KV
  cache (``EncoderCache``; sliding layers keep only the last ``sliding_window - 1`` keys, the
  ones a later query can still see).
- ``decode``: bidirectionally over the current canvas, whose queries attend to
  [cached encoder K/V ; canvas K/V] without writing the cache; the previous step's logits enter
  as self-conditioning (softmax -> soft embeddings -> a gated MLP added to the canvas
  embeddings). The probabilities are made one chunk of positions at a time
  (``self_conditioning_chunk``): never the whole [B, canvas, vocab] in fp32.

A layer (Gemma-4 text): attention with per-head q/k RMSNorm, a scale-free v norm and a softmax
scale of 1; sliding layers (``head_dim``, ``num_key_value_heads``, RoPE theta 1e4, a
``v_proj``) and full layers (``global_head_dim``, ``num_global_key_value_heads``, proportional
RoPE that rotates only the first ``partial_rotary_factor`` of the frequency pairs, values = the
un-normed key projection); then a dense GeGLU MLP beside 128 routed experts (a softmax top-k
router over an RMS-normed, scaled input, renormalised, times a per-expert scale), each branch
with its own norms, and a per-layer scalar, one for each pass (the checkpoint stores the
encoder's and the decoder's). Embeddings are tied and scaled by sqrt(hidden); logits are
soft-capped (``30 * tanh(x / 30)``).

Checkpoint layout: the decoder holds the stack (``model.decoder.*``: embed_tokens, layers, norm,
self_conditioning); the encoder's copies are tied and not stored, except its layer scalars
(``model.encoder.language_model.layers.N.layer_scalar``). The vision tower
(``model.encoder.vision_tower.*``, ``model.encoder.embed_vision.*``) is skipped: text only.

Not a ``Family`` in ``registry.py``: the engine's families build ``DiffusionLM`` from one
``ModelConfig`` and decode masked diffusion with a mask token; this model has neither (see
``load_diffusion_gemma``).
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..errors import UserError
from .kernels import grouped_mm_fits
from .layers import RMSNorm, apply_rope, grouped_heads, run_experts
from .loader import named_tensors, open_weights, parse_device, read_json, read_weights, resolve_dtype, weight_files
from .parallel import ColumnParallelLinear, RowParallelLinear, Shard, check_divisible, kv_head_part, mark
from .quantize import check_quantization, quantize_model

log = logging.getLogger(__name__)

MODEL_TYPE = "diffusion_gemma"
TEXT_MODEL_TYPE = "diffusion_gemma_text"
SLIDING, FULL = "sliding_attention", "full_attention"
# transformers' defaults for keys a config may leave out
DEFAULT_ROPE = {SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
                FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0}}
DEFAULT_GLOBAL_HEAD_DIM = 512
DEFAULT_SOFTCAP = 30.0
DEFAULT_CANVAS_LENGTH = 256
SELF_CONDITIONING_CHUNK = 64  # positions whose fp32 probabilities exist at once (64 x 262144 x 4 B = 64 MiB)
VISION_PREFIXES = ("model.encoder.vision_tower.", "model.encoder.embed_vision.")
ENCODER_PREFIX = "model.encoder.language_model."


# -- config -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RopeSpec:
    """RoPE of one layer type: rotate-half over the whole head, the first ``rotated_fraction``
    of the frequency pairs rotating (proportional RoPE; the rest get frequency 0: identity)."""
    theta: float
    rotated_fraction: float = 1.0
    factor: float = 1.0

    def inv_freq(self, head_dim: int, device: torch.device) -> Tensor:
        """[head_dim // 2] fp32; exponents over the whole head_dim, as transformers computes them."""
        pairs = int(self.rotated_fraction * head_dim // 2)
        exponents = torch.arange(0, 2 * pairs, 2, device=device, dtype=torch.float32) / head_dim
        freq = torch.cat([1.0 / self.theta ** exponents,
                          torch.zeros(head_dim // 2 - pairs, device=device)])
        return freq / self.factor


@dataclass(frozen=True)
class AttentionSpec:
    """The attention of one layer: its shape, RoPE and window (None: full attention)."""
    head_dim: int
    num_kv_heads: int
    rope: RopeSpec
    window: int | None

    @property
    def is_sliding(self) -> bool:
        return self.window is not None  # sliding layers have a v_proj; full layers read V = K


@dataclass(frozen=True)
class DiffusionGemmaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # the dense MLP's and the self-conditioning MLP's width
    num_heads: int
    layers: tuple[AttentionSpec, ...]
    num_experts: int
    top_k_experts: int
    moe_intermediate_size: int
    rms_norm_eps: float = 1e-6
    final_logit_softcapping: float | None = DEFAULT_SOFTCAP
    attention_bias: bool = False
    canvas_length: int = DEFAULT_CANVAS_LENGTH
    max_position_embeddings: int = 262_144
    pad_token_id: int | None = 0
    bos_token_id: int | None = 2
    eos_token_ids: tuple[int, ...] = (1,)

    def __post_init__(self) -> None:
        for i, spec in enumerate(self.layers):
            if self.num_heads % spec.num_kv_heads:
                raise UserError(f"layer {i}: num_attention_heads {self.num_heads} must be a multiple of "
                                f"its {spec.num_kv_heads} key/value heads")
        if not 1 <= self.top_k_experts <= self.num_experts:
            raise UserError(f"top_k_experts {self.top_k_experts} must be in [1, num_experts={self.num_experts}]")

    @property
    def num_layers(self) -> int:
        return len(self.layers)


def text_config_of(hf: dict) -> dict:
    """The text settings: ``text_config`` of a ``diffusion_gemma`` config, or the whole of a
    ``diffusion_gemma_text`` one."""
    model_type = hf.get("model_type")
    if model_type == TEXT_MODEL_TYPE:
        return hf
    if model_type != MODEL_TYPE:
        raise UserError(f"model_type {model_type!r} is not {MODEL_TYPE!r} or {TEXT_MODEL_TYPE!r}")
    text = hf.get("text_config")
    if not isinstance(text, dict):
        raise UserError(f"a {MODEL_TYPE} config.json needs a \"text_config\" object")
    return text


def layer_types_of(text: dict) -> list[str]:
    """``layer_types``, or transformers' default (5 sliding then 1 full, repeated); the last layer
    is always full attention (transformers forces it, with a warning)."""
    n = text["num_hidden_layers"]
    types = list(text.get("layer_types") or [SLIDING if (i + 1) % 6 else FULL for i in range(n)])
    if len(types) != n or set(types) - {SLIDING, FULL}:
        raise UserError(f"layer_types must list {SLIDING!r} or {FULL!r} for each of the {n} layers, got {types}")
    if types[-1] != FULL:
        log.warning("layer_types: the last layer must use full_attention (as transformers forces it); using it")
        types[-1] = FULL
    return types


def rope_of(text: dict, layer_type: str) -> RopeSpec:
    params = (text.get("rope_parameters") or DEFAULT_ROPE).get(layer_type)
    if not isinstance(params, dict):
        raise UserError(f"rope_parameters has no {layer_type!r} entry")
    kind, fraction = params.get("rope_type", "default"), params.get("partial_rotary_factor") or 1.0
    if kind == "proportional":
        return RopeSpec(float(params["rope_theta"]), float(fraction), float(params.get("factor", 1.0)))
    if kind == "default" and fraction == 1.0:
        return RopeSpec(float(params["rope_theta"]))
    raise UserError(f"rope_parameters[{layer_type!r}] {params!r} is not supported: {MODEL_TYPE} runs "
                    f"rope_type 'default' (whole head) or 'proportional'")


def layer_overrides(text: dict, types: list[str]) -> dict[int, dict]:
    """Per-layer head_dim / num_key_value_heads: ``per_layer_config`` (what transformers writes)
    or, from the released keys, ``global_head_dim`` / ``num_global_key_value_heads`` on full layers."""
    per_layer = text.get("per_layer_config")
    if per_layer:
        out = {int(i): dict(v) for i, v in per_layer.items()}
        for i, values in out.items():
            if set(values) - {"head_dim", "num_key_value_heads"}:
                raise UserError(f"per_layer_config[{i}] {values} overrides keys {MODEL_TYPE} does not implement")
        return out
    full = {"head_dim": text.get("global_head_dim") or DEFAULT_GLOBAL_HEAD_DIM}
    if text.get("num_global_key_value_heads") is not None:
        full["num_key_value_heads"] = text["num_global_key_value_heads"]
    return {i: full for i, t in enumerate(types) if t == FULL}


def attention_specs(text: dict) -> tuple[AttentionSpec, ...]:
    types = layer_types_of(text)
    overrides = layer_overrides(text, types)
    ropes = {t: rope_of(text, t) for t in set(types)}
    specs = []
    for i, layer_type in enumerate(types):
        values = {"head_dim": text["head_dim"], "num_key_value_heads": text["num_key_value_heads"],
                  **overrides.get(i, {})}
        window = text.get("sliding_window", 512) if layer_type == SLIDING else None
        specs.append(AttentionSpec(values["head_dim"], values["num_key_value_heads"], ropes[layer_type], window))
    return tuple(specs)


def eos_ids(value) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, list) else (value,)


def check_text_config(text: dict) -> None:
    """Refuse settings whose math is not implemented here."""
    if text.get("use_bidirectional_attention") == "all":
        raise UserError("use_bidirectional_attention 'all' (a bidirectional encoder) is not supported; "
                        f"{MODEL_TYPE} encodes text causally")
    if text.get("hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
        raise UserError(f"hidden_activation {text['hidden_activation']!r} is not supported; "
                        f"{MODEL_TYPE} uses 'gelu_pytorch_tanh'")
    if not text.get("num_experts"):
        raise UserError(f"{MODEL_TYPE} needs num_experts (its layers always run the expert branch)")


def config_from_hf(hf: dict) -> DiffusionGemmaConfig:
    """The released config.json (top level with ``text_config``; ``vision_config`` ignored)."""
    text = text_config_of(hf)
    check_text_config(text)
    if hf.get("tie_word_embeddings") is False:
        raise UserError("tie_word_embeddings false unties the encoder from the decoder; "
                        f"{MODEL_TYPE} runs one shared stack with tied embeddings")
    softcap = text.get("final_logit_softcapping", DEFAULT_SOFTCAP)
    return DiffusionGemmaConfig(
        vocab_size=text["vocab_size"], hidden_size=text["hidden_size"],
        intermediate_size=text["intermediate_size"], num_heads=text["num_attention_heads"],
        layers=attention_specs(text), num_experts=text["num_experts"], top_k_experts=text["top_k_experts"],
        moe_intermediate_size=text["moe_intermediate_size"], rms_norm_eps=text.get("rms_norm_eps", 1e-6),
        final_logit_softcapping=float(softcap) if softcap else None,
        attention_bias=bool(text.get("attention_bias", False)),
        canvas_length=hf.get("canvas_length") or DEFAULT_CANVAS_LENGTH,
        max_position_embeddings=text.get("max_position_embeddings", 262_144),
        pad_token_id=text.get("pad_token_id"), bos_token_id=text.get("bos_token_id"),
        eos_token_ids=eos_ids(hf.get("eos_token_id") or text.get("eos_token_id")))


# -- the stack ------------------------------------------------------------------------------------
def gemma_rms_norm(x: Tensor, weight: Tensor | None, eps: float) -> Tensor:
    """RMSNorm in fp32, scaled in fp32 (Gemma-4: ``weight``, not ``1 + weight``), then cast."""
    h = x.float()
    h = h * torch.pow(h.pow(2).mean(-1, keepdim=True) + eps, -0.5)
    return (h if weight is None else h * weight.float()).to(x.dtype)


class GemmaRMSNorm(RMSNorm):
    """``RMSNorm``'s weight and eps, Gemma's order (``gemma_rms_norm``)."""

    def forward(self, x: Tensor) -> Tensor:
        return gemma_rms_norm(x, self.weight, self.eps)


def gelu_tanh(x: Tensor) -> Tensor:
    """GELU, tanh approximation (the checkpoint's ``gelu_pytorch_tanh``)."""
    return F.gelu(x, approximate="tanh")


class GatedMLP(nn.Module):
    """GeGLU: down(gelu_tanh(gate x) * up x). With a ``shard``: this rank's slice of the
    intermediate features, the partial outputs summed over ranks (one all-reduce)."""

    def __init__(self, hidden_size: int, intermediate_size: int, shard: Shard | None = None) -> None:
        super().__init__()
        if shard is None:
            self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
            self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
            self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
            return
        part = [(intermediate_size, *shard.part(intermediate_size))]
        self.gate_proj = ColumnParallelLinear(hidden_size, part, bias=False)
        self.up_proj = ColumnParallelLinear(hidden_size, part, bias=False)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, shard)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(gelu_tanh(self.gate_proj(x)) * self.up_proj(x))


class GemmaRouter(nn.Module):
    """Softmax top-k over all experts (fp32) of the RMS-normed input times ``scale / sqrt(d)``;
    the top-k weights renormalised to sum to 1, then times ``per_expert_scale``."""

    def __init__(self, cfg: DiffusionGemmaConfig) -> None:
        super().__init__()
        self.eps, self.top_k = cfg.rms_norm_eps, cfg.top_k_experts
        self.root = cfg.hidden_size ** -0.5
        self.proj = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.scale = nn.Parameter(torch.ones(cfg.hidden_size))
        self.per_expert_scale = nn.Parameter(torch.ones(cfg.num_experts))

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """x [N, d] -> (weights [N, k] fp32, experts [N, k])."""
        h = gemma_rms_norm(x, None, self.eps) * self.scale * self.root
        probs = self.proj(h).softmax(-1, dtype=torch.float32)  # [N, E]
        weights, experts = probs.topk(self.top_k, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        return weights * self.per_expert_scale[experts], experts


class GemmaExperts(nn.Module):
    """The routed experts, stacked as the checkpoint stores them: ``gate_up_proj`` [E, 2I, d]
    (gate rows first), ``down_proj`` [E, d, I]."""

    STACKED = ("gate_up_proj", "down_proj")  # what weight-only quantization takes (models/quantize.py)

    def __init__(self, cfg: DiffusionGemmaConfig, shard: Shard | None = None) -> None:
        """With a ``shard`` (expert parallelism): this rank's ``num_experts / size`` whole
        experts, [first, first + local); the router stays whole on every rank, each rank runs
        the pairs routed to its experts and the outputs are summed over ranks (one all-reduce)."""
        super().__init__()
        e, d, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.shard = shard
        self.first, end = (0, e) if shard is None else shard.part(e)
        self.gate_up_proj = nn.Parameter(torch.empty(end - self.first, 2 * i, d))
        self.down_proj = nn.Parameter(torch.empty(end - self.first, d, i))
        nn.init.normal_(self.gate_up_proj, std=0.02)
        nn.init.normal_(self.down_proj, std=0.02)
        if shard is not None:
            mark(self.gate_up_proj, (e, 2 * i, d), [(0, self.first, end)])
            mark(self.down_proj, (e, d, i), [(0, self.first, end)])

    def forward(self, x: Tensor, weights: Tensor, experts: Tensor) -> Tensor:
        """The routed experts on x [N, d] (``layers.run_experts``): two grouped GEMMs over the
        stacked weights where the device has them for these shapes (``grouped_mm_fits``), else
        one matmul chain per expert that got tokens; summed over ranks under a shard."""
        stacks = (self.gate_up_proj, self.down_proj)
        out = run_experts(x, weights, experts, self.first, self.gate_up_proj.shape[0], self.shard is not None,
                          stacks if grouped_mm_fits(x, *stacks) else None, gelu_tanh, self.expert)
        if self.shard is not None:
            self.shard.all_reduce(out)
        return out.to(x.dtype)

    def expert(self, e: int, tokens: Tensor) -> Tensor:
        """This process's ``e``-th expert on ``tokens``."""
        gate, up = F.linear(tokens, self.gate_up_proj[e]).chunk(2, dim=-1)
        return F.linear(gelu_tanh(gate) * up, self.down_proj[e])


class GemmaAttention(nn.Module):
    """q/k/v projections, per-head q/k RMSNorm, a scale-free v norm, RoPE on q/k, SDPA with a
    softmax scale of 1 (the norms set the scale). Full layers have no ``v_proj``: V is the
    key projection before its norm and RoPE."""

    def __init__(self, cfg: DiffusionGemmaConfig, spec: AttentionSpec, shard: Shard | None = None) -> None:
        """With a ``shard``: this rank's ``num_heads / size`` query heads and the key/value
        heads they read (split, or each copied on several ranks when fewer than the ranks); the
        output projection's partial sums are added over ranks (one all-reduce)."""
        super().__init__()
        d, hd, bias = cfg.hidden_size, spec.head_dim, cfg.attention_bias
        self.head_dim, self.eps = hd, cfg.rms_norm_eps
        if shard is None:
            self.q_proj = nn.Linear(d, cfg.num_heads * hd, bias=bias)
            self.k_proj = nn.Linear(d, spec.num_kv_heads * hd, bias=bias)
            self.v_proj = nn.Linear(d, spec.num_kv_heads * hd, bias=bias) if spec.is_sliding else None
            self.o_proj = nn.Linear(cfg.num_heads * hd, d, bias=bias)
        else:
            heads = cfg.num_heads // shard.size
            first_kv, kv = kv_head_part(cfg.num_heads, spec.num_kv_heads, shard)
            q_part = [(cfg.num_heads * hd, shard.rank * heads * hd, (shard.rank + 1) * heads * hd)]
            kv_part = [(spec.num_kv_heads * hd, first_kv * hd, (first_kv + kv) * hd)]
            self.q_proj = ColumnParallelLinear(d, q_part, bias)
            self.k_proj = ColumnParallelLinear(d, kv_part, bias)
            self.v_proj = ColumnParallelLinear(d, kv_part, bias) if spec.is_sliding else None
            self.o_proj = RowParallelLinear(cfg.num_heads * hd, d, shard, bias=bias)
        self.q_norm = GemmaRMSNorm(hd, cfg.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(hd, cfg.rms_norm_eps)

    def project(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        b, t, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, t, -1, self.head_dim)).transpose(1, 2)  # [B, H, T, D]
        k = self.k_proj(x).view(b, t, -1, self.head_dim)
        v = k if self.v_proj is None else self.v_proj(x).view(b, t, -1, self.head_dim)
        k = self.k_norm(k).transpose(1, 2)  # [B, Hkv, T, D]
        v = gemma_rms_norm(v, None, self.eps).transpose(1, 2)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, past: tuple[Tensor, Tensor] | None,
                mask: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
        """The output for x [B, T, d] and the keys/values it attended to ([past ; new])."""
        q, k, v = self.project(x, cos, sin)
        if past is not None:
            k, v = torch.cat([past[0], k], dim=2), torch.cat([past[1], v], dim=2)
        kk, vv, gqa = grouped_heads(q, k, v, mask)
        out = F.scaled_dot_product_attention(q, kk, vv, attn_mask=mask, scale=1.0, **gqa)
        out = out.transpose(1, 2).reshape(x.shape[0], x.shape[1], -1)
        return self.o_proj(out), k, v


class GemmaLayer(nn.Module):
    """Attention, then the dense MLP and the routed experts side by side (the router and the
    experts read the post-attention residual), each branch with its own norms."""

    def __init__(self, cfg: DiffusionGemmaConfig, spec: AttentionSpec, shard: Shard | None = None) -> None:
        super().__init__()
        d, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.spec = spec
        self.self_attn = GemmaAttention(cfg, spec, shard)
        self.mlp = GatedMLP(d, cfg.intermediate_size, shard)
        self.router = GemmaRouter(cfg)
        self.experts = GemmaExperts(cfg, shard)
        for name in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm", "post_feedforward_layernorm_1",
                     "pre_feedforward_layernorm_2", "post_feedforward_layernorm_2"):
            setattr(self, name, GemmaRMSNorm(d, eps))
        # the checkpoint's per-layer output scalar, one for each pass
        self.register_buffer("layer_scalar", torch.ones(1))
        self.register_buffer("encoder_layer_scalar", torch.ones(1))

    def forward(self, h: Tensor, cos: Tensor, sin: Tensor, past: tuple[Tensor, Tensor] | None,
                mask: Tensor | None, is_encoder: bool) -> tuple[Tensor, Tensor, Tensor]:
        attn, k, v = self.self_attn(self.input_layernorm(h), cos, sin, past, mask)
        h = h + self.post_attention_layernorm(attn)
        dense = self.post_feedforward_layernorm_1(self.mlp(self.pre_feedforward_layernorm(h)))
        flat = h.reshape(-1, h.shape[-1])  # [N, d]
        weights, experts = self.router(flat)
        routed = self.experts(self.pre_feedforward_layernorm_2(flat), weights, experts)
        routed = self.post_feedforward_layernorm_2(routed.view(h.shape))
        h = h + self.post_feedforward_layernorm(dense + routed)
        return h * (self.encoder_layer_scalar if is_encoder else self.layer_scalar), k, v


class SelfConditioning(nn.Module):
    """post_norm(canvas embeddings + GeGLU(pre_norm(soft embeddings))); post_norm has no scale
    and applies at the first step too, when there is no signal (the GeGLU of 0 is 0)."""

    def __init__(self, cfg: DiffusionGemmaConfig) -> None:
        super().__init__()
        self.pre_norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.eps = cfg.rms_norm_eps

    def forward(self, embeds: Tensor, soft: Tensor | None) -> Tensor:
        if soft is not None:
            s = self.pre_norm(soft)
            embeds = embeds + self.down_proj(gelu_tanh(self.gate_proj(s)) * self.up_proj(s))
        return gemma_rms_norm(embeds, None, self.eps)


# -- the cache ------------------------------------------------------------------------------------
@dataclass
class EncoderCache:
    """The encoder's K/V per layer, [B, Hkv, kept, D]: every token on full layers, the last
    ``window - 1`` on sliding ones (all a later query can see; what transformers'
    ``DynamicCache`` keeps, and what the decoder's sliding layers then attend to).
    ``length``: columns encoded, padding included (the next column, which masks and windows
    count in; also the next RoPE position unless a forward gives ``positions`` per row);
    ``key_valid`` [B, length]: False on padding (None: no padding)."""
    keys: list[Tensor | None]
    values: list[Tensor | None]
    length: int = 0
    key_valid: Tensor | None = None

    @classmethod
    def empty(cls, num_layers: int) -> EncoderCache:
        return cls([None] * num_layers, [None] * num_layers)

    def past(self, i: int) -> tuple[Tensor, Tensor] | None:
        return None if self.keys[i] is None else (self.keys[i], self.values[i])

    def kept(self, i: int) -> int:
        return 0 if self.keys[i] is None else self.keys[i].shape[2]

    def store(self, i: int, k: Tensor, v: Tensor, window: int | None) -> None:
        start = 0 if window is None else max(k.shape[2] - (window - 1), 0)
        self.keys[i], self.values[i] = k[:, :, start:], v[:, :, start:]

    def extend_valid(self, valid: Tensor | None, num_new: int, batch: int, device: torch.device) -> None:
        if valid is None and self.key_valid is None:
            return
        old = self.key_valid if self.key_valid is not None else torch.ones(
            batch, self.length, dtype=torch.bool, device=device)
        new = valid.bool() if valid is not None else torch.ones(batch, num_new, dtype=torch.bool, device=device)
        self.key_valid = torch.cat([old, new], dim=1)

    def trim(self, columns: int) -> EncoderCache:
        """Without its first ``columns`` columns (padding in every row, the caller knows: masked
        keys, so every row attends as before); views, no copy."""
        if columns <= 0:
            return self
        length = self.length - columns

        def cut(t: Tensor | None) -> Tensor | None:  # a sliding layer may hold fewer columns already
            return t if t is None or t.shape[2] <= length else t[:, :, t.shape[2] - length:]

        return EncoderCache([cut(k) for k in self.keys], [cut(v) for v in self.values], length,
                            None if self.key_valid is None else self.key_valid[:, columns:])

    def rows(self, index: Tensor) -> EncoderCache:
        """The cache of some rows, ``index`` [b] into the batch (a copy of their K/V): what a
        forward that leaves the other rows out reads."""
        def pick(t: Tensor | None) -> Tensor | None:
            return None if t is None else t.index_select(0, index)

        return EncoderCache([pick(k) for k in self.keys], [pick(v) for v in self.values], self.length,
                            pick(self.key_valid))


def encoder_mask(cache: EncoderCache, kept: int, num_new: int, window: int | None,
                 device: torch.device) -> Tensor:
    """[B|1, 1, T, kept + T] bool: causal over token indices, within ``window`` (a query sees
    itself and the ``window - 1`` tokens before it), padding keys masked (a query always sees
    itself, so a padding row stays finite). ``cache.length`` already counts the new tokens."""
    start = cache.length - num_new
    q = torch.arange(start, cache.length, device=device)[:, None]
    k = torch.arange(start - kept, cache.length, device=device)[None]
    allowed = k <= q
    if window is not None:
        allowed = allowed & (k > q - window)
    if cache.key_valid is not None:
        allowed = (allowed & cache.key_valid[:, None, start - kept:]) | (k == q)
    return allowed[None, None] if allowed.dim() == 2 else allowed[:, None]


def decoder_mask(cache: EncoderCache, kept: int, canvas: int) -> Tensor | None:
    """[B, 1, 1, kept + canvas] bool over [cached keys ; canvas] (padding keys masked); None
    without padding: every canvas query sees every key."""
    if cache.key_valid is None:
        return None
    valid = cache.key_valid[:, cache.length - kept:]
    ones = torch.ones(valid.shape[0], canvas, dtype=torch.bool, device=valid.device)
    return torch.cat([valid, ones], dim=1)[:, None, None]


# -- the model ------------------------------------------------------------------------------------
@dataclass
class StepRope:
    """cos/sin [B, T, head_dim] per layer spec for one forward's positions."""
    positions: Tensor
    tables: dict = field(default_factory=dict)

    def get(self, spec: AttentionSpec) -> tuple[Tensor, Tensor]:
        key = (spec.head_dim, spec.rope)
        if key not in self.tables:
            freqs = self.positions.float()[..., None] * spec.rope.inv_freq(spec.head_dim, self.positions.device)
            emb = torch.cat([freqs, freqs], dim=-1)
            self.tables[key] = emb.cos(), emb.sin()
        return self.tables[key]


class DiffusionGemma(nn.Module):
    """The shared stack with its two passes: ``encode`` (causal, fills an ``EncoderCache``) and
    ``decode`` (bidirectional over a canvas against the cache, self-conditioned, returns logits)."""

    def __init__(self, cfg: DiffusionGemmaConfig, shard: Shard | None = None) -> None:
        """``shard``: tensor and expert parallelism (``check_shardable``): each layer's
        attention heads, dense MLP and experts split over the ranks, three all-reduces a layer;
        the embedding (and so the tied head and the self-conditioning's soft embeddings), the
        norms, the routers and the self-conditioning MLP whole on every rank, so every rank
        computes the same full logits and the sampler decides the same on each."""
        super().__init__()
        self.config, self.shard = cfg, shard
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(GemmaLayer(cfg, spec, shard) for spec in cfg.layers)
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_conditioning = SelfConditioning(cfg)
        self.self_conditioning_chunk = SELF_CONDITIONING_CHUNK

    def new_cache(self) -> EncoderCache:
        return EncoderCache.empty(self.config.num_layers)

    def embed_scale(self) -> Tensor:
        """sqrt(hidden) in the embedding's dtype (rounded as transformers rounds it: 53.07 -> 53 in bf16)."""
        w = self.embed_tokens.weight
        return torch.tensor(self.config.hidden_size ** 0.5, device=w.device).to(w.dtype)

    def embed(self, input_ids: Tensor) -> Tensor:
        return self.embed_tokens(input_ids) * self.embed_scale()

    def positions_of(self, cache: EncoderCache, num: int, positions: Tensor | None, device) -> Tensor:
        """RoPE positions [B|1, T]: given (per row: a left-padded row counting from its first
        token), or the columns after those encoded (padding counted, as transformers counts)."""
        if positions is not None:
            return positions if positions.dim() == 2 else positions[None]
        return torch.arange(cache.length, cache.length + num, device=device)[None]

    @torch.no_grad()
    def encode(self, input_ids: Tensor, cache: EncoderCache, attention_mask: Tensor | None = None,
               positions: Tensor | None = None) -> Tensor:
        """Run ``input_ids`` [B, T] causally after what ``cache`` holds and append their K/V to it.
        ``attention_mask`` [B, T]: 1 = token, 0 = padding (never attended to afterwards).
        Returns the final normed hidden states [B, T, d] (``logits`` turns them into logits)."""
        b, t = input_ids.shape
        rope = StepRope(self.positions_of(cache, t, positions, input_ids.device))
        cache.extend_valid(attention_mask, t, b, input_ids.device)
        cache.length += t
        h = self.embed(input_ids)
        for i, layer in enumerate(self.layers):
            spec = layer.spec
            mask = encoder_mask(cache, cache.kept(i), t, spec.window, input_ids.device)
            h, k, v = layer(h, *rope.get(spec), cache.past(i), mask, is_encoder=True)
            cache.store(i, k, v, spec.window)
        return self.norm(h)

    @torch.no_grad()
    def decode(self, canvas_ids: Tensor, cache: EncoderCache, self_conditioning_logits: Tensor | None = None,
               self_conditioning_mask: Tensor | None = None, positions: Tensor | None = None) -> Tensor:
        """Logits [B, C, V] (fp32, soft-capped) of the canvas ``canvas_ids`` [B, C], attending to
        [cached encoder K/V ; canvas K/V] in both directions; ``cache`` is not changed.

        ``self_conditioning_logits`` [B, C, V]: the previous step's (processed) logits, None at
        the first step; ``self_conditioning_mask`` [B] bool: rows whose signal is dropped."""
        c = canvas_ids.shape[1]
        rope = StepRope(self.positions_of(cache, c, positions, canvas_ids.device))
        soft = None
        if self_conditioning_logits is not None:
            soft = self.soft_embeddings(self_conditioning_logits)
            if self_conditioning_mask is not None:
                soft = soft * self_conditioning_mask.to(soft.dtype)[:, None, None]
        h = self.self_conditioning(self.embed(canvas_ids), soft)
        for i, layer in enumerate(self.layers):
            mask = decoder_mask(cache, cache.kept(i), c)
            h, _, _ = layer(h, *rope.get(layer.spec), cache.past(i), mask, is_encoder=False)
        return self.logits(self.norm(h))

    def soft_embeddings(self, logits: Tensor) -> Tensor:
        """softmax(logits) @ E * sqrt(d), [B, C, d]; the fp32 probabilities exist for at most
        ``self_conditioning_chunk`` positions at a time (a full [B, C, V] would be 256 MiB per
        row at V = 262144)."""
        w = self.embed_tokens.weight
        flat = logits.reshape(-1, logits.shape[-1])  # [B*C, V]
        out = torch.empty(flat.shape[0], w.shape[1], dtype=w.dtype, device=w.device)
        step = max(int(self.self_conditioning_chunk), 1)
        for start in range(0, flat.shape[0], step):
            probs = flat[start:start + step].softmax(-1, dtype=torch.float32)  # [chunk, V]: the one chunk
            out[start:start + step] = probs.to(w.dtype) @ w
            del probs
        return out.view(*logits.shape[:-1], -1) * self.embed_scale()

    def logits(self, hidden: Tensor) -> Tensor:
        """Tied head, in fp32, soft-capped: cap * tanh(x / cap)."""
        logits = F.linear(hidden, self.embed_tokens.weight).float()
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap


def check_shardable(cfg: DiffusionGemmaConfig, size: int) -> None:
    """Refuse, naming the field and the sizes, a model whose heads, widths or experts do not
    split over ``size`` ranks (key/value heads fewer than the ranks are copied, as the other
    families' are)."""
    check_divisible({"num_attention_heads": cfg.num_heads, "intermediate_size": cfg.intermediate_size,
                     "num_experts": cfg.num_experts}, size)
    for kind, spec in (("sliding", next((s for s in cfg.layers if s.is_sliding), None)),
                       ("full", next((s for s in cfg.layers if not s.is_sliding), None))):
        if spec is not None and spec.num_kv_heads % size and size % spec.num_kv_heads:
            raise UserError(f"the {kind} layers' {spec.num_kv_heads} key/value heads and tensor_parallel_size "
                            f"{size}: one must divide the other")


# -- checkpoint -----------------------------------------------------------------------------------
def checkpoint_name(name: str) -> str:
    """Our tensor name -> the released one: the decoder holds the stack; the encoder stores only
    its layer scalars."""
    if name.endswith(".encoder_layer_scalar"):
        return ENCODER_PREFIX + name.removesuffix("encoder_layer_scalar") + "layer_scalar"
    return f"model.decoder.{name}"


def skipped_tensor(name: str) -> bool:
    """Checkpoint tensors the text model does not read: the vision tower and its embedder, the
    encoder's tied duplicates of the decoder's stack, the tied head, RoPE tables."""
    return (name.startswith(VISION_PREFIXES) or name == "lm_head.weight" or name.endswith("inv_freq")
            or (name.startswith(ENCODER_PREFIX) and not name.endswith(".layer_scalar")))


def weight_plan(folder: Path, model: DiffusionGemma) -> dict[Path, list[tuple[str, str, list | None]]]:
    """(checkpoint name, our name, the slices this rank holds: None for all) to read from each
    file, every name and shape checked first."""
    params = named_tensors(model)
    names = {checkpoint_name(n): n for n in params}
    plan: dict[Path, list[tuple[str, str]]] = {}
    found, vision = set(), 0
    for file in weight_files(folder):
        plan[file] = []
        with open_weights(file) as f:
            for ckpt in f.keys():
                vision += ckpt.startswith(VISION_PREFIXES)
                if skipped_tensor(ckpt) and ckpt not in names:
                    continue
                if ckpt not in names:
                    raise UserError(f"checkpoint {str(folder)!r}: unexpected tensor {ckpt} for {MODEL_TYPE}")
                param = params[names[ckpt]]
                check_shape(ckpt, tuple(f.get_slice(ckpt).get_shape()), param)
                plan[file].append((ckpt, names[ckpt], getattr(param, "load_slices", None)))
                found.add(ckpt)
    missing = sorted(set(names) - found)
    if missing:
        raise UserError(f"checkpoint {str(folder)!r} does not match its config ({MODEL_TYPE}): "
                        f"missing tensors {missing[:8]}")
    if vision:
        log.warning("%s: skipping %d vision-tower tensors (text prompts only)", folder, vision)
    return plan


def check_shape(name: str, shape: tuple, param: Tensor) -> None:
    full = tuple(getattr(param, "full_shape", param.shape))  # a rank's slice: the whole tensor's
    if shape != full:
        raise UserError(f"tensor {name} has shape {shape} but the config implies {full}")


def read_config(folder: Path) -> tuple[dict, DiffusionGemmaConfig]:
    """``folder``'s config.json and the config it gives, nothing else read."""
    hf = read_json(folder / "config.json", "a JSON object of model settings")
    try:
        return hf, config_from_hf(hf)
    except KeyError as e:
        raise UserError(f"{folder / 'config.json'}: missing key {e} (needed by {MODEL_TYPE})") from None


def load_diffusion_gemma(path: str | Path, dtype: str | torch.dtype = "float32",
                         device: str | torch.device = "cpu", revision: str | None = None,
                         quantization: str | None = None, shard: Shard | None = None) -> DiffusionGemma:
    """A released-layout DiffusionGemma folder (config.json with ``text_config``, safetensors
    shards), or a Hugging Face id (``google/diffusiongemma-26B-A4B-it``, at ``revision``: from
    the cache, downloaded when missing, as every family's ids: ``hub.resolve_model``), as a
    ``DiffusionGemma``, without transformers or remote code. Built on the meta device,
    allocated once in ``dtype`` on ``device``, then filled tensor by tensor; on the ``meta``
    device nothing is read (config and shapes only). ``dtype`` ``"auto"``: the checkpoint's.
    ``quantization`` (``"int8"`` / ``"int4"``): checked before any weight is read, applied once
    they are (``models/quantize.py``; ``model.quantization`` reports what it quantized).
    ``shard``: build and read only this tensor-parallel rank's slices (``check_shardable``;
    ``model.loaded_bytes`` says how many bytes of weights it read)."""
    from ..hub import resolve_model
    folder = resolve_model(path, revision)
    device = parse_device(device)
    hf, cfg = read_config(folder)
    dtype = resolve_dtype(dtype, hf, folder)
    quantization = check_quantization(quantization, device, dtype)
    if shard is not None:
        check_shardable(cfg, shard.size)
    with torch.device("meta"):
        model = DiffusionGemma(cfg, shard)
    model.to(dtype)
    model.quantization = None
    if device.type == "meta":
        return model.eval()
    plan = weight_plan(folder, model)
    model.to_empty(device=device)
    model.loaded_bytes = read_weights(model, plan)
    if quantization is not None:
        model.quantization = quantize_model(model, quantization)
    return model.eval()


def num_parameters(model: nn.Module) -> int:
    """Parameters of the text model (buffers excluded), meta tensors included."""
    return sum(math.prod(p.shape) for p in model.parameters())
