"""The base decoders at work: which canvas positions each step computes (the cache policy) and
which masked positions it commits (the commit rule). What each decoder does is data in
``dllm_engine.methods`` (``Decoder``); this module reads those properties, never a name."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
from torch import Tensor

from ..engine.sequence import Sequence, to_device
from ..models.context import block_causal_limit
from .commit_rules import rule_for
from .plan import StepPlan


def compute_range(seq: Sequence, shift: int) -> tuple[int, int]:
    """The canvas positions [lo, hi) this step computes (the decoder's cache policy)."""
    decoder = seq.params.decoder
    start, end = seq.block
    if decoder.block_causal:
        return seq.committed_len, end
    if not decoder.reuses_cache or seq.step == 0:
        return 0, seq.canvas_len
    # Dream reads position p's logits at p - 1, so the token before the block is recomputed too
    return start - shift, (seq.canvas_len if decoder.recomputes_suffix else end)


def plan_step(seq: Sequence, shift: int) -> StepPlan:
    """One sequence's step plan (``plan_steps`` of a group of one)."""
    return plan_steps([seq], shift)[0]


def host_span(seq: Sequence, shift: int) -> tuple[np.ndarray, np.ndarray]:
    """This step's ``compute_range`` on the host: the canvas positions it
    computes and each one's key limit."""
    return span_limits(seq, *compute_range(seq, shift))


def span_limits(seq: Sequence, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
    """Canvas positions [lo, hi) and each one's key limit under the decoder's rule (block-causal
    for ``block``: a token sees its own block and all before it; else the whole canvas)."""
    positions = np.arange(lo, hi)
    if seq.params.decoder.block_causal:
        return positions, block_causal_limit(positions, seq.params.block_length)
    return positions, np.full(hi - lo, seq.canvas_len)


Computed = Callable[[Sequence, np.ndarray], "np.ndarray | None"]  # a pipeline's ``computed``


@dataclass
class HostRow:
    """One row's plan as host arrays (``plan_steps`` sends a group's in one copy)."""
    positions: np.ndarray  # [T]
    limit: np.ndarray  # [T]
    tokens: np.ndarray  # [T]
    wanted: np.ndarray  # [N] logit positions
    logit_slots: np.ndarray  # [N]
    slots: np.ndarray | None = None  # [T]; None: the positions
    key_mask: np.ndarray | None = None  # [T, S]


def host_row(seq: Sequence, shift: int, computed: Computed | None) -> HostRow:
    """``seq``'s step on the host: the decoder's range and key limits less what ``computed``
    drops, the rule's logit positions (a named rule may predict more than the masks), and for
    classifier-free guidance (LLaDA) a second copy of the canvas with the prompt masked, in
    cache slots [L, 2L), each copy attending only to itself (logits cond, then uncond)."""
    positions, limit = host_span(seq, shift)
    if computed is not None and (keep := computed(seq, positions)) is not None:
        positions, limit = positions[keep], limit[keep]
    wanted = rule_for(seq).logit_index(seq)
    row = HostRow(positions, limit, seq.canvas[positions], wanted, wanted - shift)
    if seq.params.cfg_scale == 0:
        return row
    n = seq.canvas_len
    if not np.array_equal(positions, np.arange(n)):
        raise RuntimeError("classifier-free guidance computes the whole canvas every step")
    uncond = seq.canvas.copy()
    uncond[: seq.prompt_len] = seq.ids.mask_id
    own = np.arange(2 * n) // n  # 0 = conditional, 1 = unconditional
    return HostRow(np.tile(positions, 2), np.full(2 * n, 2 * n), np.concatenate([seq.canvas, uncond]),
                   np.tile(wanted, 2), np.concatenate([wanted - shift, wanted - shift + n]),
                   slots=np.arange(2 * n), key_mask=own[:, None] == own[None, :])


def plan_steps(seqs: list[Sequence], shift: int, computed: Computed | None = None) -> list[StepPlan]:
    """The step plans of a forward group, built on the host and sent to the device in one copy
    (each plan's tensors are views of it), not a few copies and ops per row; each keeps its host
    arrays, from which the runner lays out the keys and finds the logits without a read.
    ``computed(seq, positions)``: which planned positions are computed (bool, None: all)."""
    return sent_rows([host_row(seq, shift, computed) for seq in seqs], seqs[0].device if seqs else None)


def span_row(seq: Sequence, lo: int, hi: int, wanted: np.ndarray, shift: int) -> HostRow:
    """A row computing canvas positions [lo, hi) under the decoder's key limits and predicting
    ``wanted`` (host arrays, sent with its group's by ``sent_rows``)."""
    positions, limit = span_limits(seq, lo, hi)
    return HostRow(positions, limit, seq.canvas[positions], wanted, wanted - shift)


def sent_rows(rows: list[HostRow], device: torch.device | None) -> list[StepPlan]:
    """The plans of host rows, sent in one copy (each plan's tensors are views of it); each keeps
    its host arrays."""
    if not rows:
        return []
    parts = [a for r in rows for a in (r.positions, r.limit, r.tokens, r.wanted, r.logit_slots)
             + (() if r.slots is None else (r.slots,))]
    views = iter(to_device(np.concatenate(parts).astype(np.int64), device).split([len(p) for p in parts]))
    plans = []
    for r in rows:
        positions, limit, tokens, wanted, logit_slots = (next(views) for _ in range(5))
        slots = None if r.slots is None else next(views)
        plans.append(StepPlan(positions, limit, wanted, logit_slots=logit_slots, slots=slots, token_ids=tokens,
                              host_positions=r.positions, host_limit=r.limit, host_logits=r.wanted,
                              host_slots=r.positions if r.slots is None else r.slots,
                              host_logit_slots=r.logit_slots, host_key_mask=r.key_mask, host_tokens=r.tokens))
    return plans


def after_forward_rows(seqs: list[Sequence], outputs: list[tuple[Tensor, Tensor]]) -> list[tuple[Tensor, Tensor]]:
    """The decoder's view of a finished forward, for every row of a group: a CFG plan's two
    halves become the guided logits u + (s + 1)(c - u), the rows that share a scale s at once.
    Changes nothing (``after_step`` does, at the sequence's turn)."""
    out = list(outputs)
    scales: dict[float, list[int]] = {}
    for i, seq in enumerate(seqs):
        if seq.params.cfg_scale > 0:
            scales.setdefault(seq.params.cfg_scale, []).append(i)
    for scale, rows in scales.items():
        halves = [outputs[i][0].numel() // 2 for i in rows]
        starts = np.cumsum([0, *(2 * h for h in halves[:-1])])
        cond = np.concatenate([np.arange(h) + lo for h, lo in zip(halves, starts)]).astype(np.int64)
        index = to_device(np.concatenate([cond, cond + np.repeat(halves, halves)]), outputs[rows[0]][1].device)
        positions = torch.cat([outputs[i][0] for i in rows])[index[: len(cond)]]
        logits = torch.cat([outputs[i][1] for i in rows])
        c, u = logits[index[: len(cond)]], logits[index[len(cond):]]
        guided = u + (scale + 1) * (c - u)
        for i, pos, lg in zip(rows, positions.split(halves), guided.split(halves)):
            out[i] = (pos, lg)
    return out


def after_step(seq: Sequence) -> None:
    """The decoder's record of a finished forward, at the sequence's turn in the commit loop:
    block diffusion's cache is final before the block (this forward wrote it)."""
    if seq.params.decoder.block_causal:
        seq.committed_len = seq.block[0]


def cache_len(seq: Sequence) -> int:
    """Cache positions a sequence needs (CFG keeps a second, unconditional canvas)."""
    return seq.canvas_len * (2 if seq.params.cfg_scale > 0 else 1)
