"""Fixed-shape steps (``LLM(..., fixed_shapes=True)``, ``--fixed-shapes``): a step a CUDA graph
or ``torch.compile`` without dynamic shapes can capture once and replay.

A dynamic step is as small as its work: B rows (the group's sequences), T tokens (the widest
row), S keys (the farthest key any query reads), an attention mask only where some query sees
fewer than S keys, a K/V write that is a slice copy when every row writes the same span, and
packing / row groups when rows are ragged. Each of those is a new shape or a new graph.

A fixed-shape step rounds B, T and S up to a bucket (``bucket``: at most a quarter more),
always passes a mask, always writes K/V by index (padding writes go to the cache's sink) and
never packs or splits rows, so the layer loop sees one signature per (B, T, S) bucket: for
``dual-cache`` a canvas step and a block step per canvas bucket, for ``block`` one per
bucket of the block's end. The price is the padding's compute, which a GPU
absorbs (the step is launch-bound at small batch) and a CPU pays in full; ``dllm profile``
reports both the time and the shapes. Forwards whose hooks shrink the token set (FOCUS,
early skip) pad their hooks to the step's buckets and keep a bucketed set
(``models.context.compact(..., fixed=True)``): their layers take bucket shapes too.
"""
from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor


SMALL = 8  # up to here a bucket is a power of two; above, four buckets per octave


def bucket(n: int) -> int:
    """The size a fixed-shape step rounds ``n`` up to: a power of two up to ``SMALL``, then the
    next multiple of a quarter of the power of two below ``n`` (9 -> 10, 17 -> 20, 100 -> 112):
    at most a quarter of padding, four shapes per doubling. Never above the power of two at or
    above ``n``, so a pool sized by ``bucket`` holds every smaller bucket."""
    if n <= SMALL:
        return 1 << max(n - 1, 0).bit_length()
    step = (1 << ((n - 1).bit_length() - 1)) // 4
    return -(-n // step) * step


def pad_to(x: Tensor, rows: int, width: int, value: int | float) -> Tensor:
    """``x`` [B, T, ...] padded at the end to [rows, width, ...] with ``value``."""
    extra = [0, 0] * (x.dim() - 2)
    return F.pad(x, (*extra, 0, width - x.shape[1], 0, rows - x.shape[0]), value=value)
