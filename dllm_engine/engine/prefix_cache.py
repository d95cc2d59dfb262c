"""Exact prefix reuse across requests for block-causal families (SDAR, LLaDA2.x).

Under block-causal attention a committed block's K/V depend only on the tokens up to its end
(a token sees its own block and the blocks before it), and block diffusion computes a block's
K/V once more after its last commit (``decoders.after_step``: the cache is final below
``committed_len``). So the K/V of a sequence's final blocks are exactly what any request whose
tokens start the same way would compute for them.

``PrefixStore`` keeps such blocks, each keyed by the chain of its tokens and every token before
it (``block_keys``: a block matches only with its whole prefix), within ``capacity`` bytes,
least recently used evicted first (a chain from its end: ``touch``). After each step the
running sequences' blocks that became final are stored (a prompt's whole blocks after its first
step; an answer's as they complete); a sequence joining the batch starts from the longest run
of stored blocks its prompt begins with: they are copied into its KV pool row and its first
step computes from their end (``Sequence.committed_len``). Stored blocks are copies, never
shared with a pool row, so evicting one never touches a running request.

The blocks of one block length live in one tensor per layer for K and one for V, ``[slots,
block, Hkv, D]`` (the layout a pool row's positions gather to): storing the blocks a step
finalised, or copying a batch's matches into its rows, is one gather and one write per layer,
K and V, whatever the number of sequences or blocks.

Full-attention families (LLaDA, Dream, LLaDA-MoE) are not served: every prompt position attends
to the whole canvas, masks included, so its K/V change with the answer being decoded and are
reusable by no other request (docs/serving.md).
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict

import numpy as np
import torch
from torch import Tensor

from .transfer import to_device

DEFAULT_CAPACITY = 1 << 30  # bytes of stored K/V without a memory budget
FIRST_SLOTS = 16  # blocks a store allocates first; it doubles up to its capacity


def block_keys(tokens: np.ndarray, block: int, count: int) -> list[bytes]:
    """The keys of the first ``count`` whole blocks of ``tokens``: each hashes the one before it
    and its own tokens (and the block size: the same tokens in other blocks attend otherwise)."""
    keys, key = [], block.to_bytes(4, "little")
    for b in range(count):
        key = hashlib.blake2b(key + tokens[b * block:(b + 1) * block].astype(np.int64).tobytes(),
                              digest_size=16).digest()
        keys.append(key)
    return keys


def reusable_blocks(prompt_len: int, block: int) -> int:
    """Whole blocks of a prompt that are final before any answer token: the blocks before the
    one its last token is in, and that one too when the prompt ends at its end."""
    return prompt_len // block


class BlockStore:
    """The stored blocks of one block length."""

    def __init__(self, block: int, block_bytes: int) -> None:
        self.block, self.block_bytes = block, block_bytes
        self.k: list[Tensor] = []  # per layer [slots, block, Hkv, D]
        self.v: list[Tensor] = []
        self.entries: OrderedDict[bytes, tuple[int, np.ndarray]] = OrderedDict()  # key -> (slot, tokens); LRU first
        self.free: list[int] = []

    @property
    def slots(self) -> int:
        return self.k[0].shape[0] if self.k else 0

    @property
    def nbytes(self) -> int:
        return self.slots * self.block_bytes

    def match(self, tokens: np.ndarray, count: int) -> list[int]:
        """Slots of the stored run of blocks ``tokens``' first ``count`` whole blocks begin with."""
        found, keys, b = [], block_keys(tokens, self.block, count), self.block
        for i, key in enumerate(keys):
            hit = self.entries.get(key)
            if hit is None or not np.array_equal(hit[1], tokens[i * b:(i + 1) * b]):
                break
            found.append(hit[0])
        self.touch(keys[:len(found)])
        return found

    def touch(self, keys: list[bytes]) -> None:
        """Mark a chain used, its first block most recently: eviction then takes a chain's
        blocks from its end and never leaves a block whose prefix is gone."""
        for key in reversed(keys):
            self.entries.move_to_end(key)

    def claim(self, count: int, cache, capacity_slots: int) -> list[int]:
        """``count`` free slots (growing the storage by doubling, up to ``capacity_slots``, then
        evicting the least recently used blocks); fewer when the capacity holds fewer."""
        if len(self.free) < count and self.slots < capacity_slots:
            self.grow(min(max(FIRST_SLOTS, 2 * self.slots, self.slots + count), capacity_slots), cache)
        while len(self.free) < count and self.entries:
            self.free.append(self.entries.popitem(last=False)[1][0])
        return [self.free.pop() for _ in range(min(count, len(self.free)))]

    def grow(self, slots: int, cache) -> None:
        """Storage for ``slots`` blocks shaped as ``cache``'s pool (layers, heads, head size,
        dtype, device); the stored blocks are kept."""
        pool = cache.k[0]  # [rows, Hkv, S, D]
        shape = (slots, self.block, pool.shape[1], pool.shape[3])
        k, v = ([torch.zeros(shape, dtype=pool.dtype, device=pool.device) for _ in cache.k] for _ in range(2))
        for new, old in zip(k + v, self.k + self.v):
            new[:old.shape[0]] = old
        self.free += list(range(slots - 1, self.slots - 1, -1))
        self.k, self.v = k, v

    def shrink(self, limit: int) -> int:
        """Evict the least recently used blocks and reallocate until the storage takes at most
        ``limit`` bytes; returns the bytes freed."""
        before = self.nbytes
        keep = max(limit // self.block_bytes, 0)
        if self.slots <= keep:
            return 0
        while len(self.entries) > keep:
            self.entries.popitem(last=False)
        if keep == 0:
            self.k, self.v = [], []
            self.entries.clear()
            self.free = []
            return before
        live = list(self.entries)
        old = torch.tensor([self.entries[key][0] for key in live], dtype=torch.long, device=self.k[0].device)
        pad = (keep - len(live), *self.k[0].shape[1:])  # room left for more blocks
        self.k, self.v = ([torch.cat([t[old], t.new_zeros(pad)]) for t in store] for store in (self.k, self.v))
        self.entries = OrderedDict((key, (i, self.entries[key][1])) for i, key in enumerate(live))
        self.free = list(range(self.slots - 1, len(live) - 1, -1))
        return before - self.nbytes


class PrefixStore:
    """Stored blocks of every block length, within ``capacity`` bytes in all."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        self.capacity = capacity
        self.stores: dict[int, BlockStore] = {}
        self.queried_tokens = 0  # whole prompt blocks' tokens looked up, for the hit rate
        self.hit_tokens = 0  # of those, found

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in list(self.stores.values()))  # a snapshot: /metrics reads it from another thread

    @property
    def blocks(self) -> int:
        return sum(len(s.entries) for s in self.stores.values())

    def has(self, block: int, key: bytes) -> bool:
        return block in self.stores and key in self.stores[block].entries

    def store(self, block: int, cache) -> BlockStore:
        if block not in self.stores:
            k = cache.k[0]
            self.stores[block] = BlockStore(block, 2 * len(cache.k) * k.shape[1] * block * k.shape[3] * k.element_size())
        return self.stores[block]

    def capacity_slots(self, store: BlockStore) -> int:
        """Blocks ``store`` may hold: the capacity less what the other block lengths take."""
        others = self.nbytes - store.nbytes
        return max((self.capacity - others) // store.block_bytes, 0)

    def reuse(self, cache, seqs: list, block: int) -> list[int]:
        """For each of ``seqs`` (new in ``cache``'s pool, one block length), the blocks its prompt
        starts with that are stored, copied into its pool row (one gather and one write per
        layer for them all); returns how many blocks each got."""
        store = self.stores.get(block)
        found = []
        for seq in seqs:
            count = reusable_blocks(seq.prompt_len, block)
            found.append(store.match(seq.canvas, count) if store is not None else [])
            self.queried_tokens += count * block
            self.hit_tokens += len(found[-1]) * block
        pairs = [(cache.rows[s.seq_id], i, slot) for s, slots in zip(seqs, found) for i, slot in enumerate(slots)]
        if pairs:
            rows, blocks, slots = (np.array(x, dtype=np.int64) for x in zip(*pairs))
            positions = blocks[:, None] * block + np.arange(block)  # [N, block]
            index = to_device(np.concatenate([rows, slots, positions.ravel()]), cache.k[0].device)
            row, slot, pos = index[:len(rows)], index[len(rows):2 * len(rows)], index[2 * len(rows):].view(-1, block)
            for pool, stored in zip(cache.k + cache.v, store.k + store.v):
                pool[row[:, None], :, pos] = stored[slot]  # pool[row, :, pos] is [N, block, Hkv, D]
        return [len(f) for f in found]

    def add(self, cache, rows: list[tuple], block: int) -> None:
        """Store the blocks that became final in ``cache``'s pool: ``rows`` of (pool row, the
        sequence's tokens, first block, end block), every new block in one gather per layer."""
        store = self.store(block, cache)
        chains = [block_keys(tokens, block, end) for _, tokens, _, end in rows]
        new: list[tuple[int, int, bytes, np.ndarray]] = []  # (pool row, block, key, tokens)
        for (row, tokens, start, end), keys in zip(rows, chains):
            for b in range(start, end):
                if keys[b] not in store.entries:
                    new.append((row, b, keys[b], tokens[b * block:(b + 1) * block].copy()))
        slots = store.claim(len(new), cache, self.capacity_slots(store)) if new else []
        new = new[:len(slots)]  # a capacity of fewer blocks than a step finalised keeps the first
        if not new:
            return
        rows_ = np.array([n[0] for n in new], dtype=np.int64)
        positions = np.array([n[1] for n in new], dtype=np.int64)[:, None] * block + np.arange(block)
        index = to_device(np.concatenate([rows_, np.array(slots, dtype=np.int64), positions.ravel()]),
                          cache.k[0].device)
        row, slot, pos = index[:len(new)], index[len(new):2 * len(new)], index[2 * len(new):].view(-1, block)
        for pool, stored in zip(cache.k + cache.v, store.k + store.v):
            stored[slot] = pool[row[:, None], :, pos]
        for (_, _, key, tokens), s in zip(new, slots):
            store.entries[key] = (s, tokens)
        for keys in chains:  # each chain used now, from its start
            store.touch([key for key in keys if key in store.entries])

    def evict(self, limit: int) -> int:
        """Shrink to at most ``limit`` bytes in all (a memory budget wants the room); returns the
        bytes freed."""
        freed = 0
        for store in self.stores.values():
            over = self.nbytes - limit
            if over <= 0:
                break
            freed += store.shrink(max(store.nbytes - over, 0))
        return freed

    def clear(self) -> None:
        """Forget every stored block and the counts (``dllm bench`` starts each timed pass cold)."""
        self.stores.clear()
        self.queried_tokens = self.hit_tokens = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0
