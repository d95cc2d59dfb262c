"""The seams through which an acceleration enters the engine.

A strategy never edits a model file or a base decoder. It may:
- ``setup``: give a new sequence its own state (``seq.strategy_state``);
- ``computed``: drop positions the decoder would compute, on the host, before the step's
  inputs are sent (a strategy that only drops positions needs no ``plan``);
- ``plan``: change what a step computes (positions, cache slots, tokens, key masks, logits
  wanted). ``plan`` has no side effects beyond overwriting its own per-step fields: the server
  may replay a step after a failure (``plan_rows``: the same for a whole forward group at once);
- ``layer_hooks``: shrink the active token set inside the layer stack: a hook returns what it
  keeps (``models.context.Kept``) and the layer loop applies it (``ForwardContext.keep``);
- ``after_forward``: look at the logits before the commit rule. It writes only this step's
  scratch (fields ``plan`` resets); what it learns for later steps is applied in
  ``after_commit``, at the sequence's turn, so a step that fails at an earlier row of the group
  leaves this sequence as it was (the replay contract, ``Engine.step_group``);
- ``confidence``: reweigh the commit rule's candidates;
  (``after_forward_rows`` / ``confidence_rows``: the same for a whole forward group at once; by
  default one call per sequence, a strategy may override them with batched ops)
- ``decide_rows``: replace the commit rule (at most one strategy per method does, and it is
  handed the group's own decision, ``commit_rules.GroupCommit``, to fall back on); it returns
  each row's ``RowDecision``, applied at the row's turn, like any commit;
- ``after_commit``: update its per-sequence state from what was committed (host positions).
- ``step_record``: say what it did in the step just committed, for a trace (``record_steps``).

Everything a strategy learns about a sequence lives on the sequence; the instances hold only
the model's constants, so one instance serves every request of a method.

What a strategy is to a method string (its bases, options, stage and the flags that decide which
strategies combine) is plain data in ``dllm_engine.methods.STRATEGIES``; a class takes its
``spec`` from there by ``name``. Composition is decided when the method string is parsed
(``methods.check_method``): a method either runs on every step or is refused up front naming the
conflict. The pipeline applies its strategies in
a fixed order (``stage``), whatever order the method string names them in.
"""
from __future__ import annotations

import importlib
from functools import partial
from typing import Callable, ClassVar

import numpy as np
import torch
from torch import Tensor

from ..errors import UserError
from ..decoding.commit_rules import GroupCommit, RowDecision
from ..decoding.decoders import plan_steps
from ..decoding.plan import StepPlan
from ..engine.sequence import Sequence
from ..methods import STRATEGIES, StrategySpec
from ..models.context import LayerHooks
from ..models.layers import DiffusionLM



