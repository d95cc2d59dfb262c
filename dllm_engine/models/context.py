"""The per-forward context: what attention and the layer loop need besides the hidden state.

The runner builds one ``ForwardContext`` per forward. Attention reads positions, masks and the
KV cache from it; strategies (token eviction, early skipping) enter through ``hooks``, which
return what they keep (``Kept``) and never write into a context. A context is frozen: the live
token set changes only through ``ForwardContext.keep``, which returns a new context, and the
layer loop (``models/layers.py``) carries the current one from layer to layer. Model files never
grow a per-method argument.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import NamedTuple, Protocol

import torch
from torch import Tensor

from ..engine.shapes import bucket

PACK_BELOW = 0.75  # pack live tokens for the per-token layers when more than 1/4 is row padding

NARROW_ROWS = 4  # rows with at most 1/4 of the padded width split attention from the wide rows (RowSplit) ...
SPLIT_SAVING = 64  # ... when that makes them at least this many query tokens narrower


class RowSplit(NamedTuple):
    """Attention over a batch that mixes narrow and wide rows as two calls over query ranges:
    every row's first ``narrow`` queries in place, then the ``wide`` rows' queries
    [``narrow``, ``width``). Each query is computed once."""
    wide: Tensor  # [W] the rows with more than ``narrow`` live tokens
    narrow: int  # the narrow rows' widest live count
    width: int  # the wide rows' widest live count


def row_groups(lengths: list[int], width: int, device: torch.device | str = "cpu") -> RowSplit | None:
    """The ``RowSplit`` of a [B, ``width``] batch whose live tokens are left-packed
    (``lengths`` per row): the narrow rows have at most 1/NARROW_ROWS of ``width`` live. None
    when one call over all rows is as good: no mix, or the narrow rows would be fewer than
    SPLIT_SAVING query tokens narrower than the rest. The second call gathers the wide rows'
    K/V and mask; on CPU that pays for a full canvas beside one-block rows (tiny-llada, ~290
    against 32 wide), not for rows a few tokens wide beside a 32-token block (tiny-sdar with
    FOCUS or its delayed cache at batch 8 and 64, where one call took 0.78-0.89x the time of
    a split that gathered both groups). Host arithmetic only."""
    narrow = [n <= width // NARROW_ROWS for n in lengths]
    if all(narrow) or not any(narrow):
        return None
    narrow_width = max(n for n, f in zip(lengths, narrow) if f)
    wide = [i for i, f in enumerate(narrow) if not f]
    wide_width = max(lengths[i] for i in wide)
    if wide_width - narrow_width < SPLIT_SAVING:
        return None
    return RowSplit(torch.tensor(wide, device=device), narrow_width, wide_width)


class Kept(NamedTuple):
    """What a hook returns to shrink the live set: a subset of each row's live tokens,
    left-packed, and optionally cache keys no query may attend to any more."""
    index: Tensor  # [B, K] column of each kept token in the current set
    valid: Tensor  # [B, K] False for row padding
    lengths: list[int]  # kept tokens per row (host ints; K = max)
    hidden_keys: Tensor | None = None  # [B, S] cache slots hidden from every query from now on
    # per row, which of its live tokens are kept (host bools), when the hook knows it on the host
    host_keep: list | None = None


def nonzero_index(mask: Tensor, size: int) -> Tensor:
    """The indices of the True entries of a 1-D ``mask``, ``size`` of them (known on the host, so
    no device read: ``torch.nonzero_static``); an empty mask gives an empty index (nonzero_static
    on an empty CUDA tensor crashes before torch 2.9)."""
    if mask.numel() == 0 or size == 0:
        return torch.zeros(0, dtype=torch.long, device=mask.device)
    return torch.nonzero_static(mask, size=size)[:, 0]


def compact(keep: Tensor, lengths: list[int] | None = None, hidden_keys: Tensor | None = None,
            host_keep: list | None = None, fixed: bool = False) -> Kept:
    """``keep`` [B, T] bool as a ``Kept``: each row's kept tokens in order. ``lengths``: the kept
    count per row when the caller knows it; else one host read (it sizes the new set).
    ``host_keep``: ``keep`` over each row's live tokens on the host, when the caller has it.
    ``fixed``: a fixed-shape step's (``ForwardContext.fixed_shapes``): the kept set's width is
    the bucket of the widest row (``engine/shapes.bucket``), its padding not valid."""
    if lengths is None:
        lengths = keep.sum(1).tolist()
    width = max(lengths, default=0)
    if fixed:
        width = min(bucket(width), keep.shape[1])
    index = torch.sort((~keep).to(torch.int8), dim=1, stable=True).indices[:, :width]
    counts = torch.tensor(lengths, device=keep.device)
    return Kept(index, torch.arange(width, device=keep.device)[None] < counts[:, None], lengths, hidden_keys,
                host_keep)


class LayerHooks(Protocol):
    """What a strategy may do inside the layer loop. Each returns ``None`` to change nothing,
    or a ``Kept`` (``compact``) to continue with that subset of tokens; neither writes into
    ``ctx`` (it is frozen)."""

    def after_qk(self, layer_idx: int, q: Tensor, k: Tensor, ctx: "ForwardContext") -> Kept | None: ...

    def after_layer(self, layer_idx: int, hidden: Tensor, ctx: "ForwardContext") -> Kept | None:
        """``hidden``: the residual stream after layer ``layer_idx`` in ``ctx``'s layout
        (``ctx.unpack(hidden)`` is [B, T, d]; unpack only at the layers the hook acts on)."""


@dataclass(frozen=True)
class ForwardContext:
    """Everything a layer needs is known before the layer loop (the runner computes it once
    per step): the key count, the mask (or None: every query sees every key), the live tokens
    per row. Inside the loop only a hook's ``Kept`` reads the device (the kept counts).

    Frozen: no layer or hook changes a context. ``keep`` (a hook's ``Kept``) and ``replace``
    make new ones; the facts derived from the live set (``live_index``, ``attention_rows``) are
    computed once per context and memoised in ``derived``, which is not an init field, so a new
    context starts without them."""
    positions: Tensor  # [B, T] position id (= canvas index) of each query token
    token_valid: Tensor  # [B, T] False for row padding
    key_limit: Tensor | None = None  # [B, T] query t sees cache keys < key_limit (turned into attn_mask)
    attn_mask: Tensor | None = None  # [B, 1, T, S] bool; None: every query sees every key
    slots: Tensor | None = None  # [B, T] cache index each token's K/V is written to (= positions)
    cache: object | None = None  # KVCache: write(layer, k, v, positions, valid) / read(layer, S)
    hooks: LayerHooks | None = None
    token_index: Tensor | None = None  # [B, T] index of each live token in the original query set
    cos: Tensor | None = None
    sin: Tensor | None = None
    key_length: int | None = None  # S, the cache positions attention reads (default max key_limit)
    row_lengths: list[int] | None = None  # live tokens per row, left-packed (None: unknown layout)
    slot_span: tuple[int, int] | None = None  # every row writes slots [lo, hi) in order, no padding
    shard: object | None = None  # parallel.Shard of a tensor-parallel model; None in one process
    position_bound: int | None = None  # every position is below it (host); None: read once (RoPE)
    fixed_shapes: bool = False  # never pack or split rows (a fixed-shape step: engine/shapes.py)
    # per row, the original column of each live token (host), while every hook that changed the
    # live set said on the host what it kept; None: unknown (the runner reads the live set)
    host_columns: tuple | None = None
    # memo of the live set's facts; not an init field, so ``replace`` starts a new one
    derived: dict = field(init=False, default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        """Fill the defaults (construction only: ``object.__setattr__`` on a frozen dataclass)."""
        def default(name: str, value) -> None:
            object.__setattr__(self, name, value)
        if self.token_index is None:
            b, t = self.positions.shape
            default("token_index", torch.arange(t, device=self.positions.device).expand(b, t))
        if self.slots is None:
            default("slots", self.positions)
        if self.key_length is None:
            default("key_length", self.default_key_length())
        if self.key_limit is not None:
            if self.attn_mask is None:
                default("attn_mask", limit_mask(self.key_limit, self.token_valid, self.key_length))
            default("key_limit", None)

    def default_key_length(self) -> int:
        if self.attn_mask is not None:
            return self.attn_mask.shape[-1]
        if self.key_limit is not None:
            return int(self.key_limit.max())
        return self.positions.shape[1]

    def all_reduce(self, x: Tensor) -> Tensor:
        """``x`` summed over tensor-parallel ranks (a sum over attention heads that each rank
        computed for its own heads); ``x`` itself in one process."""
        return x if self.shard is None else self.shard.all_reduce(x)

    def num_keys(self) -> int:
        """How many cache positions attention reads this forward."""
        return self.key_length

    def attention_mask(self, num_keys: int) -> Tensor | None:
        """[B, 1, T, S] bool: which keys each query attends to; None when it is every key."""
        return None if self.attn_mask is None else self.attn_mask[..., :num_keys]

    def gather(self, x: Tensor, index: Tensor) -> Tensor:
        """Select tokens ``index`` [B, K] along dim 1 of ``x`` [B, T, ...]."""
        shape = index.shape + x.shape[2:]
        idx = index.reshape(index.shape + (1,) * (x.dim() - 2)).expand(shape)
        return torch.gather(x, 1, idx)

    def live_counts(self) -> list[int]:
        """Live tokens per row (read from the device only for a hand-built context)."""
        if self.row_lengths is not None:
            return self.row_lengths
        if "counts" not in self.derived:
            self.derived["counts"] = self.token_valid.sum(1).tolist()
        return self.derived["counts"]

    def live_index(self) -> Tensor | None:
        """Flat index of the live tokens when row padding is a large share of [B, T] (ragged
        batches: a row at its block's first step beside rows computing one block; tokens evicted
        or skipped in some rows only), else None (dense is cheaper)."""
        if self.fixed_shapes:
            return None
        if "live" not in self.derived:
            total = sum(self.live_counts())
            sparse = total < PACK_BELOW * self.token_valid.numel()
            # the size is known, so no device read: nonzero_static, not nonzero
            index = nonzero_index(self.token_valid.reshape(-1), total)
            self.derived["live"] = index if sparse else None
        return self.derived["live"]

    def attention_rows(self) -> RowSplit | None:
        """``row_groups`` of the live set, computed once per set for every layer's attention
        (only when the live tokens are known to be left-packed)."""
        if "rows" not in self.derived:
            self.derived["rows"] = None if self.fixed_shapes or self.row_lengths is None else row_groups(
                self.row_lengths, self.token_valid.shape[1], self.positions.device)
        return self.derived["rows"]

    def prepare(self) -> "ForwardContext":
        """Derive the live set's facts now, before the layer loop (returns ``self``)."""
        self.live_index()
        self.attention_rows()
        return self

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

    def carry(self, x: Tensor, index: Tensor, kept: "ForwardContext") -> Tensor:
        """``x`` in this context's layout (``pack``), narrowed to the tokens ``index`` [B, K]
        (a hook's ``Kept.index``) and laid out as ``kept`` (the context ``keep`` made of them)."""
        return kept.pack(self.gather(self.unpack(x), index))

    def write_kv(self, layer: int, k: Tensor, v: Tensor) -> None:
        """Store the step's K/V [B, Hkv, T, D] of layer ``layer`` in the cache at ``slots``: one
        slice copy when the rows write one span, else an indexed write whose index is built
        once per context for every layer (``KVCache.write_index``)."""
        if self.slot_span is not None:
            self.cache.write(layer, k, v, self.slots, self.token_valid, span=self.slot_span)
            return
        if "write_index" not in self.derived:
            self.derived["write_index"] = self.cache.write_index(self.slots, self.token_valid)
        self.cache.write(layer, k, v, self.slots, self.token_valid, index=self.derived["write_index"])

    def keep(self, kept: Kept) -> "ForwardContext":
        """The context of the tokens ``kept`` (a hook's ``Kept``: FOCUS eviction, ES-dLLM
        skipping), prepared: the one place the live set changes. Its hidden keys come off the
        mask first (they concern every query, kept or not)."""
        index = kept.index
        columns = None
        if self.host_columns is not None and kept.host_keep is not None:
            columns = tuple(c[k] for c, k in zip(self.host_columns, kept.host_keep))
        mask = self.attn_mask if kept.hidden_keys is None else self.masked_keys(kept.hidden_keys)
        if mask is not None:
            mask = torch.gather(mask, 2, index[:, None, :, None].expand(-1, mask.shape[1], -1, mask.shape[-1]))
        cos_sin = {} if self.cos is None else {"cos": self.gather(self.cos, index), "sin": self.gather(self.sin, index)}
        return replace(self, positions=self.gather(self.positions, index),
                       token_valid=self.gather(self.token_valid, index) & kept.valid,
                       token_index=self.gather(self.token_index, index), slots=self.gather(self.slots, index),
                       row_lengths=kept.lengths, slot_span=None, attn_mask=mask, host_columns=columns,
                       **cos_sin).prepare()

    def masked_keys(self, hidden: Tensor) -> Tensor:
        """[B, 1, T, S] mask in which no query attends to the keys ``hidden`` [B, S] marks."""
        b, t = self.token_valid.shape
        mask = self.attn_mask
        if mask is None:
            mask = torch.ones(b, 1, t, self.key_length, dtype=torch.bool, device=hidden.device)
        return mask & ~hidden[:, None, None, : mask.shape[-1]]


def limit_mask(key_limit: Tensor, valid: Tensor, num_keys: int) -> Tensor | None:
    """[B, 1, T, S] bool from per-query key limits; None when every live query sees all
    ``num_keys`` keys (one host read: a hand-built context; the runner decides it itself)."""
    if bool((key_limit.masked_fill(~valid, num_keys) >= num_keys).all()):
        return None
    keys = torch.arange(num_keys, device=key_limit.device)
    return keys[None, None, None, :] < key_limit[:, None, :, None]


def block_causal_limit(positions: Tensor, block_size: int) -> Tensor:
    """Block-causal attention as key limits: a query at position p sees the keys at positions
    below ``(p // block_size + 1) * block_size``, i.e. its own block and every block before it
    (blocks of ``block_size`` positions counted from 0). The one definition of the pattern: the
    engine decodes with the request's ``block_length``, the plain forward and the trainer use
    the checkpoint's trained ``block_size``."""
    return (positions // block_size + 1) * block_size


def block_causal_mask(query_positions: Tensor, key_positions: Tensor, block_size: int) -> Tensor:
    """[..., Tq, Tk] bool: which keys each query sees under ``block_causal_limit``."""
    limit = block_causal_limit(query_positions, block_size)
    return key_positions[..., None, :] < limit[..., :, None]
