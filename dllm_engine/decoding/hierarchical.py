"""Hierarchical parallel decoding of dInfer (inclusionAI/dInfer,
``python/dinfer/decoding/parallel_strategy.py``: ``HierarchyDecoder``, read at commit fce4e32;
described here, not copied).

It commits tokens that are far apart, which are less likely to depend on each other: the masked
positions of the block split into runs of consecutive positions, and each step commits

- in every run, its most confident position(s), when their confidence > ``low_threshold``;
- every position with confidence > ``threshold``;
- the most confident position of the block (the first on ties), whatever its confidence.

Confidence is the softmax probability of the token (argmax at T = 0, else a sample). Defaults:
low_threshold 0.4 (the decoder's; dInfer's benchmark configurations use 0.5-0.75 beside
threshold 0.8-0.9), threshold the engine's 0.9 (dInfer's benchmark default). Deviations: the mask
token is out of the vocabulary (the engine's rule); a run is a run of the step's candidates
(every masked position of the block, unless a strategy such as FOCUS evicted some); the
decoder's ``steps`` are not read.
"""
from __future__ import annotations

from typing import ClassVar

import torch
from torch import Tensor

from ..engine.sequence import Sequence
from .commit_rules import CommitRule, GroupDecision, Reweigh
from .decide import GroupRules


class Hierarchical(CommitRule):
    name: ClassVar[str] = "hierarchical"

    def decide(self, seqs: list[Sequence], rules: GroupRules, positions: Tensor, logits: Tensor,
               reweigh: Reweigh | None) -> GroupDecision:
        logits, x0, conf = rules.predict(logits, positions, owned=True)
        if reweigh is not None:
            conf = reweigh(positions, x0, conf)
        threshold, low = rules.per_row([[s.params.threshold for s in seqs], [s.params.low_threshold for s in seqs]])
        chosen = hierarchical_select(rules, positions, conf, threshold, low)
        return GroupDecision(logits, x0, chosen)


def hierarchical_select(rules: GroupRules, positions: Tensor, conf: Tensor, threshold: Tensor, low: Tensor
                        ) -> Tensor:
    """bool [K] over the candidates of ``rules``' rows at canvas ``positions`` [K] with confidence
    ``conf`` [K]: in each row, each run's maximum above its ``low`` threshold, everything above
    its ``threshold`` (per row [B]), and its top one (the first on ties)."""
    row, column = rules.row_t, rules.column_t
    order = torch.argsort(row * (1 << 40) + positions, stable=True)  # by row, then position
    pos, c, r = positions[order], conf[order], row[order]
    starts = torch.ones_like(pos, dtype=torch.bool)
    starts[1:] = (pos[1:] != pos[:-1] + 1) | (r[1:] != r[:-1])
    run = starts.cumsum(0) - 1  # [K] run index of each candidate, in (row, position) order
    run_max = torch.full_like(c, -float("inf")).scatter_reduce(0, run, c, "amax")
    picked = ((c == run_max[run]) & (c > low[r])) | (c > threshold[r])
    chosen = torch.empty_like(picked).scatter_(0, order, picked)
    padded = torch.full((rules.num_rows, rules.width), -float("inf"), dtype=conf.dtype, device=conf.device)
    padded[row, column] = conf
    return chosen | (column == padded.argmax(1)[row])