class Strategy:
    name: ClassVar[str] = ""
    spec: ClassVar[StrategySpec]  # its entry of methods.STRATEGIES, set from ``name``

    def __init_subclass__(cls, **kwargs) -> None:
        """A class that names itself takes its spec from the registry; it may not set the spec's
        flags itself (they would be written twice, and could disagree)."""
        super().__init_subclass__(**kwargs)
        if "name" not in cls.__dict__:
            return
        if cls.name not in STRATEGIES:
            raise TypeError(f"strategy {cls.name!r} ({cls.__qualname__}) is not in methods.STRATEGIES")
        own = [f for f in StrategySpec.__dataclass_fields__ if f != "name" and f in cls.__dict__]
        if own:
            raise TypeError(f"{cls.__qualname__} sets {', '.join(own)}: a strategy's flags are data in "
                            f"methods.STRATEGIES")
        cls.spec = STRATEGIES[cls.name]

    def __init__(self, model: DiffusionLM) -> None:
        self.model = model

    def setup(self, seq: Sequence) -> None:
        pass

    def computed(self, seq: Sequence, positions: np.ndarray) -> np.ndarray | None:
        """Which of the canvas ``positions`` [T] the decoder plans for ``seq`` this step are
        computed (bool [T]; None: all), decided on the host before the plan is sent. Like
        ``plan``, it writes nothing but this step's scratch."""
        return None

    def plan(self, seq: Sequence, plan: StepPlan) -> StepPlan:
        return plan

    def plan_rows(self, seqs: list[Sequence], plans: list[StepPlan]) -> list[StepPlan]:
        """``plan`` of every sequence of a forward group (by default one call per sequence)."""
        return [self.plan(seq, p) for seq, p in zip(seqs, plans)]

    def layer_hooks(self, seqs: list[Sequence], plans: list[StepPlan]) -> LayerHooks | None:
        return None

    def after_forward(self, seq: Sequence, positions: Tensor, logits: Tensor) -> tuple[Tensor, Tensor]:
        """The (positions, logits) the commit rule should see; writes no state but this
        step's scratch (``after_commit`` applies what should last)."""
        return positions, logits

    def after_forward_rows(self, seqs: list[Sequence], outputs: list[tuple[Tensor, Tensor]]
                           ) -> list[tuple[Tensor, Tensor]]:
        """``after_forward`` of every sequence of a forward group, (positions, logits) in row order."""
        return [self.after_forward(seq, *out) for seq, out in zip(seqs, outputs)]

    def confidence(self, seq: Sequence, positions: Tensor, tokens: Tensor, conf: Tensor) -> Tensor:
        """The commit rule's confidence [N] in ``tokens`` at ``positions`` (reweighed or not)."""
        return conf

    def confidence_rows(self, seqs: list[Sequence], counts: list[int], positions: Tensor, tokens: Tensor,
                        conf: Tensor) -> Tensor:
        """``confidence`` of every sequence of a forward group, laid out row after row
        (``counts`` candidates each): by default one call per sequence."""
        parts = zip(seqs, positions.split(counts), tokens.split(counts), conf.split(counts))
        return torch.cat([self.confidence(*args) for args in parts])

    def decide_rows(self, seqs: list[Sequence], positions: list[Tensor], logits: list[Tensor],
                    commit: Callable[..., GroupCommit]) -> list[RowDecision]:
        """Only where ``owns_commit``: every row's decision for this step, from its candidates'
        ``positions`` and ``logits`` (``commit(seqs, positions, logits)``: the rows' own rules'
        ``GroupCommit``, whose ``read`` is the step's one read). Writes nothing: a
        ``RowDecision`` is applied at its row's turn."""
        return commit(seqs, positions, logits).read()[0]

    def after_commit(self, seq: Sequence, committed: np.ndarray) -> None:
        """At the sequence's turn, after its commit: update its state from the step (what
        ``after_forward`` kept aside, the ``committed`` positions)."""

    def extra_cache_slots(self, seq: Sequence) -> int:
        """Cache positions needed beyond the canvas (e.g. speculative copies of the block)."""
        return 0

    def step_record(self, seq: Sequence) -> dict:
        """What this strategy did to ``seq`` in the step just committed, as plain data (canvas
        positions as lists of ints), for ``seq``'s trace; {} when nothing worth recording. Called
        after ``after_commit``, and only for sequences that record steps (``record_steps``), so
        a strategy may keep views of a step's tensors and read them here."""
        return {}

    def diagnostics(self, seq: Sequence) -> dict:
        """Additive records (each with ``+`` and ``summary()``) a diagnostic strategy gathered
        on ``seq``; ``dllm eval`` sums and prints them."""
        return {}


def strategy_class(name: str) -> type[Strategy]:
    """The runtime class of a strategy name (``methods.STRATEGIES[name].target``), imported now."""
    if name not in STRATEGIES:
        raise UserError(f"unknown strategy {name!r}; available: {', '.join(STRATEGIES)}")
    module, cls = STRATEGIES[name].target.split(":")
    try:
        return getattr(importlib.import_module(module), cls)
    except ModuleNotFoundError as e:
        raise UserError(f"strategy {name!r} is not available in this build ({e})") from None


