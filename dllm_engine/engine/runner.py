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
        positions = pad_stack([p.positions for p in plans], 0)
        lengths = torch.tensor([len(p) for p in plans], device=positions.device)
        valid = torch.arange(positions.shape[1], device=positions.device)[None] < lengths[:, None]
        limit = pad_stack([p.key_limit for p in plans], 1)
        input_ids = pad_stack([s.canvas[p.positions] for s, p in zip(seqs, plans)], 0)
        ctx = ForwardContext(positions=positions, token_valid=valid, key_limit=limit, cache=cache,
                             hooks=hooks, processed=torch.zeros(len(seqs), dtype=torch.float64))
        hidden = self.model.forward_context(input_ids, ctx)
        self.account(seqs, ctx)
        return self.logits(seqs, plans, hidden, ctx)

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
            where = torch.full((seq.canvas_len + 1,), -1, dtype=torch.long, device=hidden.device)
            live = ctx.token_valid[i]
            where[ctx.positions[i][live]] = live.nonzero()[:, 0]
            src = where[plan.logit_positions - self.shift]  # Dream: position p reads p - 1
            ok = src >= 0
            rows.append(torch.full_like(src[ok], i))
            picked.append(src[ok])
            wanted.append(plan.logit_positions[ok])
        logits = self.model.logits(hidden[torch.cat(rows), torch.cat(picked)])
        return list(zip(wanted, logits.split([w.numel() for w in wanted])))
