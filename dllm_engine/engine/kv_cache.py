"""KV storage of one forward group: a pool of rows, one per sequence, indexed by canvas position.

Attention writes the K/V of every token it computes at that token's canvas position, then reads
the row's prefix. What a decoder recomputes each step decides the cache policy:
- reference: the whole canvas (the cache is scratch space);
- prefix cache: block + suffix, so positions before the block keep the K/V of the block's first step;
- dual cache: the block only, so prefix and suffix keep theirs;
- block diffusion: the positions not yet final, so committed blocks are computed exactly once.

The engine keeps one pool per forward group (method and length class), so a long request widens
only the rows of its own class. Rows change only when sequences join or leave, never inside a
step (``arrange``): a sequence keeps its row while it runs, and a join or leave copies only the
rows that move into the holes. The pool is reallocated when it must grow, and shrinks when it
holds more than ``SHRINK_AT`` times the rows or positions its sequences need. Every layer's K and
V live in one tensor (``buffer``; ``k[layer]`` and ``v[layer]`` are its views), so a move, a
reallocation or a row copy is one gather and one scatter, whatever the depth.
"""
from __future__ import annotations

import torch
from torch import Tensor

SHRINK_AT = 2  # reallocate smaller once the pool is this many times larger than needed


class KVCache:
    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str, static: bool = False) -> None:
        """``static``: mark the storage as static addresses for ``torch.compile`` (a compiled
        step on CUDA: CUDA graphs then replay the steps that write it in place)."""
        self.shape = (num_kv_heads, head_dim)
        self.dtype, self.device, self.static = dtype, device, static
        self.num_layers = num_layers
        # every layer's K and V in one tensor [layers, 2, rows, Hkv, length + 1, D], ``k`` and ``v``
        # its per-layer views: moving rows is one gather and one scatter for the whole pool, not two
        # per layer. A static pool (a compiled step) keeps a tensor per layer and K/V instead, each
        # marked as a static address; ``buffer`` is then None
        self.buffer: Tensor | None = None
        self.k: list[Tensor] = []
        self.v: list[Tensor] = []
        self.allocate(0, 0)
        self.rows: dict[int, int] = {}  # sequence id -> row

    def allocate(self, rows: int, length: int) -> None:
        """Zeroed storage for ``rows`` rows of ``length`` positions (+ the padding sink)."""
        if not self.static:
            self.buffer = torch.zeros(self.num_layers, 2, rows, self.shape[0], length + 1, self.shape[1],
                                      dtype=self.dtype, device=self.device)
            self.k, self.v = list(self.buffer[:, 0].unbind(0)), list(self.buffer[:, 1].unbind(0))
            return
        from torch._dynamo import mark_static_address  # only a compiled step needs dynamo
        self.k, self.v = [], []
        for store in (self.k, self.v):
            for _ in range(self.num_layers):
                t = torch.zeros(rows, self.shape[0], length + 1, self.shape[1], dtype=self.dtype, device=self.device)
                mark_static_address(t, guard=False)  # unguarded: a reallocated pool is re-recorded, not recompiled
                store.append(t)

    @property
    def num_rows(self) -> int:
        return self.k[0].shape[0]

    @property
    def capacity(self) -> int:
        """Usable positions per row; the last column is a sink for padding tokens' writes."""
        return self.k[0].shape[2] - 1

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    @torch.inference_mode(False)  # normal tensors: writable in and out of inference mode
    def arrange(self, ids: list[int], length: int, rows: int = 0) -> list[int]:
        """Give every sequence id a row in [0, len(ids)), each row at least ``length`` positions
        long, the pool at least ``rows`` rows (spare rows for a fixed-shape step's padding);
        ids not listed give their rows up. Returns the ids in row order."""
        n = len(ids)
        stay = {i: self.rows[i] for i in ids if self.rows.get(i, n) < n}
        free = iter(sorted(set(range(n)) - set(stay.values())))
        target = {**stay, **{i: next(free) for i in ids if i not in stay}}
        if self.must_resize(max(n, rows), length):
            self.reallocate(target, max(n, rows), length)
        else:
            self.move(target)
        self.rows = target
        return sorted(ids, key=target.__getitem__)

    def must_resize(self, rows: int, length: int) -> bool:
        too_small = rows > self.num_rows or length > self.capacity
        too_big = self.num_rows > SHRINK_AT * rows or self.capacity > SHRINK_AT * length
        return too_small or too_big

    def reallocate(self, target: dict[int, int], rows: int, length: int) -> None:
        """New storage of exactly ``rows`` x ``length``; running sequences' K/V are copied over."""
        kept = [i for i in target if i in self.rows]
        src = torch.tensor([self.rows[i] for i in kept], dtype=torch.long, device=self.device)
        dst = torch.tensor([target[i] for i in kept], dtype=torch.long, device=self.device)
        width = min(self.capacity, length)
        old_buffer, old = self.buffer, self.k + self.v
        self.allocate(rows, length)
        if old_buffer is not None:
            self.buffer[:, :, dst, :, :width] = old_buffer[:, :, src, :, :width]
            return
        for new, was in zip(self.k + self.v, old):
            new[dst, :, :width] = was[src, :, :width]

    def move(self, target: dict[int, int]) -> None:
        """Copy the rows of the sequences whose row changes (nothing else)."""
        moved = [i for i in target if i in self.rows and self.rows[i] != target[i]]
        if not moved:
            return
        src = torch.tensor([self.rows[i] for i in moved], dtype=torch.long, device=self.device)
        dst = torch.tensor([target[i] for i in moved], dtype=torch.long, device=self.device)
        # the right side is gathered first, so overlapping moves are safe
        if self.buffer is not None:
            self.buffer[:, :, dst] = self.buffer[:, :, src]
            return
        for t in self.k + self.v:
            t[dst] = t[src]

    def view(self, start: int, end: int) -> "KVCacheView":
        """Rows [start, end) without copying (one forward group of the batch)."""
        return KVCacheView(self, slice(start, end))

    def select(self, rows: list[int]) -> "KVCacheView":
        """These rows, in this order, with the same write/read API: a forward over some rows of
        a group (``engine/batch_step.py``: copies of a prompt sharing their first forward).
        Reading gathers a copy, so it serves the steps that read little more than they write."""
        return KVCacheView(self, torch.tensor(rows, dtype=torch.long, device=self.device))

    def copy_rows(self, src: list[int], dst: list[int], lo: int, hi: int) -> None:
        """Positions [lo, hi) of rows ``src`` into rows ``dst``, every layer."""
        s = torch.tensor(src, dtype=torch.long, device=self.device)
        d = torch.tensor(dst, dtype=torch.long, device=self.device)
        if self.buffer is not None:
            self.buffer[:, :, d, :, lo:hi] = self.buffer[:, :, s, :, lo:hi]
            return
        for t in self.k + self.v:
            t[d, :, lo:hi] = t[s, :, lo:hi]

    def write(self, layer: int, k: Tensor, v: Tensor, slots: Tensor, valid: Tensor,
              rows: slice | Tensor = slice(None), span: tuple[int, int] | None = None,
              index: tuple[Tensor, Tensor] | None = None) -> None:
        """Store k, v [B, Hkv, T, D] at cache index ``slots`` [B, T] of ``rows`` (a range, or a row
        index per batch row); padding goes to the sink. ``span`` (lo, hi): every row writes
        slots [lo, hi) in order, none padded (the runner knows it without a device read), so
        the write is one slice copy, not an indexed one. ``index``: ``write_index(slots, valid,
        rows)``, when the caller built it once for every layer."""
        if span is not None:
            self.k[layer][rows, :, span[0]: span[1]] = k
            self.v[layer][rows, :, span[0]: span[1]] = v
            return
        row, idx = self.write_index(slots, valid, rows) if index is None else index
        # index_put over a [B, S, Hkv, D] view: a whole head vector per index, ~2x faster than
        # a scatter along dim 2 with an index expanded to every element
        k_rows, v_rows = (self.k[layer][rows], self.v[layer][rows]) if isinstance(rows, slice) \
            else (self.k[layer], self.v[layer])
        if k.dtype != self.dtype:
            k, v = k.to(self.dtype), v.to(self.dtype)
        k_rows.transpose(1, 2).index_put_((row, idx), k.transpose(1, 2))
        v_rows.transpose(1, 2).index_put_((row, idx), v.transpose(1, 2))

    def write_index(self, slots: Tensor, valid: Tensor, rows: slice | Tensor = slice(None)
                    ) -> tuple[Tensor, Tensor]:
        """The (row, slot) index [B, T] pair an indexed ``write`` of ``slots`` puts each token
        at: padding at the sink slot; rows counted in the range for a slice ``rows``, in the
        pool for a row index. The same for every layer of a forward."""
        idx = torch.where(valid, slots, self.capacity)
        if isinstance(rows, slice):
            return torch.arange(idx.shape[0], device=idx.device)[:, None].expand_as(idx), idx
        return rows[:, None].expand_as(idx), idx

    def read(self, layer: int, length: int, rows: slice | Tensor = slice(None)) -> tuple[Tensor, Tensor]:
        """K, V [B, Hkv, length, D] of every row's first ``length`` positions (views of a range,
        copies of selected rows)."""
        return self.k[layer][rows, :, :length], self.v[layer][rows, :, :length]


