"""The per-forward context: what attention and the layer loop need besides the hidden state.

The runner builds one ``ForwardContext`` per forward. Attention reads positions, masks and the
KV cache from it; strategies (token eviction, early skipping) enter through ``hooks`` and shrink
the active token set with ``shrink``. Model files never grow a per-method argument.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import Tensor

PACK_BELOW = 0.75  # pack live tokens for the per-token layers when more than 1/4 is row padding

NARROW_ROWS = 4  # rows with at most 1/4 of the padded width run attention as their own call


def row_groups(valid: Tensor) -> list[tuple[Tensor, int]] | None:
    """Rows of ``valid`` [B, T] (left-packed live tokens) split into (row index, width) groups
    for attention: the narrow rows (at most 1/NARROW_ROWS of T live) and the rest, each group
    as wide as its widest row. None when one call over all rows is as good (no mix)."""
    live = valid.sum(1)
    narrow = live <= valid.shape[1] // NARROW_ROWS
    if not bool(narrow.any()) or bool(narrow.all()):
        return None
    groups = []
    for group in (narrow, ~narrow):
        rows = group.nonzero()[:, 0]
        groups.append((rows, int(live[rows].max())))
    return groups


class LayerHooks(Protocol):
    """What a strategy may do inside the layer loop. Each returns ``None`` to change nothing,
    or ``(keep_index [B, K], keep_valid [B, K])`` to continue with that subset of tokens."""

    def after_qk(self, layer_idx: int, q: Tensor, k: Tensor, ctx: "ForwardContext"
                 ) -> tuple[Tensor, Tensor] | None: ...

    def after_layer(self, layer_idx: int, hidden: Tensor, ctx: "ForwardContext"
                    ) -> tuple[Tensor, Tensor] | None: ...


@dataclass
class ForwardContext:
    positions: Tensor  # [B, T] position id (= canvas index) of each query token
    token_valid: Tensor  # [B, T] False for row padding
    key_limit: Tensor | None = None  # [B, T] query t sees cache keys with index < key_limit
    attn_mask: Tensor | None = None  # [B, 1, T, S] bool; overrides key_limit when given
    slots: Tensor | None = None  # [B, T] cache index each token's K/V is written to (= positions)
    cache: object | None = None  # KVCache: write(layer, k, v, positions, valid) / read(layer, S)
    hooks: LayerHooks | None = None
    token_index: Tensor | None = None  # [B, T] index of each live token in the original query set
    processed: Tensor | None = None  # [B] query tokens computed, summed over layers
    cos: Tensor | None = None
    sin: Tensor | None = None
    derived: dict = field(default_factory=dict, repr=False)  # facts of the live set; shrink clears it

    def __post_init__(self) -> None:
        if self.token_index is None:
            b, t = self.positions.shape
            self.token_index = torch.arange(t, device=self.positions.device).expand(b, t)
        if self.slots is None:
            self.slots = self.positions

    def count_layer(self) -> None:
        """Add the live tokens of one layer to ``processed`` (SPEC: processed_tokens)."""
        if self.processed is not None:
            self.processed += self.token_valid.sum(1).to(self.processed.dtype)

    def num_keys(self) -> int:
        """How many cache positions attention reads this forward."""
        if self.attn_mask is not None:
            return self.attn_mask.shape[-1]
        return int(self.key_limit.max())

    def attention_mask(self, num_keys: int) -> Tensor:
        """[B, 1, T, S] bool: which keys each query attends to."""
        if self.attn_mask is not None:
            return self.attn_mask[..., :num_keys]
        keys = torch.arange(num_keys, device=self.positions.device)
        return (keys[None, None, None, :] < self.key_limit[:, None, :, None])

    def gather(self, x: Tensor, index: Tensor) -> Tensor:
        """Select tokens ``index`` [B, K] along dim 1 of ``x`` [B, T, ...]."""
        shape = index.shape + x.shape[2:]
        idx = index.reshape(index.shape + (1,) * (x.dim() - 2)).expand(shape)
        return torch.gather(x, 1, idx)

    def live_index(self) -> Tensor | None:
        """Flat index of the live tokens when row padding is a large share of [B, T] (ragged
        batches: a row at its block's first step beside rows computing one block; tokens evicted
        or skipped in some rows only), else None (dense is cheaper)."""
        if "live" not in self.derived:
            valid = self.token_valid.reshape(-1)
            sparse = int(valid.sum()) < PACK_BELOW * valid.numel()
            self.derived["live"] = valid.nonzero()[:, 0] if sparse else None
        return self.derived["live"]

    def attention_rows(self) -> list[tuple[Tensor, int]] | None:
        """``row_groups`` of the live set, computed once per set for every layer's attention."""
        if "rows" not in self.derived:
            self.derived["rows"] = row_groups(self.token_valid)
        return self.derived["rows"]

    def pack(self, x: Tensor) -> Tensor:
        """``x`` [B, T, d] for a per-token layer (projections, MLP): its live tokens as one
        [N, d] matrix when ``live_index`` says so, else ``x`` itself. ``unpack`` inverts it."""
        index = self.live_index()
        return x if index is None else x.reshape(-1, x.shape[-1])[index]

    def unpack(self, y: Tensor) -> Tensor:
        """Inverse of ``pack``: [N, d'] back to [B, T, d'] (zeros at padding)."""
        index = self.live_index()
        if index is None:
            return y
        b, t = self.token_valid.shape
        return y.new_zeros(b * t, y.shape[-1]).index_copy(0, index, y).view(b, t, -1)

    def shrink(self, keep_index: Tensor, keep_valid: Tensor) -> None:
        """Continue with tokens ``keep_index`` [B, K] only (FOCUS eviction, ES-dLLM skipping)."""
        self.derived.clear()
        self.positions = self.gather(self.positions, keep_index)
        self.token_valid = self.gather(self.token_valid, keep_index) & keep_valid
        self.token_index = self.gather(self.token_index, keep_index)
        self.slots = self.gather(self.slots, keep_index)
        if self.key_limit is not None:
            self.key_limit = self.gather(self.key_limit, keep_index)
        if self.attn_mask is not None:
            idx = keep_index[:, None, :, None].expand(-1, self.attn_mask.shape[1], -1,
                                                      self.attn_mask.shape[-1])
            self.attn_mask = torch.gather(self.attn_mask, 2, idx)
        if self.cos is not None:
            self.cos = self.gather(self.cos, keep_index)
            self.sin = self.gather(self.sin, keep_index)
