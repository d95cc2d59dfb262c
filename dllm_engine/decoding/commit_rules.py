"""The seam of a commit rule picked in place of the decoder's own (``SamplingParams.commit_rule``).

A rule decides, from one step's logits, which candidate positions become tokens, for a whole
forward group at once (``decide``; ``GroupCommit`` is the one place a commit is decided); one
rule may also ask for more logits than the masked positions (``logit_index``), rewrite committed
tokens (``Sequence.edit``) and keep an unmasked block open for more steps
(``Sequence.block_open``). What a rule is to a request (its bases, options, whether it edits) is
plain data in ``dllm_engine.methods.COMMIT_RULES``; a class takes its ``spec`` from there by
``name``, as strategies do. Per-sequence state lives on ``seq.rule_state`` and is written only
at the sequence's turn, after its commit (``after_commit``), so a step replayed after a failure
decides the same."""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from functools import cache, partial
from typing import Callable, ClassVar

import numpy as np
import torch
from torch import Tensor

from ..engine.sequence import Sequence, to_device
from ..methods import COMMIT_RULES, CommitRuleSpec
from .decide import GroupRules


@dataclass
class GroupDecision:
    """What a rule decided for the K candidates of its rows, on the device (``GroupCommit.read``
    brings it to the host in the group's one read)."""
    logits: Tensor  # [K, V] the candidates' logits, mask excluded (a commit's logprobs rows)
    x0: Tensor  # [K] the token each candidate drew
    chosen: Tensor  # [K] bool: commits (mask -> token)
    edit: Tensor | None = None  # [K] bool: edits of committed tokens (token -> token)
    states: list | None = None  # per row, the rule's state after this step (``after_commit``)


# (positions [K], tokens [K], confidences [K]) -> the confidences a pipeline's strategies reweigh
Reweigh = Callable[[Tensor, Tensor, Tensor], Tensor]


class CommitRule:
    """The decoder's own rule (fixed-k, threshold, factor: ``decide.GroupRules``); a named rule
    subclasses it."""
    name: ClassVar[str] = ""
    spec: ClassVar[CommitRuleSpec]  # its entry of methods.COMMIT_RULES, set from ``name``

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        if "name" not in cls.__dict__:
            return
        if cls.name not in COMMIT_RULES:
            raise TypeError(f"commit rule {cls.name!r} ({cls.__qualname__}) is not in methods.COMMIT_RULES")
        cls.spec = COMMIT_RULES[cls.name]

    def logit_index(self, seq: Sequence) -> np.ndarray:
        """The canvas positions a step predicts (host): the current block's masked ones."""
        return seq.masked_index()

    def decide(self, seqs: list[Sequence], rules: GroupRules, positions: Tensor, logits: Tensor,
               reweigh: Reweigh | None) -> GroupDecision:
        """Decide the step of ``seqs`` (``rules``: their candidates' layout, options and keys) from
        the candidates' ``logits`` [K, V] at canvas ``positions`` [K], every row at once, in a
        fixed number of tensor ops and no host read; ``logits`` may be written (the caller's
        concatenation). ``reweigh``: the strategies' confidence adjustment. Writes nothing:
        what lasts is applied in ``after_commit``."""
        logits, x0, conf = rules.predict(logits, positions, owned=True)
        if reweigh is not None:
            conf = reweigh(positions, x0, conf)
        return GroupDecision(logits, x0, rules.select(conf))

    def after_commit(self, seq: Sequence, state, edited: bool) -> None:
        """At the sequence's turn, after its commit (and edits): keep the rule's ``state`` from
        ``decide``; ``edited``: the step rewrote a committed token."""


DECODER_RULE = CommitRule()


@cache
def rule_instance(name: str) -> CommitRule:
    """The runtime rule of a ``commit_rule`` name (``methods.COMMIT_RULES[name].target``), imported
    on first use; rules hold no state, so one instance serves every request."""
    module, cls = COMMIT_RULES[name].target.split(":")
    return getattr(importlib.import_module(module), cls)()


def rule_for(seq: Sequence) -> CommitRule:
    """The rule ``seq`` commits by: a named one, else its decoder's own (``DECODER_RULE``)."""
    name = seq.params.commit_rule
    return DECODER_RULE if name is None else rule_instance(name)


@dataclass
class RowDecision:
    """One sequence's step as decided for its group (``GroupCommit``), on the host, applied at
    its turn (``apply``)."""
    positions: np.ndarray  # the canvas positions it commits
    tokens: np.ndarray  # their tokens
    rows: Tensor | None = None  # their logits rows (only for a request that records them)
    edits: tuple[np.ndarray, np.ndarray, Tensor | None] | None = None  # positions, tokens, logits rows
    rule: CommitRule = DECODER_RULE
    state: object = None  # the rule's state after the step
    confidence: np.ndarray | None = None  # a trace's confidence of each commit (else from ``rows``)
    after: Callable[[Sequence], None] | None = None  # what a strategy that decided the row keeps
    candidates: np.ndarray | None = None  # the canvas positions it decided among

    def apply(self, seq: Sequence) -> None:
        """Commit (and edit) what was decided; the rule, and a strategy that decided, keep their state."""
        if len(self.positions):
            seq.commit(self.positions, self.tokens, self.rows, confidence=self.confidence)
        if self.edits is not None and len(self.edits[0]):
            seq.edit(*self.edits)
        self.rule.after_commit(seq, self.state, self.edits is not None and len(self.edits[0]) > 0)
        if self.after is not None:
            self.after(seq)


