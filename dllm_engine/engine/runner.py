"""Builds the batch tensors of one step, sets the forward context, runs the model and returns,
per sequence, the logits of the positions its decoder asked for."""
from __future__ import annotations

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


class Runner:
    def __init__(self, model: DiffusionLM) -> None:
        self.model = model
        self.shift = model.config.logit_shift
        self.num_layers = model.config.num_layers

    def forward(self, seqs: list[Sequence], plans: list[StepPlan], cache: KVCache,
                hooks: LayerHooks | None = None) -> list[tuple[Tensor, Tensor]]:
        """One batched forward. Returns per sequence (positions [n], logits [n, V]) for the
        planned logit positions that are still live at the last layer (a strategy may evict)."""
        plans = [p.finalize(s, self.shift) for s, p in zip(seqs, plans)]
        positions = pad_stack([p.positions for p in plans], 0)
        lengths = torch.tensor([len(p) for p in plans], device=positions.device)
        valid = torch.arange(positions.shape[1], device=positions.device)[None] < lengths[:, None]
        limit = pad_stack([p.key_limit for p in plans], 1)
        input_ids = pad_stack([p.token_ids for p in plans], 0)
        ctx = ForwardContext(positions=positions, token_valid=valid, key_limit=limit, cache=cache,
                             hooks=hooks, processed=torch.zeros(len(seqs), dtype=torch.float64),
                             slots=pad_stack([p.slots for p in plans], 0),
                             attn_mask=self.dense_mask(plans, limit))
        hidden = self.model.forward_context(input_ids, ctx)
        self.account(seqs, ctx)
        return self.logits(seqs, plans, hidden, ctx)

    @staticmethod
    def dense_mask(plans: list[StepPlan], limit: Tensor) -> Tensor | None:
        """[B, 1, T, S] when some plan gives an explicit key mask; None keeps the cheap limits."""
        if all(p.key_mask is None for p in plans):
            return None
        width = max(int(p.key_limit.max()) if p.key_mask is None else p.key_mask.shape[1] for p in plans)
        keys = torch.arange(width, device=limit.device)
        mask = keys[None, None, :] < limit[:, :, None]  # [B, T, S]
        for i, p in enumerate(plans):
            if p.key_mask is not None:
                mask[i, : len(p)] = False
                mask[i, : len(p), : p.key_mask.shape[1]] = p.key_mask
        return mask[:, None]

    def account(self, seqs: list[Sequence], ctx: ForwardContext) -> None:
        """nfe, processed_tokens (layer-averaged), and the prompt's first pass as prefill."""
        per_seq = (ctx.processed / self.num_layers).tolist()
        for seq, work in zip(seqs, per_seq):
            seq.stats.nfe += 1
            if not seq.prefilled:
                seq.prefilled = True
                seq.stats.prefill_tokens += seq.prompt_len
                work -= seq.prompt_len
            seq.stats.processed_tokens += work

    def logits(self, seqs: list[Sequence], plans: list[StepPlan], hidden: Tensor,
               ctx: ForwardContext) -> list[tuple[Tensor, Tensor]]:
        rows, picked, wanted = [], [], []
        for i, (seq, plan) in enumerate(zip(seqs, plans)):
            live = ctx.token_valid[i]
            size = int(torch.cat([ctx.slots[i], plan.logit_slots]).max()) + 1
            where = torch.full((size,), -1, dtype=torch.long, device=hidden.device)
            where[ctx.slots[i][live]] = live.nonzero()[:, 0]
            src = where[plan.logit_slots]
            ok = src >= 0
            rows.append(torch.full_like(src[ok], i))
            picked.append(src[ok])
            wanted.append(plan.logit_positions[ok])
        logits = self.model.logits(hidden[torch.cat(rows), torch.cat(picked)])
        return list(zip(wanted, logits.split([w.numel() for w in wanted])))
