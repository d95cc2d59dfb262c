"""Tensor and expert parallelism in the model stack (Megatron-LM, arXiv 1909.08053).

A ``Shard`` says which slice of the model this process holds: rank ``rank`` of ``size``. The
parallel modules below hold only that slice and say, per parameter, which part of the
checkpoint tensor it is (``load_slices``), so the loader reads only those bytes:

- column-parallel linear (q/k/v, gate/up): a rank computes a slice of the output features;
- row-parallel linear (o, down): a rank multiplies its slice of the input features, the partial
  outputs are summed over ranks (one all-reduce), then the bias is added once;
- vocab-parallel embedding: a rank holds a slice of the rows; ids outside it give zeros, and the
  all-reduce sums the one non-zero row;
- vocab-parallel LM head: a rank computes the logits of its vocabulary slice; rank 0 gathers
  them (only for the positions a step asked logits of).

With ``Shard`` None (one process) none of this exists: the model is built from plain
``nn.Linear`` / ``nn.Embedding`` and runs today's code path.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from ..errors import UserError
from ..config import ModelConfig

Slices = list[tuple[int, int, int]]  # (dim, start, end) parts of a checkpoint tensor, concatenated on dim


@dataclass(frozen=True)
class Shard:
    """Rank ``rank`` of ``size`` tensor-parallel ranks. ``group``: the process group the
    collectives run on (None: no collectives, e.g. a loader test reading one rank's slices)."""
    rank: int
    size: int
    group: object | None = None

    def __getstate__(self) -> dict:  # a process group does not travel between processes
        return {"rank": self.rank, "size": self.size, "group": None}

    def __setstate__(self, state: dict) -> None:
        for k, v in state.items():
            object.__setattr__(self, k, v)

    def part(self, total: int) -> tuple[int, int]:
        """[start, end) of this rank's equal part of ``total`` (``check_shardable`` made it divide)."""
        n = total // self.size
        return self.rank * n, (self.rank + 1) * n

    def vocab_part(self, vocab_size: int) -> tuple[int, int, int]:
        """(start, end, rows) of this rank's vocabulary slice: ceil(vocab / size) rows each, the
        last rank's tail padded with zero rows when the vocabulary does not divide."""
        rows = -(-vocab_size // self.size)
        start = min(self.rank * rows, vocab_size)
        return start, min(start + rows, vocab_size), rows

    def all_reduce(self, x: Tensor) -> Tensor:
        """Sum ``x`` over ranks, in place."""
        if self.group is not None:
            dist.all_reduce(x, group=self.group)
        return x

    def gather_last(self, x: Tensor) -> Tensor:
        """Rank 0: the ranks' ``x`` concatenated along the last dim; other ranks: ``x``."""
        if self.group is None:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.rank == 0 else None
        dist.gather(x, parts, group=self.group, group_dst=0)
        return torch.cat(parts, dim=-1) if self.rank == 0 else x


def check_divisible(need: dict[str, int], size: int) -> None:
    """Refuse a ``size`` below 1, and each field of ``need`` (name -> value) that ``size`` does
    not divide, naming it and both sizes."""
    if size < 1:
        raise UserError(f"tensor_parallel_size must be >= 1, got {size}")
    for field, value in need.items():
        if value % size:
            raise UserError(f"{field} {value} is not divisible by tensor_parallel_size {size}; "
                            f"choose a tensor_parallel_size that divides it")


def check_shardable(cfg: ModelConfig, size: int) -> None:
    """Refuse, naming the field and the sizes, a model whose shapes do not split over ``size``
    ranks. Fallbacks instead of errors: KV heads fewer than ranks are replicated (each KV head on
    size / num_kv_heads ranks); a vocabulary that does not divide is padded (``vocab_part``)."""
    need = {"num_heads": cfg.num_heads, "intermediate_size": cfg.intermediate_size}
    if cfg.moe is not None:
        need["num_experts"] = cfg.moe.num_experts
        need["moe_intermediate_size * num_shared_experts"] = (cfg.moe.moe_intermediate_size
                                                              * cfg.moe.num_shared_experts)
    check_divisible(need, size)
    kv = cfg.num_kv_heads
    if kv % size and size % kv:
        raise UserError(f"num_kv_heads {kv} and tensor_parallel_size {size}: one must divide the "
                        f"other (KV heads are split across ranks, or replicated when fewer than ranks)")


def kv_heads_of(cfg: ModelConfig, shard: Shard) -> tuple[int, int]:
    """(first KV head, KV heads) of this rank (``kv_head_part``)."""
    return kv_head_part(cfg.num_heads, cfg.num_kv_heads, shard)


def kv_head_part(num_heads: int, num_kv_heads: int, shard: Shard) -> tuple[int, int]:
    """(first KV head, KV heads) of this rank: the KV heads its query heads read. With fewer KV
    heads than ranks, several ranks hold a copy of the same head (as vLLM does)."""
    heads = num_heads // shard.size
    group = num_heads // num_kv_heads  # query heads per KV head
    return shard.rank * heads // group, max(1, num_kv_heads // shard.size)


class ColumnParallelLinear(nn.Linear):
    """Output features ``parts`` (each (full size, start, end) of one stacked block, e.g. the
    Q | K | V rows of a fused projection) of a linear layer; no communication."""

    def __init__(self, in_features: int, parts: list[tuple[int, int, int]], bias: bool) -> None:
        super().__init__(in_features, sum(end - start for _, start, end in parts), bias=bias)
        offsets = [sum(full for full, _, _ in parts[:i]) for i in range(len(parts))]
        rows = [(0, off + start, off + end) for off, (_, start, end) in zip(offsets, parts)]
        full = sum(full for full, _, _ in parts)
        mark(self.weight, (full, in_features), rows)
        if bias:
            mark(self.bias, (full,), rows)


class RowParallelLinear(nn.Linear):
    """Input features [start, end) of a linear layer of ``in_features``; the partial outputs are
    summed over ranks (``reduce``; off when the caller sums several partials at once), then the
    bias is added once."""

    def __init__(self, in_features: int, out_features: int, shard: Shard, bias: bool = False,
                 reduce: bool = True) -> None:
        start, end = shard.part(in_features)
        super().__init__(end - start, out_features, bias=bias)
        self.shard, self.reduce = shard, reduce
        mark(self.weight, (out_features, in_features), [(1, start, end)])

    def forward(self, x: Tensor) -> Tensor:
        y = F.linear(x, self.weight)
        if self.reduce:
            self.shard.all_reduce(y)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Embedding):
    """Rows [start, end) of the embedding; ids outside give zeros, summed over ranks."""

    def __init__(self, vocab_size: int, hidden_size: int, shard: Shard) -> None:
        self.start, self.end, rows = shard.vocab_part(vocab_size)
        super().__init__(rows, hidden_size)
        self.shard = shard
        mark(self.weight, (vocab_size, hidden_size), [(0, self.start, self.end)])

    def forward(self, ids: Tensor) -> Tensor:
        outside = (ids < self.start) | (ids >= self.end)
        h = F.embedding((ids - self.start).masked_fill(outside, 0), self.weight)
        return self.shard.all_reduce(h.masked_fill(outside[..., None], 0))


class ParallelLMHead(nn.Linear):
    """Logits of vocabulary rows [start, end); rank 0 gathers the full rows (padding cut off)."""

    def __init__(self, hidden_size: int, vocab_size: int, shard: Shard) -> None:
        start, end, rows = shard.vocab_part(vocab_size)
        super().__init__(hidden_size, rows, bias=False)
        self.shard, self.vocab_size = shard, vocab_size
        mark(self.weight, (vocab_size, hidden_size), [(0, start, end)])

    def forward(self, x: Tensor) -> Tensor:
        return self.shard.gather_last(F.linear(x, self.weight))[..., : self.vocab_size]


def mark(param: Tensor, full_shape: tuple[int, ...], slices: Slices) -> None:
    """Tell the loader which part of the checkpoint tensor (of ``full_shape``) ``param`` holds;
    rows past the checkpoint's (a padded vocabulary slice) stay zero."""
    param.full_shape = full_shape
    param.load_slices = slices


def read_slices(tensor_slice, slices: Slices | None, rows: int | None = None) -> Tensor:
    """The parts ``slices`` of a safetensors slice (the whole tensor when None), reading only
    those bytes; zero rows appended up to ``rows``."""
    if slices is None:
        return tensor_slice[:]
    parts = []
    for dim, start, end in slices:
        index = (slice(None),) * dim + (slice(start, end),)
        parts.append(tensor_slice[index])
    out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=slices[0][0])
    if rows is not None and out.shape[0] < rows:
        out = torch.cat([out, out.new_zeros((rows - out.shape[0],) + tuple(out.shape[1:]))])
    return out