# (sequences, candidates per sequence, positions, tokens, confidences) -> reweighed confidences
ReweighRows = Callable[[list, list, Tensor, Tensor, Tensor], Tensor]


class GroupCommit:
    """Every sequence's commit (and edits) for one step, from its candidates' canvas
    ``positions`` [N_i] and ``logits`` [N_i, V]: the rows grouped by their rule, each group
    decided at once on the device (``CommitRule.decide``); ``read`` brings the whole group's
    decision to the host in ONE read. The sampling keys are those of the forward each turn
    accounts (``accounted``: already counted in ``stats.nfe``). The one place a commit is
    decided; nothing is written (``RowDecision.apply`` at each turn)."""

    def __init__(self, seqs: list[Sequence], positions: list[Tensor], logits: list[Tensor], accounted: bool,
                 reweigh: ReweighRows | None = None) -> None:
        self.seqs = seqs
        by_rule: dict[CommitRule, list[int]] = {}
        for i, (seq, pos) in enumerate(zip(seqs, positions)):
            if pos.numel():  # a row with no candidate commits nothing and its rule keeps its state
                by_rule.setdefault(rule_for(seq), []).append(i)
        self.parts = []
        for rule, rows in by_rule.items():
            members = [seqs[i] for i in rows]
            counts = [positions[i].numel() for i in rows]
            at = torch.cat([positions[i] for i in rows])
            rules = GroupRules(members, counts, [s.stats.nfe + (not accounted) for s in members], at.device)
            reweigh_part = None if reweigh is None else partial(reweigh, members, counts)
            decision = rule.decide(members, rules, at, torch.cat([logits[i] for i in rows]), reweigh_part)
            self.parts.append((rule, rows, counts, at, decision))

    def read(self, extra: list[Tensor] = ()) -> tuple[list[RowDecision], list[np.ndarray]]:
        """(per sequence its decision; the ``extra`` 1-D int64 tensors), in one read."""
        none = np.zeros(0, dtype=np.int64)
        out = [RowDecision(none, none, candidates=none) for _ in self.seqs]
        flat = [torch.stack([d.chosen.long() + (2 * d.edit.long() if d.edit is not None else 0), d.x0, at.long()]
                            ).flatten() for *_, at, d in self.parts]
        if not flat and not extra:
            return out, []
        host = torch.cat([*flat, *extra]).cpu().numpy()  # the group's one read
        sizes = [t.numel() for t in flat] + [t.numel() for t in extra]
        pieces = np.split(host, np.cumsum(sizes)[:-1])
        for (rule, rows, counts, _, decision), piece in zip(self.parts, pieces):
            self.unpack(out, rule, rows, counts, decision, *piece.reshape(3, -1))
        return out, pieces[len(flat):]

    def unpack(self, out: list[RowDecision], rule: CommitRule, rows: list[int], counts: list[int],
               decision: GroupDecision, kind: np.ndarray, tokens: np.ndarray, where: np.ndarray) -> None:
        """Each row's decision of one rule's part from what the read brought back."""
        seqs = self.seqs
        split = np.cumsum(counts)[:-1]
        committed = [np.flatnonzero(f & 1) for f in np.split(kind, split)]
        edited = [np.flatnonzero(f & 2) for f in np.split(kind, split)]
        offsets = np.cumsum([0, *counts[:-1]])
        commit_rows = gathered(decision.logits, [seqs[i].params.logprobs is not None or seqs[i].trace is not None
                                                 for i in rows], committed, offsets)
        edit_rows = gathered(decision.logits, [decision.edit is not None and seqs[i].params.logprobs is not None
                                               for i in rows], edited, offsets)
        for j, i in enumerate(rows):
            row = out[i]
            mine = committed[j] + offsets[j]
            row.positions, row.tokens, row.rows, row.rule = where[mine], tokens[mine], commit_rows[j], rule
            row.candidates = where[offsets[j]: offsets[j] + counts[j]]
            if decision.edit is not None:
                mine = edited[j] + offsets[j]
                row.edits = (where[mine], tokens[mine], edit_rows[j])
            row.state = None if decision.states is None else decision.states[j]


def gathered(logits: Tensor, wanted: list[bool], picked: list[np.ndarray], offsets: np.ndarray
             ) -> list[Tensor | None]:
    """Per row, the ``logits`` rows of its ``picked`` candidates (indices within the row, whose
    candidates start at ``offsets``) where ``wanted``, else None: one gather for them all."""
    rows = [j for j, w in enumerate(wanted) if w]
    if not rows:
        return [None] * len(wanted)
    index = np.concatenate([picked[j] + offsets[j] for j in rows])
    parts = logits[to_device(index, logits.device)].split([len(picked[j]) for j in rows])
    out: list[Tensor | None] = [None] * len(wanted)
    for j, part in zip(rows, parts):
        out[j] = part
    return out
