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

from typing import TYPE_CHECKING, ClassVar

import torch
from torch import Tensor

from ..engine.sequence import Sequence
from .commit_rules import CommitRule, predict

if TYPE_CHECKING:
    from ..strategies.base import Pipeline


class Hierarchical(CommitRule):
    name: ClassVar[str] = "hierarchical"

    def commit(self, seq: Sequence, positions: Tensor, logits: Tensor, pipeline: Pipeline | None) -> Tensor:
        p = seq.params
        logits, x0, conf = predict(seq, positions, logits)
        if pipeline is not None:
            conf = pipeline.confidence(seq, positions, x0, conf)
        chosen = hierarchical_select(positions, conf, p.threshold, p.low_threshold)
        seq.commit(positions[chosen], x0[chosen], logits[chosen])
        return positions[chosen]


def hierarchical_select(positions: Tensor, conf: Tensor, threshold: float, low_threshold: float) -> Tensor:
    """bool [N] over candidates at canvas ``positions`` [N] with confidence ``conf`` [N]: each
    run's maximum above ``low_threshold``, everything above ``threshold``, and the top one."""
    order = positions.argsort()
    pos, c = positions[order], conf[order]
    starts = torch.ones_like(pos, dtype=torch.bool)
    starts[1:] = pos[1:] != pos[:-1] + 1
    run = starts.cumsum(0) - 1  # [N] run index of each candidate, in position order
    run_max = torch.full_like(c, -float("inf")).scatter_reduce(0, run, c, "amax")
    picked = ((c == run_max[run]) & (c > low_threshold)) | (c > threshold)
    chosen = torch.empty_like(picked).scatter_(0, order, picked)
    chosen[conf.argmax()] = True
    return chosen
