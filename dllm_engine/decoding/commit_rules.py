"""The seam of a commit rule picked in place of the decoder's own (``SamplingParams.commit_rule``).

A rule decides, from one step's logits, which candidate positions become tokens; one rule may
also ask for more logits than the masked positions (``logit_positions``), rewrite committed
tokens (``Sequence.edit``) and keep an unmasked block open for more steps
(``Sequence.block_open``). What a rule is to a request (its bases, options, whether it edits) is
plain data in ``dllm_engine.methods.COMMIT_RULES``; a class takes its ``spec`` from there by
``name``, as strategies do. Per-sequence state lives on ``seq.rule_state`` and is written only
after the step's commit succeeded, so a step replayed after a failure decides the same."""
from __future__ import annotations

import importlib
from functools import cache
from typing import TYPE_CHECKING, ClassVar

from torch import Tensor

from ..engine.sequence import Sequence
from ..methods import COMMIT_RULES, CommitRuleSpec
from .rules import confidence, sample_tokens, without_mask

if TYPE_CHECKING:
    from ..strategies.base import Pipeline


class CommitRule:
    name: ClassVar[str] = ""
    spec: ClassVar[CommitRuleSpec]  # its entry of methods.COMMIT_RULES, set from ``name``

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        if "name" not in cls.__dict__:
            return
        if cls.name not in COMMIT_RULES:
            raise TypeError(f"commit rule {cls.name!r} ({cls.__qualname__}) is not in methods.COMMIT_RULES")
        cls.spec = COMMIT_RULES[cls.name]

    def logit_positions(self, seq: Sequence) -> Tensor:
        """The canvas positions a step predicts: the current block's masked ones."""
        return seq.masked_positions()

    def commit(self, seq: Sequence, positions: Tensor, logits: Tensor, pipeline: Pipeline | None) -> Tensor:
        """Commit this step's tokens among ``positions`` ([N], logits [N, V]); returns the
        positions committed (mask -> token)."""
        raise NotImplementedError


def predict(seq: Sequence, positions: Tensor, logits: Tensor, salt: Tensor | None = None
            ) -> tuple[Tensor, Tensor, Tensor]:
    """A rule's predictions over candidate logits [N, V] at canvas ``positions`` [N], one
    sequence's, as the decoder's own rule draws them: (the logits with the mask excluded, a new
    tensor (their rows are what a committed token records as its logprobs); the token x0 [N]
    drawn under the sequence's sampling options, the argmax when greedy; its confidence [N] under
    ``remasking``). Random draws are keyed by ``seq.noise(positions, salt)`` (``salt``: jump-share's
    copies). A whole group's candidates draw through ``decide.GroupRules`` instead."""
    p = seq.params
    logits = without_mask(logits, seq.ids.mask_id)
    noise = seq.noise(positions, salt)
    x0 = sample_tokens(logits, p.temperature, noise, p.top_k, p.top_p)
    return logits, x0, confidence(logits, x0, p.remasking, noise)


@cache
def rule_instance(name: str) -> CommitRule:
    """The runtime rule of a ``commit_rule`` name (``methods.COMMIT_RULES[name].target``), imported
    on first use; rules hold no state, so one instance serves every request."""
    module, cls = COMMIT_RULES[name].target.split(":")
    return getattr(importlib.import_module(module), cls)()


def rule_for(seq: Sequence) -> CommitRule | None:
    """The rule ``seq`` commits by in place of its decoder's own; None: the decoder's."""
    name = seq.params.commit_rule
    return None if name is None else rule_instance(name)
