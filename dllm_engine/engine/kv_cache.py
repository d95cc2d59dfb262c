"""KV storage for the running batch: one row per sequence, indexed by canvas position.

Attention writes the K/V of every token it computes at that token's canvas position, then reads
the row's prefix. What a decoder recomputes each step decides the cache policy:
- reference: the whole canvas (the cache is scratch space);
- prefix cache: block + suffix, so positions before the block keep the K/V of the block's first step;
- dual cache: the block only, so prefix and suffix keep theirs;
- block diffusion: the positions not yet final, so committed blocks are computed exactly once.
Rows change only when sequences join or leave, never inside a step.
"""
from __future__ import annotations

import torch
from torch import Tensor


class KVCache:
    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str) -> None:
        self.shape = (num_kv_heads, head_dim)
        self.dtype, self.device = dtype, device
        self.k: list[Tensor] = [self.empty(0, 1) for _ in range(num_layers)]
        self.v: list[Tensor] = [self.empty(0, 1) for _ in range(num_layers)]

    def empty(self, rows: int, length: int) -> Tensor:
        return torch.zeros(rows, self.shape[0], length, self.shape[1], dtype=self.dtype, device=self.device)

    @property
    def num_rows(self) -> int:
        return self.k[0].shape[0]

    @property
    def capacity(self) -> int:
        """Usable positions per row; the last column is a sink for padding tokens' writes."""
        return self.k[0].shape[2] - 1

    def reshape_rows(self, keep: list[int], num_new: int, min_len: int) -> None:
        """Keep rows ``keep`` (in that order), append ``num_new`` empty rows, and make every row
        hold at least ``min_len`` positions."""
        length = max(self.capacity, min_len) + 1
        idx = torch.tensor(keep, dtype=torch.long, device=self.device)
        for store in (self.k, self.v):
            for layer, old in enumerate(store):
                new = self.empty(len(keep) + num_new, length)
                if keep:
                    new[: len(keep), :, : old.shape[2] - 1] = old.index_select(0, idx)[:, :, :-1]
                store[layer] = new

    def view(self, start: int, end: int) -> "KVCacheView":
        """Rows [start, end) without copying (one forward group of the batch)."""
        return KVCacheView(self, start, end)

    def write(self, layer: int, k: Tensor, v: Tensor, slots: Tensor, valid: Tensor,
              rows: slice = slice(None)) -> None:
        """Store k, v [B, Hkv, T, D] at cache index ``slots`` [B, T]; padding goes to the sink."""
        idx = torch.where(valid, slots, torch.full_like(slots, self.capacity))
        idx = idx[:, None, :, None].expand(-1, k.shape[1], -1, k.shape[3])
        self.k[layer][rows].scatter_(2, idx, k.to(self.dtype))
        self.v[layer][rows].scatter_(2, idx, v.to(self.dtype))

    def read(self, layer: int, length: int, rows: slice = slice(None)) -> tuple[Tensor, Tensor]:
        """K, V [B, Hkv, length, D] of every row's first ``length`` positions (views)."""
        return self.k[layer][rows, :, :length], self.v[layer][rows, :, :length]


class KVCacheView:
    """A contiguous range of a KVCache's rows with the same write/read API."""

    def __init__(self, cache: KVCache, start: int, end: int) -> None:
        self.cache, self.rows = cache, slice(start, end)

    def write(self, layer: int, k: Tensor, v: Tensor, slots: Tensor, valid: Tensor) -> None:
        self.cache.write(layer, k, v, slots, valid, self.rows)

    def read(self, layer: int, length: int) -> tuple[Tensor, Tensor]:
        return self.cache.read(layer, length, self.rows)

    def k(self, layer: int) -> Tensor:
        return self.cache.k[layer][self.rows]

    def v(self, layer: int) -> Tensor:
        return self.cache.v[layer][self.rows]
