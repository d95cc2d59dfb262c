"""Builds the batch tensors of one step, sets the forward context, runs the model and returns,
per sequence, the logits of the positions its decoder asked for."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..decoding.decoders import StepPlan
from ..models.context import ForwardContext, LayerHooks
from ..models.layers import DiffusionLM
from .kv_cache import KVCache
from .sequence import Sequence


def pad_stack(rows: list[Tensor], value: int) -> Tensor:
    """[B, T_max] from 1-D rows, padded at the end with ``value``."""
    return torch.nn.utils.rnn.pad_sequence(rows, batch_first=True, padding_value=value)


@dataclass
class StepInputs:
    """The batch tensors of one step: all a rank needs to run the same forward (a
    tensor-parallel runner sends them to the other ranks)."""
    token_ids: Tensor  # [B, T]
    positions: Tensor  # [B, T]
    valid: Tensor  # [B, T] False for row padding
    mask: Tensor | None  # [B, 1, T, S] or None (every query sees every key)
    num_keys: int  # S
    slots: Tensor  # [B, T] cache slot of each token
    lengths: list[int]  # live tokens per row
    logit_slots: Tensor  # [B, N] cache slots whose logits the step wants
    slot_span: tuple[int, int] | None = None  # every row writes slots [lo, hi) in order, no padding


class Runner:
    def __init__(self, model: DiffusionLM) -> None:
        self.model = model
        self.shift = model.config.logit_shift
        self.num_layers = model.config.num_layers

    def new_cache(self) -> KVCache:
        """An empty KV pool for this process's KV heads."""
        p = next(self.model.parameters())
        return KVCache(self.num_layers, self.model.num_kv_heads, self.model.config.head_dim, p.dtype, p.device)

    def forward(self, seqs: list[Sequence], plans: list[StepPlan], cache: KVCache,
                hooks: LayerHooks | None = None) -> list[tuple[Tensor, Tensor]]:
        """One batched forward. Returns per sequence (positions [n], logits [n, V]) for the
        planned logit positions that are still live at the last layer (a strategy may evict).
        Everything the layer loop needs is derived here, once (see ``ForwardContext``)."""
        plans = [p.finalize(s, self.shift) for s, p in zip(seqs, plans)]
        step = self.inputs(plans)
        ctx = self.context(step, cache, hooks)
        flat, counts, logits = self.run(step, ctx)
        self.account(seqs, ctx)
        positions = pad_stack([p.logit_positions for p in plans], 0).reshape(-1)[flat]
        return list(zip(positions.split(counts), logits.split(counts)))

    def inputs(self, plans: list[StepPlan]) -> StepInputs:
        lengths = [len(p) for p in plans]
        positions = pad_stack([p.positions for p in plans], 0)
        dev = positions.device
        valid = torch.arange(positions.shape[1], device=dev)[None] < torch.tensor(lengths, device=dev)[:, None]
        slots = pad_stack([p.slots for p in plans], 0)
        num_keys, mask, span = self.attention_keys(plans, pad_stack([p.key_limit for p in plans], 1), valid,
                                                   slots if min(lengths) == slots.shape[1] else None)
        return StepInputs(pad_stack([p.token_ids for p in plans], 0), positions, valid, mask, num_keys,
                          slots, lengths, pad_stack([p.logit_slots for p in plans], num_keys), span)

    def context(self, step: StepInputs, cache, hooks: LayerHooks | None) -> ForwardContext:
        return ForwardContext(positions=step.positions, token_valid=step.valid, attn_mask=step.mask,
                              key_length=step.num_keys, cache=cache, hooks=hooks,
                              processed=[0.0] * len(step.lengths), row_lengths=step.lengths,
                              slots=step.slots, slot_span=step.slot_span, shard=self.model.shard,
                              position_bound=step.num_keys)  # a query sees its own key: position < S

    def run(self, step: StepInputs, ctx: ForwardContext) -> tuple[Tensor, list[int], Tensor]:
        """The forward and the LM head over the wanted live tokens: (flat index of each logits
        row into [B, N] of ``step.logit_slots``, rows per sequence, logits)."""
        hidden = self.model.forward_context(step.token_ids, ctx)
        return self.logits(step.logit_slots, hidden, ctx)

    @staticmethod
    def attention_keys(plans: list[StepPlan], limit: Tensor, valid: Tensor, slots: Tensor | None = None
                       ) -> tuple[int, Tensor | None, tuple[int, int] | None]:
        """(S, mask [B, 1, T, S] or None, span): how many cache positions the step reads and
        which of them each query sees; None when every live query sees all S (SDPA runs
        maskless). An explicit key mask of a plan (copies isolated from each other) wins over
        its limits. ``slots`` (given when no row is padded): span = (lo, lo + T) when every row
        writes the cache slots [lo, lo + T) in order (``KVCache.write`` copies a slice), else
        None. One host read per step."""
        explicit = torch.tensor([p.key_mask is not None for p in plans], device=limit.device)
        limit = limit.masked_fill(explicit[:, None], 0)
        top = limit.max()
        facts = [top, torch.where(valid, limit, top).min()]
        if slots is not None:  # rows all start at slots[0, 0] and count up by one
            steps = torch.arange(slots.shape[1], device=slots.device)
            facts += [(slots == slots[:1, :1] + steps).all().long(), slots[0, 0]]
        hi, lo, *span = torch.stack(facts).tolist()
        span = (span[1], span[1] + slots.shape[1]) if span and span[0] else None
        widths = [p.key_mask.shape[1] for p in plans if p.key_mask is not None]
        num_keys = max([hi, *widths])
        if not widths and lo >= hi:
            return num_keys, None, span
        keys = torch.arange(num_keys, device=limit.device)
        mask = keys[None, None, :] < limit[:, :, None]  # [B, T, S]
        for i, p in enumerate(plans):
            if p.key_mask is not None:
                mask[i, : len(p), : p.key_mask.shape[1]] = p.key_mask
        return num_keys, mask[:, None], span

    def account(self, seqs: list[Sequence], ctx: ForwardContext) -> None:
        """nfe, processed_tokens (layer-averaged), and the prompt's first pass as prefill."""
        for seq, work in zip(seqs, ctx.processed):
            work /= self.num_layers
            seq.stats.nfe += 1
            if not seq.prefilled:
                seq.prefilled = True
                seq.stats.prefill_tokens += seq.prompt_len
                work -= seq.prompt_len
            seq.stats.processed_tokens += work

    def logits(self, wanted: Tensor, hidden: Tensor, ctx: ForwardContext) -> tuple[Tensor, list[int], Tensor]:
        """Logits of the ``wanted`` [B, N] cache slots whose token is still live, batched: a
        [B, S + 1] map from cache slot to live column (column S collects padding), one LM-head
        call, one host read (the count per row)."""
        b, s = ctx.slots.shape[0], ctx.key_length
        slots = torch.where(ctx.token_valid & (ctx.slots < s), ctx.slots, s)
        where = torch.full((b, s + 1), -1, dtype=torch.long, device=hidden.device)
        where.scatter_(1, slots, torch.arange(slots.shape[1], device=hidden.device).expand_as(slots))
        where[:, s] = -1
        src = where.gather(1, torch.where((wanted >= 0) & (wanted < s), wanted, s))  # [B, N]
        ok = src >= 0
        counts = ok.sum(1).tolist()
        flat = torch.nonzero_static(ok.reshape(-1), size=sum(counts))[:, 0]
        rows = flat // ok.shape[1]
        return flat, counts, self.model.logits(hidden[rows, src.reshape(-1)[flat]])
