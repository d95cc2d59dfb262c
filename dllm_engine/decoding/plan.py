"""The step plan: what one sequence computes in one forward. A leaf module (it imports numpy,
torch and ``engine.transfer`` only), so every part of the core can use the type without an
import circle (``tests/test_imports.py``)."""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
from torch import Tensor

from ..engine.transfer import to_device


@dataclass
class StepPlan:
    """What one sequence computes in one forward: the step's layout (positions, cache slots,
    logit slots), on the device and, where it was planned there, on the host.
    ``decoders.plan_steps`` builds a group's (the decoder's key limits, Dream's logit shift, CFG's
    two halves); ``finalize`` fills the defaults. A strategy adjusts a plan only through the named
    operations (``restrict``, ``predicting``), each returning a new plan, or builds a new one
    from host arrays (``decoders.sent_rows``, jump-share's copies); it does not set or re-derive
    fields itself."""
    positions: Tensor  # [T] RoPE positions of the computed tokens
    key_limit: Tensor  # [T] each token attends to cache indices below this
    logit_positions: Tensor  # [N] canvas positions to predict (candidates to commit)
    logit_slots: Tensor | None = None  # [N] cache slot whose output predicts each (default below)
    slots: Tensor | None = None  # [T] cache index each token's K/V goes to (default: positions)
    token_ids: Tensor | None = None  # [T] tokens fed (default: the canvas at positions)
    key_mask: Tensor | None = None  # [T, S] bool, overrides key_limit (e.g. isolated copies)
    host_positions: np.ndarray | None = None  # [T] ``positions`` on the host, where planned there
    host_limit: np.ndarray | None = None  # [T] ``key_limit`` on the host, where planned there
    host_logits: np.ndarray | None = None  # [N] ``logit_positions`` on the host, where planned there
    host_slots: np.ndarray | None = None  # [T] ``slots`` (or ``positions`` when it has none) on the host
    host_logit_slots: np.ndarray | None = None  # [N] ``logit_slots`` on the host, where planned there
    host_tokens: np.ndarray | None = None  # [T] ``token_ids`` on the host, where planned there
    # [T, S] bool on the host: the keys each token sees, overriding key_limit (jump-share's
    # isolated copies); the runner builds the step's mask from it with the others' host limits
    host_key_mask: np.ndarray | None = None

    def __len__(self) -> int:
        return self.positions.numel()

    def restrict(self, keep: np.ndarray) -> "StepPlan":
        """The plan computing only its tokens ``keep`` [T] (host indices). The logits wanted
        stay: one whose slot's token is dropped does not come back (the runner returns the
        logits of live tokens only)."""
        at = to_device(keep, self.positions.device)
        pick = {name: getattr(self, name)[at] for name in ("positions", "key_limit", "slots", "token_ids",
                                                           "key_mask") if getattr(self, name) is not None}
        host = {name: None if getattr(self, name) is None else getattr(self, name)[keep]
                for name in ("host_positions", "host_limit", "host_key_mask", "host_slots", "host_tokens")}
        return replace(self, **pick, **host)

    def predicting(self, positions: np.ndarray, slots: np.ndarray, sent: tuple[Tensor, Tensor]) -> "StepPlan":
        """The plan predicting canvas ``positions`` instead, read at cache ``slots`` (host
        arrays; ``sent``: the same on the device, sent by the caller with its group's)."""
        return replace(self, logit_positions=sent[0], logit_slots=sent[1], host_logits=positions,
                       host_logit_slots=slots)

    def finalize(self, seq, shift: int) -> "StepPlan":
        """Fill the defaults: slots = positions, tokens from the canvas, and Dream's shift
        (position p is predicted by the output at p - 1). ``seq``: the sequence (its ``tokens``)."""
        if self.slots is None:
            self.slots = self.positions
        if self.token_ids is None:
            self.token_ids = seq.tokens(self.positions)
        if self.logit_slots is None:
            self.logit_slots = self.logit_positions - shift
        return self