class Pipeline:
    """The strategies of one method, applied in ``stage`` order (the method string's order does
    not matter: ``methods.check_method`` refused the combinations where it would)."""

    def __init__(self, strategies: list[Strategy]) -> None:
        self.strategies = sorted(strategies, key=lambda s: s.spec.stage)
        self.owner = next((s for s in self.strategies if s.spec.owns_commit), None)
        self.drops = [s for s in self.strategies if type(s).computed is not Strategy.computed]
        # some strategy reweighs the commit rule's confidences (``confidence``)
        self.adjusts_confidence = any(type(s).confidence is not Strategy.confidence for s in self.strategies)

    @classmethod
    def named(cls, names: list[str], model: DiffusionLM) -> "Pipeline":
        """The pipeline of a method's strategy names (``dual-cache+early-skip`` -> early-skip)."""
        return cls([strategy_class(n)(model) for n in names])

    def setup(self, seq: Sequence) -> None:
        for s in self.strategies:
            s.setup(seq)

    def plans(self, seqs: list[Sequence], shift: int) -> list[StepPlan]:
        """The step plans of a forward group: the decoders' (``plan_steps``), less the positions
        a strategy drops (``computed``), then each strategy's ``plan``."""
        plans = plan_steps(seqs, shift, self.computed if self.drops else None)
        for s in self.strategies:
            plans = s.plan_rows(seqs, plans)
        return plans

    def computed(self, seq: Sequence, positions: np.ndarray) -> np.ndarray | None:
        keep = None
        for s in self.drops:
            if (mine := s.computed(seq, positions)) is not None:
                keep = mine if keep is None else keep & mine
        return keep

    def plan(self, seq: Sequence, plan: StepPlan) -> StepPlan:
        for s in self.strategies:
            plan = s.plan(seq, plan)
        return plan

    def layer_hooks(self, seqs: list[Sequence], plans: list[StepPlan]) -> LayerHooks | None:
        hooks = [h for s in self.strategies if (h := s.layer_hooks(seqs, plans)) is not None]
        if len(hooks) > 1:  # methods.check_method refuses such methods: reaching this is a bug
            raise RuntimeError("two strategies of one method returned layer hooks")
        return hooks[0] if hooks else None

    def after_forward_rows(self, seqs: list[Sequence], outputs: list[tuple[Tensor, Tensor]]
                           ) -> list[tuple[Tensor, Tensor]]:
        for s in self.strategies:
            outputs = s.after_forward_rows(seqs, outputs)
        return outputs

    def confidence_rows(self, seqs: list[Sequence], counts: list[int], positions: Tensor, tokens: Tensor,
                        conf: Tensor) -> Tensor:
        for s in self.strategies:
            conf = s.confidence_rows(seqs, counts, positions, tokens, conf)
        return conf

    def decide_rows(self, seqs: list[Sequence], positions: list[Tensor], logits: list[Tensor]
                    ) -> list[RowDecision]:
        """Every row's decision for this step, with one read: the rows' commit rules
        (``GroupCommit``, confidences reweighed by the strategies), or the strategy that owns
        the commit."""
        reweigh = self.confidence_rows if self.adjusts_confidence else None
        commit = partial(GroupCommit, accounted=False, reweigh=reweigh)
        if self.owner is not None:
            return self.owner.decide_rows(seqs, positions, logits, commit)
        return commit(seqs, positions, logits).read()[0]

    def after_commit(self, seq: Sequence, committed: np.ndarray) -> None:
        for s in self.strategies:
            s.after_commit(seq, committed)

    def extra_cache_slots(self, seq: Sequence) -> int:
        return sum(s.extra_cache_slots(seq) for s in self.strategies)

    def step_records(self, seq: Sequence) -> dict[str, dict]:
        """Each strategy's ``step_record`` of the step just committed, by name (empty ones left out)."""
        return {s.name: rec for s in self.strategies if (rec := s.step_record(seq))}

    def diagnostics(self, seqs: list[Sequence]) -> dict:
        """Each diagnostic strategy's records, summed over ``seqs``."""
        return merge_diagnostics([s.diagnostics(seq) for seq in seqs for s in self.strategies])


def merge_diagnostics(records: list[dict]) -> dict:
    """Sum diagnostic records by name (see ``Strategy.diagnostics``)."""
    out: dict = {}
    for rec in records:
        for name, value in rec.items():
            out[name] = out[name] + value if name in out else value
    return out