class KVCacheView:
    """A contiguous range of a KVCache's rows (``rows`` a slice), or chosen rows (a row index
    tensor, ``KVCache.select``), with the same write/read API."""

    def __init__(self, cache: KVCache, rows: slice | Tensor) -> None:
        self.cache, self.rows = cache, rows

    def write(self, layer: int, k: Tensor, v: Tensor, slots: Tensor, valid: Tensor,
              span: tuple[int, int] | None = None, index: tuple[Tensor, Tensor] | None = None) -> None:
        self.cache.write(layer, k, v, slots, valid, self.rows, span, index)

    def write_index(self, slots: Tensor, valid: Tensor) -> tuple[Tensor, Tensor]:
        return self.cache.write_index(slots, valid, self.rows)

    def read(self, layer: int, length: int) -> tuple[Tensor, Tensor]:
        return self.cache.read(layer, length, self.rows)

    def widen(self, rows: int) -> "KVCacheView":
        """The view ``rows`` rows long from the same start (a fixed-shape step's padding rows:
        spare rows of the pool, ``KVCache.arrange(..., rows)``)."""
        if not isinstance(self.rows, slice):
            raise ValueError("a view of chosen rows is as wide as its rows")
        if self.rows.start + rows > self.cache.num_rows:
            raise ValueError(f"the KV pool has {self.cache.num_rows} rows, a view from row "
                             f"{self.rows.start} needs {rows}: arrange it with rows={rows}")
        return KVCacheView(self.cache, slice(self.rows.start, self.rows.start + rows))
