"""The one transformer stack every family uses: RMSNorm, RoPE, attention, MLP / MoE and the layer loop.

Family files only say how their checkpoint names map onto these modules, which attention pattern
they use and whether logits are shifted. Strategies never edit this file's call signatures: they
enter through ``ForwardContext`` (positions, masks, KV cache, hooks).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..config import ModelConfig, MoEConfig
from .context import ForwardContext, RowSplit, block_causal_mask
from .kernels import grouped_mm_fits
from .parallel import (ColumnParallelLinear, ParallelLMHead, RowParallelLinear, Shard,
                       VocabParallelEmbedding, kv_heads_of)

def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """Normalise in fp32, cast back, then scale (LLaDA and Qwen agree on this order); also the
    function ``--compile`` compiles (``models/compiled.py``)."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.weight, self.eps)


def rope_cos_sin(positions: Tensor, rotary_dim: int, theta: float) -> tuple[Tensor, Tensor]:
    """cos/sin [B, T, rotary_dim] in fp32 for non-interleaved rotate-half RoPE."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, device=positions.device,
                                             dtype=torch.float32) / rotary_dim))
    freqs = positions.float()[..., None] * inv_freq  # [B, T, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


class RotaryTable:
    """RoPE's cos/sin per position, computed once per device and grown on demand: a step looks
    its positions up instead of recomputing cos/sin (same values: ``rope_cos_sin`` of each
    position, element for element). fp32 whatever the model's dtype, as ``rope_cos_sin``."""

    def __init__(self, rotary_dim: int, theta: float) -> None:
        self.rotary_dim, self.theta = rotary_dim, theta
        self.tables: dict[torch.device, tuple[Tensor, Tensor]] = {}  # device -> cos, sin [N, D]

    def lookup(self, positions: Tensor, bound: int | None = None) -> tuple[Tensor, Tensor]:
        """cos/sin [B, T, rotary_dim] of ``positions`` [B, T]; ``bound``: every position is
        below it (host int); None reads the largest position from the device."""
        if bound is None:
            bound = int(positions.max()) + 1 if positions.numel() else 1
        cos, sin = self.table(positions.device, bound)
        return F.embedding(positions, cos), F.embedding(positions, sin)  # row gathers (fastest on CPU)

    def table(self, device: torch.device, size: int) -> tuple[Tensor, Tensor]:
        """The tables of ``device``, at least ``size`` positions long (grown to a power of two)."""
        cos, sin = self.tables.get(device, (None, None))
        if cos is None or cos.shape[0] < size:
            n = 1 << max(size - 1, 0).bit_length()
            cos, sin = rope_cos_sin(torch.arange(n, device=device)[None], self.rotary_dim, self.theta)
            cos, sin = self.tables[device] = cos[0], sin[0]
        return cos, sin


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate x [B, H, T, D] in fp32 (as LLaDA does), return in x's dtype. Partial RoPE
    (GPT-NeoX style, LLaDA2.0): only the first cos.shape[-1] dims of each head rotate."""
    rot = cos.shape[-1]
    xf = x[..., :rot].float()
    half = rot // 2
    rotated = torch.cat((-xf[..., half:], xf[..., :half]), dim=-1)
    out = (xf * cos[:, None] + rotated * sin[:, None]).to(x.dtype)
    return out if rot == x.shape[-1] else torch.cat((out, x[..., rot:]), dim=-1)


# devices whose fused SDPA kernels take a mask but not ``enable_gqa`` (``grouped_heads``)
EXPAND_GQA_WITH_MASK = frozenset({"cuda"})


def ragged_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, split: RowSplit | None) -> Tensor:
    """SDPA of q [B, H, T, D]; with a ``split`` (``context.row_groups``) as two calls over query
    ranges. ``mask`` None (every query sees every key) lets SDPA pick its fused kernels without
    a mask.

    A batch that mixes rows computing a whole canvas with rows computing one block (a sequence at
    its block's first step beside sequences mid-block; FOCUS or ES rows that kept few tokens)
    would pay the widest row's attention in every row. Split, every row runs its first
    ``split.narrow`` queries in place (no copy of its K/V), and only the wide rows run the rest,
    so each query is computed once. A query's result does not depend on the others in its call.

    k, v may hold fewer heads than q (grouped-query attention: query head h reads K/V head
    h // (H / Hkv)); ``grouped_heads`` says how they are read."""
    k, v, gqa = grouped_heads(q, k, v, mask)
    if split is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **gqa)
    rows, lo, hi = split.wide, split.narrow, split.width
    out = q.new_zeros(q.shape[:3] + v.shape[-1:])
    out[:, :, :lo] = F.scaled_dot_product_attention(
        q[:, :, :lo], k, v, attn_mask=None if mask is None else mask[:, :, :lo], **gqa)
    out[rows, :, lo:hi] = F.scaled_dot_product_attention(
        q[rows, :, lo:hi], k[rows], v[rows], attn_mask=None if mask is None else mask[rows, :, lo:hi], **gqa)
    return out


def grouped_heads(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> tuple[Tensor, Tensor, dict]:
    """K/V as SDPA should read them, and its ``enable_gqa`` argument, chosen per device.

    Grouped-query attention (fewer K/V heads than query heads) is read in place through
    ``enable_gqa``, except on CUDA with a mask (block-causal families; a padded batch): there
    only the math kernel takes a mask together with ``enable_gqa`` (flash takes no mask, the
    memory-efficient and cuDNN kernels no ``enable_gqa``), and it materialises every score. K/V
    are then expanded to the query heads, one copy per layer, so the memory-efficient kernel
    takes the bool mask. The CPU keeps ``enable_gqa`` (its fused kernel takes both). Same
    values either way."""
    if k.shape[1] == q.shape[1]:
        return k, v, {}
    if mask is not None and q.device.type in EXPAND_GQA_WITH_MASK:
        repeat = q.shape[1] // k.shape[1]
        return k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1), {}
    return k, v, {"enable_gqa": True}


class Attention(nn.Module):
    """Self-attention over this rank's heads (all of them without a ``shard``): column-parallel
    q/k/v, row-parallel o followed by an all-reduce."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, shard: Shard | None = None) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        d = cfg.hidden_size
        self.fused_qkv = cfg.fused_qkv
        self.qkv_sizes = [n * self.head_dim for n in (self.num_heads, self.num_kv_heads, self.num_kv_heads)]
        if shard is not None:
            self.shard_projections(cfg, shard)
        elif cfg.fused_qkv:  # LLaDA2.0 / Ling: one projection, rows Q | K | V
            self.qkv_proj = nn.Linear(d, sum(self.qkv_sizes), bias=cfg.qkv_bias)
        else:
            self.q_proj = nn.Linear(d, self.qkv_sizes[0], bias=cfg.qkv_bias)
            self.k_proj = nn.Linear(d, self.qkv_sizes[1], bias=cfg.qkv_bias)
            self.v_proj = nn.Linear(d, self.qkv_sizes[2], bias=cfg.qkv_bias)
        if shard is None:
            self.o_proj = nn.Linear(self.num_heads * self.head_dim, d, bias=cfg.attn_out_bias)
        if cfg.qk_norm:  # Qwen3 / SDAR: per-head RMSNorm before RoPE
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def shard_projections(self, cfg: ModelConfig, shard: Shard) -> None:
        """This rank's query heads and the KV heads they read (``kv_heads_of``)."""
        d, hd = cfg.hidden_size, self.head_dim
        q_start, q_end = shard.part(cfg.num_heads)
        kv_start, self.num_kv_heads = kv_heads_of(cfg, shard)
        self.num_heads = q_end - q_start
        q = (cfg.num_heads * hd, q_start * hd, q_end * hd)
        kv = (cfg.num_kv_heads * hd, kv_start * hd, (kv_start + self.num_kv_heads) * hd)
        self.qkv_sizes = [self.num_heads * hd, self.num_kv_heads * hd, self.num_kv_heads * hd]
        if cfg.fused_qkv:
            self.qkv_proj = ColumnParallelLinear(d, [q, kv, kv], cfg.qkv_bias)
        else:
            self.q_proj = ColumnParallelLinear(d, [q], cfg.qkv_bias)
            self.k_proj = ColumnParallelLinear(d, [kv], cfg.qkv_bias)
            self.v_proj = ColumnParallelLinear(d, [kv], cfg.qkv_bias)
        self.o_proj = RowParallelLinear(cfg.num_heads * hd, d, shard, bias=cfg.attn_out_bias)

    def project(self, x: Tensor, ctx: ForwardContext) -> tuple[Tensor, Tensor, Tensor]:
        """Q, K, V [B, H, T, D] of x, the live tokens in ``ctx``'s layout (``ForwardContext.pack``)."""
        b, t = ctx.token_valid.shape
        if self.fused_qkv:
            q, k, v = ctx.unpack(self.qkv_proj(x)).split(self.qkv_sizes, dim=-1)
        elif ctx.live_index() is not None:  # packed: the three unpacked as one
            qkv = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)
            q, k, v = ctx.unpack(qkv).split(self.qkv_sizes, dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.view(b, t, self.num_heads, self.head_dim).transpose(1, 2)  # [B, H, T, D]
        k = k.view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = v.view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return apply_rope(q, ctx.cos, ctx.sin), apply_rope(k, ctx.cos, ctx.sin), v

    def forward(self, x: Tensor, ctx: ForwardContext) -> tuple[Tensor, Tensor | None, ForwardContext]:
        """x: the live tokens in ``ctx``'s layout. Returns the attention output of the live
        tokens, the kept index [B, K] when a hook shrank the token set after Q/K/V (the caller
        gathers its residual with it; else None), and the context the output is live in (a new
        one when the hook shrank the set), in that context's layout."""
        q, k, v = self.project(x, ctx)
        if ctx.cache is not None:
            # K/V of every token are written before any eviction (FOCUS's layer-1 K/V)
            ctx.write_kv(self.layer_idx, k, v)
        keep = ctx.hooks.after_qk(self.layer_idx, q, k, ctx) if ctx.hooks is not None else None
        if keep is not None:
            q = torch.gather(q, 2, keep.index[:, None, :, None].expand(-1, q.shape[1], -1, q.shape[-1]))
            ctx = ctx.keep(keep)
        if ctx.cache is not None:
            k, v = ctx.cache.read(self.layer_idx, ctx.num_keys())
        mask = ctx.attention_mask(k.shape[2])
        out = ragged_attention(q, k, v, mask, ctx.attention_rows())  # [B, H, T, D]
        out = out.transpose(1, 2).reshape(q.shape[0], q.shape[2], -1)
        return self.o_proj(ctx.pack(out)), (keep.index if keep is not None else None), ctx


class MLP(nn.Module):
    """SwiGLU: down(silu(gate x) * up x). With a ``shard``: gate/up column-parallel, down
    row-parallel (its all-reduce off when ``reduce`` is False: the caller sums)."""

    def __init__(self, hidden_size: int, intermediate_size: int, shard: Shard | None = None,
                 reduce: bool = True) -> None:
        super().__init__()
        if shard is None:
            self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
            self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
            self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
            return
        part = (intermediate_size, *shard.part(intermediate_size))
        self.gate_proj = ColumnParallelLinear(hidden_size, [part], bias=False)
        self.up_proj = ColumnParallelLinear(hidden_size, [part], bias=False)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, shard, reduce=reduce)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def limit_groups(scores: Tensor, n_group: int, topk_group: int) -> Tensor:
    """Group-limited routing (DeepSeek-V3, arXiv 2412.19437 §2.1.2): a group's score is the sum
    of its two best expert scores; experts outside the ``topk_group`` best groups get -inf."""
    if n_group == 1:
        return scores
    n, e = scores.shape
    grouped = scores.view(n, n_group, e // n_group)  # [N, G, E/G]
    group_scores = grouped.topk(2, dim=-1).values.sum(-1)  # [N, G]
    best = group_scores.topk(topk_group, dim=-1).indices
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
    return grouped.masked_fill(~keep[..., None], float("-inf")).view(n, e)


class Router(nn.Module):
    """Top-k router over sigmoid (DeepSeek-V3 / LLaDA2.0) or softmax (OLMoE / LLaDA-MoE) scores,
    computed in fp32. ``expert_bias`` (auxiliary-loss-free balancing, arXiv 2408.15664) decides
    which experts run; the unbiased scores weight them, unless ``bias_weights`` (LLaDA-MoE's
    released code adds the bias to the probabilities it then weights with)."""

    def __init__(self, hidden_size: int, moe: MoEConfig) -> None:
        super().__init__()
        self.moe = moe
        self.weight = nn.Parameter(torch.empty(moe.num_experts, hidden_size))
        nn.init.kaiming_uniform_(self.weight, a=5 ** 0.5)  # as nn.Linear
        if moe.expert_bias:
            self.register_buffer("expert_bias", torch.zeros(moe.num_experts))
        else:
            self.expert_bias = None

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """x [N, d] -> (weights [N, k] fp32, experts [N, k])."""
        m = self.moe
        logits = F.linear(x.float(), self.weight.float())  # [N, E], router in fp32
        scores = torch.sigmoid(logits) if m.score_function == "sigmoid" else logits.softmax(-1)
        biased = scores if self.expert_bias is None else scores + self.expert_bias.float()
        choice = limit_groups(biased, m.n_group, m.topk_group)
        experts = choice.topk(m.num_experts_per_tok, dim=-1).indices
        weights = (biased if m.bias_weights else scores).gather(1, experts)
        if m.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return weights * m.routed_scaling_factor, experts


class Experts(nn.ModuleDict):
    """The experts a process holds, by global expert id (``experts[e]``; in the checkpoint's
    names ``experts.{e}.*``, as an ``nn.ModuleList`` of all of them would be)."""

    def __getitem__(self, e: int | str) -> nn.Module:
        return super().__getitem__(str(e))


class MoE(nn.Module):
    """Routed experts plus always-on shared experts (DeepSeekMoE, arXiv 2401.06066; LLaDA2.0).

    With a ``shard`` (expert parallelism): the router is replicated, each rank holds
    ``num_experts / size`` whole experts (``experts`` keyed by global expert id) and a
    column/row slice of the shared expert; the routed and shared partial outputs are summed over
    ranks in one all-reduce.

    The experts' weights may live in two stacked tensors (``stack_experts``, done on load), each
    expert's gate / up / down weight a view into them: the checkpoint's names, loading, saving,
    expert parallelism and quantization see one module per expert as before, and where the
    device has a grouped GEMM for them (``kernels.grouped_mm_fits``) the dispatch runs every
    expert in two grouped matmuls whose group ends stay on the device: no host read, the same
    ops whatever the routing (what a captured step needs). Elsewhere, or once quantization has
    replaced the weights (``unstack``), one matmul chain per expert that got tokens, sized by
    one host read."""

    def __init__(self, hidden_size: int, moe: MoEConfig, shard: Shard | None = None) -> None:
        super().__init__()
        self.shard = shard
        self.gate = Router(hidden_size, moe)
        self.first, end = (0, moe.num_experts) if shard is None else shard.part(moe.num_experts)
        self.experts = Experts({str(e): MLP(hidden_size, moe.moe_intermediate_size)
                                for e in range(self.first, end)})
        shared = moe.moe_intermediate_size * moe.num_shared_experts
        self.shared_experts = MLP(hidden_size, shared, shard, reduce=False) if shared else None
        self.stacks: tuple[Tensor, Tensor] | None = None  # (gate_up [E, 2I, d], down [E, d, I]) of this rank's experts
        self.grouped = False  # the dispatch runs the grouped GEMM over ``stacks`` (decided once, on the host)

    def stack_experts(self) -> None:
        """Copy this rank's experts' weights into two stacked tensors and make each expert's
        weights views into them (call once they are allocated on their device: the loader does,
        before it fills them; again after anything replaces them)."""
        mlps = [self.experts[e] for e in range(self.first, self.first + len(self.experts))]
        weights = [w for m in mlps for w in (m.gate_proj.weight, m.up_proj.weight, m.down_proj.weight)]
        if any(type(w.data) is not Tensor for w in weights) or len({(w.dtype, w.device) for w in weights}) != 1:
            self.unstack()  # quantized (tensor subclasses) or mixed: the per-expert chain
            return
        inter, d = mlps[0].gate_proj.weight.shape
        gate_up = weights[0].new_empty(len(mlps), 2 * inter, d)
        down = weights[0].new_empty(len(mlps), d, inter)
        with torch.no_grad():
            for i, m in enumerate(mlps):
                gate_up[i, :inter].copy_(m.gate_proj.weight)
                gate_up[i, inter:].copy_(m.up_proj.weight)
                down[i].copy_(m.down_proj.weight)
                for linear, view in ((m.gate_proj, gate_up[i, :inter]), (m.up_proj, gate_up[i, inter:]),
                                     (m.down_proj, down[i])):
                    linear.weight = nn.Parameter(view, requires_grad=linear.weight.requires_grad)
        self.stacks = (gate_up, down)
        self.grouped = grouped_mm_fits(gate_up.new_empty(0, d), gate_up, down)

    def unstack(self) -> None:
        """Drop the stacked tensors (the experts' weights were replaced, e.g. quantized): the
        per-expert chain from now on."""
        self.stacks, self.grouped = None, False

    def forward(self, x: Tensor) -> Tensor:
        flat = x.reshape(-1, x.shape[-1])  # [N, d]
        weights, experts = self.gate(flat)
        out = self.dispatch(flat, weights, experts)
        if self.shared_experts is not None:
            out = out + self.shared_experts(flat)
        if self.shard is not None:
            self.shard.all_reduce(out)
        return out.view(x.shape)

    def dispatch(self, x: Tensor, weights: Tensor, experts: Tensor) -> Tensor:
        """The routed experts on x [N, d] (``run_experts``): grouped GEMMs over ``stacks`` where
        they run, else one chain per expert module."""
        out = run_experts(x, weights, experts, self.first, len(self.experts), self.shard is not None,
                          self.stacks if self.grouped else None, F.silu,
                          lambda e, tokens: self.experts[self.first + e](tokens))
        return out.to(x.dtype)


def run_experts(x: Tensor, weights: Tensor, experts: Tensor, first: int, local: int, sharded: bool,
                stacks: tuple[Tensor, Tensor] | None, act: Callable[[Tensor], Tensor],
                expert: Callable[[int, Tensor], Tensor]) -> Tensor:
    """Routed experts, fp32 [N, d], for x [N, d] routed to ``experts`` [N, k] (global ids) with
    ``weights`` [N, k]: sort the (token, expert) pairs by expert, run every expert on its pairs,
    then sum each token's k outputs in a fixed order (batch-invariant, no atomics).

    This process holds the ``local`` experts from ``first``; ``sharded`` (expert parallelism):
    a pair routed to another rank's expert sorts last, into a group nothing runs, and counts
    zero here. ``stacks`` (gate_up [local, 2I, d], down [local, d, I]): the experts run as two
    grouped GEMMs (``F.grouped_mm``, activation ``act``) whose group ends are counted and
    summed on the device: no host read, the same ops whatever the routing. None: ``expert(e,
    tokens)`` for each local expert ``e`` that got tokens, sized by one host read."""
    n, k = experts.shape
    if n == 0:  # host shape: no device read
        return x.new_zeros(x.shape, dtype=torch.float32)
    flat = experts.flatten()
    mine = None
    if sharded:
        flat = flat - first
        mine = (flat >= 0) & (flat < local)
        flat = torch.where(mine, flat, local)
    order = flat.argsort(stable=True)  # [N*k] pair ids grouped by expert
    # pairs per expert, counted on the device (bincount on CUDA reads its input's max first)
    counts = torch.zeros(local + 1, dtype=torch.long, device=x.device).scatter_add_(0, flat, torch.ones_like(flat))
    tokens = x[order // k]  # [N*k, d], sorted by expert
    if stacks is not None:
        gate_up, down = stacks
        ends = counts[:local].cumsum(0).to(torch.int32)  # rows past the last end: not run
        gate, up = F.grouped_mm(tokens, gate_up.transpose(1, 2), offs=ends).chunk(2, dim=-1)
        sorted_out = F.grouped_mm(act(gate) * up, down.transpose(1, 2), offs=ends)
    else:
        sizes = counts.tolist()  # the one host read: each expert's matmul is sized by its token count
        chunks = tokens.split(sizes)
        sorted_out = torch.cat([expert(e, chunks[e]) for e in range(local) if sizes[e]]
                               + [torch.zeros_like(chunks[local])])
    pairs = torch.empty_like(tokens)
    pairs[order] = sorted_out  # back to pair order: [N*k, d]
    pairs = pairs.view(n, k, -1).float()
    if mine is not None:  # another rank's pairs (rows the grouped GEMM left unwritten) count 0
        pairs = torch.where(mine.view(n, k, 1), pairs, 0.0)
    return (pairs * weights[..., None]).sum(1)  # [N, d]


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, shard: Shard | None = None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_idx, shard)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        moe = cfg.moe
        if moe is not None and layer_idx >= moe.first_k_dense_replace:
            self.mlp = MoE(cfg.hidden_size, moe, shard)
        else:
            self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, shard)

    def forward(self, h: Tensor, ctx: ForwardContext) -> tuple[Tensor, ForwardContext]:
        """h: the residual stream in ``ctx``'s layout (``ForwardContext.pack``). The layer's
        output and the context it is live in (a new one when ``after_qk`` kept a subset of the
        tokens), the output in that context's layout."""
        attn_out, keep, kept_ctx = self.self_attn(self.input_layernorm(h), ctx)
        if keep is not None:
            h = ctx.carry(h, keep, kept_ctx)
        h = h + attn_out
        return h + self.mlp(self.post_attention_layernorm(h)), kept_ctx


