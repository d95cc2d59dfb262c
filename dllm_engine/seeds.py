"""Request seeds: the one rule both front ends follow (``LLM`` offline, the server online).

A request that sets ``seed`` samples with it: the same tokens alone, in any batch, in any order.
A request without one takes the next seed of its engine's stream (``LLM(..., seed=S)``): a
stream seeded with S gives the same seeds in the same order every run, so a script run twice
gives the same answers while copies of a prompt, and repeated calls, sample independently;
``seed=None`` draws each from the operating system's randomness (the server's default, as
OpenAI's API). Choice j of a request asking for ``n`` answers samples with its seed + j."""
from __future__ import annotations

import random
import threading

from .errors import UserError
from .sampling_params import MAX_SEED


def choice_seeds(seed: int, n: int) -> list[int]:
    """Choice j of a request samples with its ``seed`` + j."""
    return [(seed + j) % MAX_SEED for j in range(n)]


class SeedStream:
    """The seeds of requests that set none, drawn in the order requests arrive."""

    def __init__(self, seed: int | None) -> None:
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < MAX_SEED):
            raise UserError(f"seed must be an integer in [0, 2**63) or None, got {seed!r}")
        self.seed = seed
        self.rng = random.SystemRandom() if seed is None else random.Random(seed)
        self.lock = threading.Lock()  # the server's handlers may draw from several threads

    def next(self) -> int:
        with self.lock:
            return self.rng.getrandbits(63)

    def choice_seeds(self, seed: int | None, n: int = 1) -> list[int]:
        """The seeds of a request's ``n`` choices: its own ``seed``, else the stream's next one."""
        return choice_seeds(self.next() if seed is None else seed, n)

    def describe(self) -> str:
        """What a request without a seed gets (``/v1/models``, ``dllm serve``'s start-up line)."""
        if self.seed is None:
            return "a request without a seed gets a fresh random one (as OpenAI's API)"
        return f"a request without a seed takes the next of a stream seeded with {self.seed}"
