"""Sampling, confidence and the commit rules of the reference samplers.

- fixed-k (LLaDA ``generate``): the block's mask count is split evenly over its steps, the
  remainder going to the first steps; each step commits the top-k by confidence;
- threshold (Fast-dLLM; LMDeploy/SDAR ``low_confidence_dynamic``): every masked position with
  confidence >= threshold, and at least the top ``min_k`` (1 for Fast-dLLM and LMDeploy);
- factor (Fast-dLLM): the largest n such that the n-th highest confidence >= 1 - factor / (n + 1).
"""
from __future__ import annotations

import torch
from torch import Tensor

from .noise import CONFIDENCE, TOKENS, Noise

CHUNK_ELEMENTS = 1 << 22  # uniforms drawn at once without top_k: rows x vocabulary (32 MB of int64 keys)


def num_transfer_tokens(num_masked: int, steps: int) -> list[int]:
    """Tokens to commit at each of ``steps`` steps: an even split, remainder to the first steps."""
    base, rem = divmod(num_masked, steps)
    return [base + (1 if i < rem else 0) for i in range(steps)]


def sample_tokens(logits: Tensor, temperature: float, noise: Noise | None,
                  top_k: int = 0, top_p: float = 1.0) -> Tensor:
    """x0 [N] from logits [N, V]: argmax at T = 0, else Gumbel-max in float32, i.e. a sample from
    softmax(logits / T) restricted to the ``top_k`` most likely tokens (0 = all) and to the
    nucleus of mass ``top_p``. The uniforms are counter-based (``noise``: each row's keys; token
    v draws column v), so a row's token depends on its keys and logits alone. With ``top_k``
    only those k columns draw; else the rows draw in chunks of at most CHUNK_ELEMENTS uniforms."""
    if temperature == 0:
        return logits.argmax(-1)
    if noise is None or len(noise) != logits.shape[0]:
        raise ValueError("sampling needs one noise key per row of logits")
    values, ids = candidates(logits.float(), temperature, top_k, top_p)
    if ids is not None:
        pick = (scaled(values, temperature) + gumbel(noise.uniform(TOKENS, ids))).argmax(-1)
        return ids.gather(-1, pick[:, None])[:, 0]
    columns = torch.arange(values.shape[-1], device=values.device)
    rows = max(1, CHUNK_ELEMENTS // max(values.shape[-1], 1))
    drawn = [(scaled(part, temperature) + gumbel(noise.rows(slice(lo, lo + rows)).uniform(TOKENS, columns))).argmax(-1)
             for lo, part in zip(range(0, values.shape[0], rows), values.split(rows))]
    return torch.cat(drawn) if drawn else values.new_zeros(0, dtype=torch.long)


def candidates(logits: Tensor, temperature: float, top_k: int, top_p: float) -> tuple[Tensor, Tensor | None]:
    """What ``sample_tokens`` may draw from logits [N, V]: the ``top_k`` most likely tokens (0 =
    all) and, among them, the nucleus of mass ``top_p`` under softmax(logits / T), -inf outside.
    With top_k: (their logits [N, k], most likely first; their ids [N, k]); else ([N, V], None)."""
    if 0 < top_k < logits.shape[-1]:
        values, ids = logits.topk(top_k, dim=-1)
        return nucleus(values, temperature, top_p, ordered=True), ids
    return nucleus(logits, temperature, top_p), None


def keep_top(logits: Tensor, temperature: float, top_k: int, top_p: float) -> Tensor:
    """logits [N, V] with -inf outside what ``sample_tokens`` may draw (``candidates``)."""
    values, ids = candidates(logits, temperature, top_k, top_p)
    return values if ids is None else torch.full_like(logits, -float("inf")).scatter(-1, ids, values)


def scaled(logits: Tensor, temperature: float) -> Tensor:
    """logits / T in float32, -inf kept -inf: at a huge T the division gives 0 (or -inf / inf,
    NaN, which argmax would take), so an excluded token is never drawn."""
    return torch.where(logits > -float("inf"), logits / temperature, -float("inf"))


def gumbel(u: Tensor) -> Tensor:
    """Gumbel(0, 1) noise from uniforms in (0, 1)."""
    return -torch.log(-torch.log(u))


def nucleus(logits: Tensor, temperature: float, top_p: float, ordered: bool = False) -> Tensor:
    """``logits`` with -inf outside the smallest set whose probability under softmax(logits / T)
    reaches ``top_p`` (the most likely token always stays); ``ordered``: each row is sorted,
    most likely first, already."""
    if top_p >= 1.0:
        return logits
    ranked, order = (logits, None) if ordered else logits.sort(dim=-1, descending=True)
    probs = torch.softmax(scaled(ranked, temperature), dim=-1)
    outside = probs.cumsum(-1) - probs >= top_p  # the mass before this token already reaches p
    ranked = ranked.masked_fill(outside, -float("inf"))
    return ranked if order is None else logits.scatter(-1, order, ranked)


def without_mask(logits: Tensor, mask_id: int | Tensor, owned: bool = False) -> Tensor:
    """``logits`` [N, V] with -inf in the mask's column (``mask_id``: one id, or [N] per row):
    a mask is never a valid prediction (committing one would leave the slot masked forever).
    A new tensor, so the caller's logits stay as they were; ``owned``: the caller built
    ``logits`` for this (a concatenation, a copy) and lets it be written in place instead."""
    out = logits if owned else logits.clone()
    if isinstance(mask_id, Tensor):
        return out.scatter_(1, mask_id[:, None], -float("inf"))
    out[:, mask_id] = -float("inf")
    return out


def greedy_tokens(logits: Tensor, mask_id: int | Tensor, owned: bool = False) -> tuple[Tensor, Tensor]:
    """(``without_mask(logits)``, its argmax [N]): the greedy prediction, never the mask."""
    logits = without_mask(logits, mask_id, owned)
    return logits, logits.argmax(-1)


def greedy_predictions(logits: Tensor, mask_id: int | Tensor) -> tuple[Tensor, Tensor]:
    """(most probable token [N], its softmax probability [N]) of logits [N, V], in fp32; the
    mask (``mask_id``: one id, or [N] per row) is never a prediction."""
    conf, tokens = torch.softmax(without_mask(logits.float(), mask_id), dim=-1).max(dim=-1)
    return tokens, conf


def confidence(logits: Tensor, x0: Tensor, rule: str, noise: Noise | None) -> Tensor:
    """Confidence [N] of choosing x0 at each position (higher = commit sooner).

    ``low_confidence``/``maskgit_plus``: softmax probability of x0 (untempered, as LLaDA);
    ``topk_margin``: top-1 minus top-2 probability; ``entropy``: sum p log p (Dream);
    ``random``: uniform draws (LLaDA's random remasking; counter-based, ``noise``)."""
    if rule == "random":
        if noise is None or len(noise) != x0.shape[0]:
            raise ValueError("random remasking needs one noise key per candidate")
        return noise.uniform(CONFIDENCE, torch.zeros(1, dtype=torch.long, device=x0.device))[:, 0]
    probs = torch.softmax(logits.float(), dim=-1)
    if rule in ("low_confidence", "maskgit_plus"):
        return probs.gather(-1, x0[:, None])[:, 0]
    if rule == "topk_margin":
        top2 = probs.topk(2, dim=-1).values
        return top2[:, 0] - top2[:, 1]
    if rule == "entropy":
        return (probs * torch.log(probs.clamp_min(1e-10))).sum(-1)
    raise ValueError(f"unknown confidence rule {rule!r}")


def topk_select(conf: Tensor, k: int) -> Tensor:
    """bool [N]: the k most confident positions (ties broken by the lower index)."""
    k = max(0, min(k, conf.numel()))
    chosen = torch.zeros_like(conf, dtype=torch.bool)
    if k:
        order = torch.sort(conf, descending=True, stable=True).indices
        chosen[order[:k]] = True
    return chosen


def rank_in_row(values: Tensor, valid: Tensor) -> Tensor:
    """[B, T] rank of each entry within its row of ``values`` [B, T], largest first (0 = the
    largest): a stable sort, so ties go to the lower index; entries not ``valid`` count as -inf."""
    order = torch.sort(values.masked_fill(~valid, -float("inf")), dim=1, descending=True, stable=True).indices
    ranks = torch.arange(values.shape[1], device=values.device).expand_as(order)
    return torch.empty_like(order).scatter_(1, order, ranks)


def threshold_select(conf: Tensor, threshold: float, min_k: int = 1) -> Tensor:
    """bool [N]: every position with conf >= threshold, or the top ``min_k`` if fewer pass."""
    passed = conf >= threshold
    if int(passed.sum()) >= min(min_k, conf.numel()):
        return passed
    return topk_select(conf, min_k)


def factor_select(conf: Tensor, factor: float) -> Tensor:
    """bool [N]: the top n for the largest n with n-th highest conf >= 1 - factor / (n + 1);
    at least the top-1."""
    ranked = torch.sort(conf, descending=True, stable=True).values
    n = torch.arange(1, conf.numel() + 1, device=conf.device, dtype=ranked.dtype)
    ok = (ranked >= 1 - factor / (n + 1)).nonzero()
    count = int(ok.max()) + 1 if ok.numel() else 1
    return topk_select(conf, count)
