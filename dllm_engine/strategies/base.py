"""The seams through which an acceleration enters the engine.

A strategy never edits a model file or a base decoder. It may:
- ``setup``: give a new sequence its own state (``seq.strategy_state``);
- ``plan``: change what a step computes (positions, cache slots, tokens, key masks, logits wanted);
- ``layer_hooks``: shrink the active token set inside the layer stack (``ForwardContext.shrink``);
- ``after_forward``: look at the logits before the commit rule (or commit by itself);
- ``after_commit``: update its statistics from what was committed.
"""
from __future__ import annotations

import importlib
from typing import ClassVar

from torch import Tensor

from ..decoding.decoders import StepPlan
from ..engine.sequence import Sequence
from ..models.context import LayerHooks
from ..models.layers import DiffusionLM

from .registry import REGISTRY


class Strategy:
    name: ClassVar[str] = ""
    bases: ClassVar[tuple[str, ...]] = ()  # base decoders it composes with

    def __init__(self, model: DiffusionLM) -> None:
        self.model = model

    def setup(self, seq: Sequence) -> None:
        pass

    def plan(self, seq: Sequence, plan: StepPlan) -> StepPlan:
        return plan

    def layer_hooks(self, seqs: list[Sequence], plans: list[StepPlan]) -> LayerHooks | None:
        return None

    def after_forward(self, seq: Sequence, positions: Tensor, logits: Tensor
                      ) -> tuple[Tensor, Tensor] | None:
        """Return the (positions, logits) the commit rule should see, or None when this
        strategy committed by itself."""
        return positions, logits

    def after_commit(self, seq: Sequence, committed: Tensor) -> None:
        pass

    def extra_cache_slots(self, seq: Sequence) -> int:
        """Cache positions needed beyond the canvas (e.g. speculative copies of the block)."""
        return 0

    def diagnostics(self) -> dict:
        """Figures a diagnostic strategy gathered since ``reset_diagnostics`` (``dllm eval``
        prints them)."""
        return {}

    def reset_diagnostics(self) -> None:
        pass


def strategy_class(name: str) -> type[Strategy]:
    if name not in REGISTRY:
        raise ValueError(f"unknown strategy {name!r}; available: {', '.join(REGISTRY)}")
    module, cls = REGISTRY[name].split(":")
    try:
        return getattr(importlib.import_module(module), cls)
    except ModuleNotFoundError as e:
        raise ValueError(f"strategy {name!r} is not available in this build ({e})") from None


class Pipeline:
    """The strategies of one method, applied in the order the method string names them."""

    def __init__(self, names: list[str], model: DiffusionLM) -> None:
        self.strategies = [strategy_class(n)(model) for n in names]

    def setup(self, seq: Sequence) -> None:
        for s in self.strategies:
            s.setup(seq)

    def plan(self, seq: Sequence, plan: StepPlan) -> StepPlan:
        for s in self.strategies:
            plan = s.plan(seq, plan)
        return plan

    def layer_hooks(self, seqs: list[Sequence], plans: list[StepPlan]) -> LayerHooks | None:
        hooks = [h for s in self.strategies if (h := s.layer_hooks(seqs, plans)) is not None]
        if len(hooks) > 1:
            raise ValueError("at most one strategy per method may shrink the token set")
        return hooks[0] if hooks else None

    def after_forward(self, seq: Sequence, positions: Tensor, logits: Tensor):
        out: tuple[Tensor, Tensor] | None = (positions, logits)
        for s in self.strategies:
            out = s.after_forward(seq, *out)
            if out is None:
                return None
        return out

    def after_commit(self, seq: Sequence, committed: Tensor) -> None:
        for s in self.strategies:
            s.after_commit(seq, committed)

    def extra_cache_slots(self, seq: Sequence) -> int:
        return sum(s.extra_cache_slots(seq) for s in self.strategies)

    def diagnostics(self) -> dict:
        return {k: v for s in self.strategies for k, v in s.diagnostics().items()}

    def reset_diagnostics(self) -> None:
        for s in self.strategies:
            s.reset_diagnostics()
