"""Counter-based random numbers for sampling: every uniform is a hash of (request seed, canvas
position, the sequence's forward, a stream, a column), computed with integer tensor ops on the
logits' device.

A request therefore draws the same numbers on any device, at any batch size and in any row
order, with no generator state to carry, copy or replay: a row's draws depend on its own key
alone, and a whole batch draws in one pass. The hash is SplitMix64's finalizer (Steele, Lea and
Flood, "Fast splittable pseudorandom number generators", OOPSLA 2014) applied to each key part
in turn; a uniform takes the top 24 bits, so it lies in (0, 1) and converts to float32 exactly."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

MASK64 = (1 << 64) - 1


def signed(value: int) -> int:
    """An unsigned 64-bit constant as the int64 that has its bits."""
    value &= MASK64
    return value - (1 << 64) if value >> 63 else value


GOLDEN = signed(0x9E3779B97F4A7C15)
MIX1, MIX2 = signed(0xBF58476D1CE4E5B9), signed(0x94D049BB133111EB)
TOKENS, CONFIDENCE = 0, 1  # streams: the token draw (one uniform per vocabulary id), random remasking
# DiffusionGemma's uniform-token streams: a new canvas, the tokens renoising a step's undecided positions
CANVAS, RENOISE = 2, 3


def shift_right(x: Tensor, bits: int) -> Tensor:
    """Logical right shift of int64 (torch's ``>>`` keeps the sign)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def mix(x: Tensor) -> Tensor:
    """SplitMix64: x + golden, then two xor-shift-multiply rounds (int64 wraps as uint64 would)."""
    z = x + GOLDEN
    z = (z ^ shift_right(z, 30)) * MIX1
    z = (z ^ shift_right(z, 27)) * MIX2
    return z ^ shift_right(z, 31)


@dataclass
class Noise:
    """The keys of N candidate rows: each row's request seed, the canvas position it predicts
    and its sequence's forward count (``stats.nfe``), plus a ``salt`` per row (a jump-share copy,
    DiffusionGemma's canvas index; 0 otherwise). ``uniform`` and ``integers`` hash them with a
    stream and a column."""
    seeds: Tensor  # [N] int64
    positions: Tensor  # [N] int64
    steps: Tensor  # [N] int64
    salt: Tensor | None = None  # [N] int64

    def row_keys(self, stream: int) -> Tensor:
        h = mix(self.seeds)
        for part in (self.positions, self.steps):
            h = mix(h ^ part)
        if self.salt is not None:  # no salt is salt 0: a jump-share's copy 0 draws as the base step
            h = h ^ self.salt
        return mix(mix(h) ^ stream)  # [N]

    def uniform(self, stream: int, columns: Tensor) -> Tensor:
        """float32 uniforms in (0, 1), [N, C]: one per row and ``columns`` [N, C] (or [C])
        entry, the same for the same key and column wherever and with whatever else it is drawn."""
        h = mix(self.row_keys(stream)[:, None] ^ columns.to(torch.int64))
        return (shift_right(h, 40).to(torch.float32) + 0.5) * (1.0 / (1 << 24))

    def integers(self, stream: int, columns: Tensor, high: int) -> Tensor:
        """int64 in [0, ``high``), [N, C]: the same hashes as ``uniform``, their top 40 bits modulo
        ``high`` (uniform up to a bias of high / 2^40: 2.4e-7 at a 262,144-token vocabulary)."""
        h = mix(self.row_keys(stream)[:, None] ^ columns.to(torch.int64))
        return shift_right(h, 24) % high

    def rows(self, index: Tensor | slice) -> "Noise":
        """The keys of some rows."""
        return Noise(self.seeds[index], self.positions[index], self.steps[index],
                     None if self.salt is None else self.salt[index])

    def __len__(self) -> int:
        return self.seeds.shape[0]
