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

from typing import ClassVar

import torch
from torch import Tensor

from ..engine.sequence import Sequence
from .commit_rules import CommitRule, GroupDecision, Reweigh
from .decide import GroupRules

KEY = "credit"
SLACK = 1e-5  # dInfer commits every candidate within this of the most confident one


class CreditThreshold(CommitRule):
    name: ClassVar[str] = KEY

    def decide(self, seqs: list[Sequence], rules: GroupRules, positions: Tensor, logits: Tensor,
               reweigh: Reweigh | None) -> GroupDecision:
        """Every row's credit updated and its commit chosen at once; each row's new credit is its
        state (kept by ``after_commit``)."""
        logits = rules.without_mask(logits, owned=True)  # a mask is never a prediction
        row = rules.row_t
        alpha, beta, gamma, threshold, start = rules.per_row(
            [[s.params.credit_alpha for s in seqs], [s.params.credit_beta for s in seqs],
             [s.params.credit_gamma for s in seqs], [s.params.threshold for s in seqs],
             [s.block[0] for s in seqs]])
        in_block = positions - start.long()[row]  # [K] each candidate's row of its block's credit
        length = max(s.params.block_length for s in seqs)
        zeros = logits.new_zeros((length, logits.shape[-1]), dtype=torch.float32)
        credit = torch.stack([fitted(previous_credit(s), zeros) for s in seqs])  # [B, L, V]
        credit = updated_credit(credit * beta[:, None, None], row, in_block, logits, gamma[row])
        fused = logits.float() + alpha[row, None] * torch.log1p(credit[row, in_block])
        x0, conf = rules.tokens(fused, positions)
        if reweigh is not None:
            conf = reweigh(positions, x0, conf)
        best = torch.full_like(threshold, -float("inf")).scatter_reduce(0, row, conf, "amax")
        chosen = conf >= torch.minimum(best - SLACK, threshold)[row]  # dInfer's threshold rule
        return GroupDecision(logits, x0, chosen, states=list(credit.unbind(0)))

    def after_commit(self, seq: Sequence, state, edited: bool) -> None:
        """Keep the block's credit while it has masks (after the commit: a replayed step decides
        the same); a finished block's is dropped (a row of its group's tensor)."""
        seq.rule_state[KEY] = (seq.block_idx, state) if seq.num_masked() else (None, None)


def previous_credit(seq: Sequence) -> Tensor | None:
    """The credit the current block has earned so far [block_length, V] (None on its first step)."""
    block, credit = seq.rule_state.get(KEY, (None, None))
    return credit if block == seq.block_idx else None


def fitted(credit: Tensor | None, zeros: Tensor) -> Tensor:
    """``credit`` with as many block rows as ``zeros`` (a group's longest block; the rows past a
    block's own length stay zero), or ``zeros`` when there is none."""
    if credit is None:
        return zeros
    if credit.shape[0] == zeros.shape[0]:
        return credit
    if credit.shape[0] > zeros.shape[0]:
        return credit[: zeros.shape[0]]
    return torch.cat([credit, zeros[credit.shape[0]:]])


def updated_credit(credit: Tensor, row: Tensor, in_block: Tensor, logits: Tensor, gamma: Tensor) -> Tensor:
    """``credit`` [B, L, V] (already decayed) plus p ** gamma at each candidate's most probable
    token (the candidate of row ``row`` at block row ``in_block``, logits [K, V])."""
    top_p, top_token = torch.softmax(logits.float(), dim=-1).max(dim=-1)
    return credit.index_put_((row, in_block, top_token), top_p.pow(gamma), accumulate=True)
