"""The base decoders: which canvas positions each step computes (the cache policy) and which
masked positions it commits (the commit rule).

| decoder      | step 0 of a block        | later steps               | commit rule                 |
|--------------|--------------------------|---------------------------|-----------------------------|
| reference    | whole canvas             | whole canvas              | fixed-k / threshold / factor|
| prefix-cache | whole canvas             | block + suffix            | same                        |
| dual-cache   | whole canvas             | block only                | same                        |
| block        | positions not yet cached | positions not yet cached  | low_confidence_dynamic/static|
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from ..engine.sequence import Sequence
from ..sampling_params import SamplingParams
from .rules import factor_select, threshold_select, topk_select


@dataclass
class StepPlan:
    """What one sequence computes in one forward. Strategies may rewrite any field."""
    positions: Tensor  # [T] RoPE positions of the computed tokens
    key_limit: Tensor  # [T] each token attends to cache indices below this
    logit_positions: Tensor  # [N] canvas positions to predict (candidates to commit)
    logit_slots: Tensor | None = None  # [N] cache slot whose output predicts each (default below)
    slots: Tensor | None = None  # [T] cache index each token's K/V goes to (default: positions)
    token_ids: Tensor | None = None  # [T] tokens fed (default: the canvas at positions)
    key_mask: Tensor | None = None  # [T, S] bool, overrides key_limit (e.g. isolated copies)

    def __len__(self) -> int:
        return self.positions.numel()

    def finalize(self, seq: Sequence, shift: int) -> "StepPlan":
        """Fill the defaults: slots = positions, tokens from the canvas, and Dream's shift
        (position p is predicted by the output at p - 1)."""
        if self.slots is None:
            self.slots = self.positions
        if self.token_ids is None:
            self.token_ids = seq.canvas[self.positions]
        if self.logit_slots is None:
            self.logit_slots = self.logit_positions - shift
        return self


def compute_range(seq: Sequence, shift: int) -> tuple[int, int]:
    method = seq.params.base_method
    start, end = seq.block
    if method == "block":
        return seq.committed_len, end
    if method == "reference" or seq.step == 0:
        return 0, seq.canvas_len
    # Dream reads position p's logits at p - 1, so the token before the block is recomputed too
    return start - shift, (seq.canvas_len if method == "prefix-cache" else end)


def plan_step(seq: Sequence, shift: int) -> StepPlan:
    lo, hi = compute_range(seq, shift)
    positions = torch.arange(lo, hi, device=seq.canvas.device)
    if seq.params.base_method == "block":  # block-causal: see your own block and all before it
        bl = seq.params.block_length
        limit = (positions // bl + 1) * bl
    else:
        limit = torch.full_like(positions, seq.canvas_len)
    plan = StepPlan(positions, limit, seq.masked_positions())
    return with_unconditional_copy(seq, plan, shift) if seq.params.cfg_scale > 0 else plan


def with_unconditional_copy(seq: Sequence, plan: StepPlan, shift: int) -> StepPlan:
    """Classifier-free guidance (LLaDA): a second copy of the canvas with the prompt masked, in
    cache slots [L, 2L), each copy attending only to itself. Logits come back cond then uncond."""
    n = seq.canvas_len
    uncond = seq.canvas.clone()
    uncond[: seq.prompt_len] = seq.ids.mask_id
    own = torch.arange(2 * n, device=seq.canvas.device) // n  # 0 = conditional, 1 = unconditional
    wanted = plan.logit_positions - shift
    return StepPlan(positions=torch.cat([plan.positions, plan.positions]),
                    key_limit=torch.full((2 * n,), 2 * n, device=seq.canvas.device),
                    logit_positions=torch.cat([plan.logit_positions, plan.logit_positions]),
                    logit_slots=torch.cat([wanted, wanted + n]),
                    slots=torch.arange(2 * n, device=seq.canvas.device),
                    token_ids=torch.cat([seq.canvas, uncond]),
                    key_mask=own[:, None] == own[None, :])


def guided_logits(seq: Sequence, positions: Tensor, logits: Tensor) -> tuple[Tensor, Tensor]:
    """u + (s + 1)(c - u) over the two halves returned for a CFG plan."""
    n = positions.numel() // 2
    cond, uncond = logits[:n], logits[n:]
    return positions[:n], uncond + (seq.params.cfg_scale + 1) * (cond - uncond)


def cache_len(seq: Sequence) -> int:
    """Cache positions a sequence needs (CFG keeps a second, unconditional canvas)."""
    return seq.canvas_len * (2 if seq.params.cfg_scale > 0 else 1)


def select(seq: Sequence, conf: Tensor) -> Tensor:
    """bool [N] over the candidate positions: which to commit this step (``threshold_rule``)."""
    rule = threshold_rule(seq)
    if rule is None:
        return factor_select(conf, seq.params.factor)
    threshold, k = rule
    if threshold == math.inf:
        return topk_select(conf, k)
    return threshold_select(conf, threshold, min_k=k)


def uses_factor(p: SamplingParams) -> bool:
    """Fast-dLLM's factor rule decides the commit (a full-attention decoder, no threshold)."""
    return p.base_method != "block" and p.threshold is None and p.factor is not None


def threshold_rule(seq: Sequence) -> tuple[float, int] | None:
    """The commit rule of ``seq`` as (threshold, min_k): every candidate with confidence >=
    threshold, or the top min_k when fewer pass (a top-k rule is threshold inf); None for the
    factor rule."""
    p = seq.params
    if p.base_method == "block":
        k = max(seq.tokens_this_step(), 1)
        return (math.inf, k) if p.unmasking == "low_confidence_static" else (p.threshold, k)
    if p.threshold is not None:
        return p.threshold, 1  # the fixed-k share is not needed
    if uses_factor(p):
        return None
    return math.inf, seq.tokens_this_step()


def select_rows(conf: Tensor, counts: list[int], rules: list[tuple[float, int]]) -> Tensor:
    """bool [B, M]: ``select`` for B sequences at once. ``conf`` holds their candidates'
    confidences one after another (``counts`` each, all > 0; M = the largest); ``rules`` their
    ``threshold_rule``. Row b's first counts[b] entries are exactly what ``threshold_select`` /
    ``topk_select`` give that sequence alone (ties to the lower index, thresholds compared in
    conf's dtype); the rest is False."""
    dev = conf.device
    rows = torch.nn.utils.rnn.pad_sequence(conf.split(counts), batch_first=True,
                                           padding_value=-math.inf)  # [B, M]
    n = torch.tensor(counts, device=dev)
    valid = torch.arange(rows.shape[1], device=dev)[None] < n[:, None]
    threshold = torch.tensor([r[0] for r in rules], dtype=conf.dtype, device=dev)
    k = torch.tensor([r[1] for r in rules], device=dev)
    passed = (rows >= threshold[:, None]) & valid
    order = torch.sort(rows, dim=1, descending=True, stable=True).indices
    rank = torch.empty_like(order).scatter_(1, order, torch.arange(rows.shape[1], device=dev).expand_as(order))
    top = (rank < k[:, None]) & valid
    enough = passed.sum(1) >= torch.minimum(k, n)
    return torch.where(enough[:, None], passed, top)
