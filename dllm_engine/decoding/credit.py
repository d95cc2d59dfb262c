"""Credit-threshold parallel decoding of dInfer (inclusionAI/dInfer,
``python/dinfer/decoding/parallel_strategy.py``: ``CreditThresholdParallelDecoder``, read at
commit fce4e32; described here, not copied).

A position whose top prediction stays the same over several steps earns credit for that token,
which lifts its probability until it passes the threshold. Per block, a credit C [block_length, V]
starts at zero; each step of the block:

1. C <- credit_beta * C, then at every masked candidate position i, whose softmax has its largest
   probability p_i at token k_i: C[i, k_i] += p_i ** credit_gamma;
2. the fused logits  l_i + credit_alpha * log(1 + C_i)  give the token (argmax at T = 0, else a
   sample) and its confidence, its softmax probability under the fused logits;
3. every candidate with confidence >= min(threshold, the highest confidence - 1e-5) commits:
   the threshold rule, with at least the most confident one (and any within 1e-5 of it).

Defaults: credit_alpha 0.7, credit_gamma 0.2 (dInfer's ``boost_gamma``), credit_beta 0.8
(``decay_beta``), the decoder's own; dInfer's benchmarks pass threshold 0.9
(``benchmarks/benchmark.py --threshold``). Deviations: the mask token is out of the vocabulary
before anything (the engine's rule; dInfer lets it win the argmax and then skips the position);
the credit of a block lives on its sequence, so batched requests keep their own; the recorded
logprobs are the model's, not the fused logits'. The decoder's ``steps`` are not read.
Memory: one [block_length, vocab] float32 credit per running sequence.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

import torch
from torch import Tensor

from ..engine.sequence import Sequence
from .commit_rules import CommitRule
from .rules import confidence, sample_tokens

if TYPE_CHECKING:
    from ..strategies.base import Pipeline

KEY = "credit"
SLACK = 1e-5  # dInfer commits every candidate within this of the most confident one


class CreditThreshold(CommitRule):
    name: ClassVar[str] = KEY

    def commit(self, seq: Sequence, positions: Tensor, logits: Tensor, pipeline: Pipeline | None) -> Tensor:
        p = seq.params
        logits = logits.clone()
        logits[:, seq.ids.mask_id] = -float("inf")  # a mask is never a prediction
        rows = positions - seq.block[0]
        credit = updated_credit(previous_credit(seq, logits), rows, logits, p.credit_beta, p.credit_gamma)
        fused = logits.float() + p.credit_alpha * torch.log1p(credit[rows])
        noise = seq.noise(positions)
        x0 = sample_tokens(fused, p.temperature, noise, p.top_k, p.top_p)
        conf = confidence(fused, x0, p.remasking, noise)
        if pipeline is not None:
            conf = pipeline.confidence(seq, positions, x0, conf)
        chosen = credit_select(conf, p.threshold)
        seq.commit(positions[chosen], x0[chosen], logits[chosen])
        seq.rule_state[KEY] = (seq.block_idx, credit)  # after the commit: a replayed step decides the same
        return positions[chosen]


def previous_credit(seq: Sequence, logits: Tensor) -> Tensor:
    """The credit the current block has earned so far [block_length, V] (zeros on its first step)."""
    block, credit = seq.rule_state.get(KEY, (None, None))
    if block != seq.block_idx:
        return torch.zeros(seq.params.block_length, logits.shape[-1], device=logits.device)
    return credit


def updated_credit(credit: Tensor, rows: Tensor, logits: Tensor, beta: float, gamma: float) -> Tensor:
    """A new credit: ``credit`` decayed by ``beta``, plus p ** gamma at each candidate row's most
    probable token (rows [N] into the block, logits [N, V])."""
    top_p, top_token = torch.softmax(logits.float(), dim=-1).max(dim=-1)
    credit = credit * beta
    credit[rows, top_token] += top_p.pow(gamma)
    return credit


def credit_select(conf: Tensor, threshold: float) -> Tensor:
    """bool [N]: conf >= min(threshold, max(conf) - 1e-5), dInfer's threshold rule."""
    floor = (conf.max() - SLACK).clamp(max=threshold)
    return conf >= floor