class StackOutput(NamedTuple):
    """What the layer loop hands back."""
    hidden: Tensor  # [B, T', d] final normed hidden states of the tokens live at the last layer
    ctx: ForwardContext  # the context at the last layer (``ctx.token_index``: which tokens those are)
    processed: list[float] | None  # per row: query tokens computed, summed over layers (None: no hooks)


class DiffusionLM(nn.Module):
    """Embedding, the shared layer loop, final norm and LM head.

    ``forward(input_ids, attention_mask)`` is the plain HF-like call (used by parity tests and
    training); ``forward_context`` is what the engine uses, with a KV cache and hooks.

    ``shard``: this process is one rank of a tensor-parallel model (``models/parallel.py``);
    every rank runs the same forward, and ``logits`` are complete on rank 0 only.
    """

    def __init__(self, cfg: ModelConfig, shard: Shard | None = None) -> None:
        super().__init__()
        self.config = cfg
        self.shard = shard
        if shard is None:
            self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        else:
            self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, shard)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, shard) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if shard is None:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        else:
            self.lm_head = ParallelLMHead(cfg.hidden_size, cfg.vocab_size, shard)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rotary = RotaryTable(cfg.rotary_dim, cfg.rope_theta)

    def forward_context(self, input_ids: Tensor, ctx: ForwardContext) -> Tensor:
        """Final normed hidden states [B, T', d] of the tokens still live at the end (the
        hooks of ``ctx`` may shrink the set; ``run_layers`` says which tokens they are); call
        ``logits`` on what you need."""
        return self.forward_layers(input_ids, self.prepare_context(ctx))

    def prepare_context(self, ctx: ForwardContext) -> ForwardContext:
        """``ctx`` with RoPE's cos/sin of the step's positions (from the table, which grows) and
        the live set's facts: outside ``forward_layers``, so a compiled stack never sees the table."""
        cos, sin = self.rotary.lookup(ctx.positions, ctx.position_bound)
        return replace(ctx, cos=cos, sin=sin).prepare()

    def forward_layers(self, input_ids: Tensor, ctx: ForwardContext) -> Tensor:
        """``forward_context`` on a prepared context: embedding, the layer loop, final norm."""
        return self.run_layers(input_ids, ctx).hidden

    def run_layers(self, input_ids: Tensor, ctx: ForwardContext) -> StackOutput:
        """THE layer loop, on a prepared context. It owns the current context: a layer hands
        back the one it ran in (``after_qk`` may have kept a subset), and the loop applies an
        ``after_layer`` hook's ``Kept`` (``ForwardContext.keep``). With hooks it also counts
        each layer's live tokens (``processed_tokens``: the work a shrinking strategy saves).

        The residual stream stays in the current context's layout from the embedding to the
        final norm: the live tokens as one [N, d] matrix when the context packs
        (``ForwardContext.live_index``), so a layer unpacks only Q/K/V for attention and packs
        only attention's output; it is unpacked where the live set changes and at the end."""
        h = ctx.pack(self.embed_tokens(input_ids))
        processed = None if ctx.hooks is None else [0.0] * ctx.positions.shape[0]
        for i, layer in enumerate(self.layers):
            h, ctx = layer(h, ctx)
            if processed is not None:
                processed = [p + n for p, n in zip(processed, ctx.live_counts())]
            keep = ctx.hooks.after_layer(i, h, ctx) if ctx.hooks is not None else None
            if keep is not None:
                kept_ctx = ctx.keep(keep)
                h, ctx = ctx.carry(h, keep.index, kept_ctx), kept_ctx
        return StackOutput(self.norm(ctx.unpack(h)), ctx, processed)

    @property
    def num_kv_heads(self) -> int:
        """KV heads this process holds (its KV cache's width)."""
        return self.layers[0].self_attn.num_kv_heads if self.layers else self.config.num_kv_heads

    def logits(self, hidden: Tensor) -> Tensor:
        return self.lm_head(hidden).float()

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None,
                position_ids: Tensor | None = None) -> Tensor:
        """Logits [B, T, V] with the family's shift applied.

        ``attention_mask``: None, a 2-D [B, T] padding mask (1 = token; padding gets no position
        and is never attended to), or a 4-D bool [B, 1, T, T] mask used as given."""
        ctx = self.plain_context(input_ids, attention_mask, position_ids)
        logits = self.logits(self.forward_context(input_ids, ctx))
        if self.config.logit_shift:
            logits = torch.cat([logits[:, :1], logits[:, :-1]], dim=1)
        return logits

    def plain_context(self, input_ids: Tensor, attention_mask: Tensor | None,
                      position_ids: Tensor | None = None) -> ForwardContext:
        """The context of a plain forward over ``input_ids`` (``forward``'s arguments); the
        mask follows the padding, RoPE ``position_ids`` when given."""
        b, t = input_ids.shape
        dev = input_ids.device
        if attention_mask is None or attention_mask.dim() == 4:
            positions = torch.arange(t, device=dev).expand(b, t)
            valid = torch.ones(b, t, dtype=torch.bool, device=dev)
        else:
            valid = attention_mask.bool()
            positions = (valid.long().cumsum(1) - 1).clamp(min=0)
        if attention_mask is not None and attention_mask.dim() == 4:
            mask = attention_mask.bool()
        else:
            mask = self.pattern_mask(positions, valid, padded=attention_mask is not None)
        if position_ids is None:
            return ForwardContext(positions=positions, token_valid=valid, attn_mask=mask, shard=self.shard,
                                  position_bound=t)
        # RoPE reads the given positions; the mask stays the padding's
        return ForwardContext(positions=position_ids.expand_as(input_ids), token_valid=valid, attn_mask=mask,
                              shard=self.shard)

    def pattern_mask(self, positions: Tensor, valid: Tensor, padded: bool = True) -> Tensor | None:
        """[B, 1, T, T] bool: the family's attention pattern over one padded canvas; None for
        full attention over an unpadded canvas (SDPA then needs no mask)."""
        if not padded and not self.config.is_block_causal:
            return None
        mask = valid[:, None, None, :].expand(-1, 1, positions.shape[1], -1)
        if self.config.is_block_causal:
            mask = mask & block_causal_mask(positions, positions, self.config.block_size)[:, None]
        return mask
