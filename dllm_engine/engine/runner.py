"""Builds the batch tensors of one step, sets the forward context, runs the model and returns,
per sequence, the logits of the positions its decoder asked for."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from ..decoding.plan import StepPlan
from ..models.context import ForwardContext, LayerHooks, nonzero_index
from ..models.layers import DiffusionLM
from .kv_cache import KVCache
from .sequence import Sequence, to_device
from .shapes import bucket, pad_to


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
    logit_slots: Tensor | None  # [B, N] cache slots whose logits the step wants (or ``logit_index``)
    slot_span: tuple[int, int] | None = None  # every row writes slots [lo, hi) in order, no padding
    fixed_shapes: bool = False  # B, T, S bucketed, mask always, no packing (``engine/shapes.py``)
    # [K] flat index into the [B * T] outputs of the tokens whose logits the step wants, when the
    # host knows them (``engine/batch_step.py``: no hook changes the token set)
    logit_index: Tensor | None = None
    # per row, the cache slot of each token and the slots whose logits it wants, on the host
    # (plans built there): the runner finds the logits rows without a read, unless a hook
    # changed the token set without saying on the host what it kept
    host_slots: list | None = None
    host_logit_slots: list | None = None
    logit_positions: Tensor | None = None  # [len(plans), N] canvas position of each wanted logit (padding 0)


class Runner:
    def __init__(self, model: DiffusionLM) -> None:
        self.model = model
        self.shift = model.config.logit_shift
        self.num_layers = model.config.num_layers
        self.fixed_shapes = False  # bucketed step shapes (``set_step_shapes``, ``engine/shapes.py``)
        self.step_forward = None  # the layer stack fixed-shape steps run (None: the model's own)
        self.compiled_step = None  # made once (``compile_step``): its graphs outlive a toggle
        # rows whose first forward is the same run it once (``batch_step.twins``): the n copies
        # of a request, one prompt sent together
        self.share_forwards = True

    @property
    def shares_forwards(self) -> bool:
        """Whether equal first forwards run once: not through the compiled stack (its graphs
        take a pool's row range)."""
        return self.share_forwards and self.step_forward is None

    def set_step_shapes(self, fixed_shapes: bool, compile_step: bool = False) -> None:
        """Dynamic steps, fixed-shape steps, or fixed-shape steps through the compiled layer
        stack (``models/compiled.compile_step``). Between generate calls: a pool gets the spare
        rows of fixed-shape steps when its sequences are admitted."""
        self.fixed_shapes = fixed_shapes or compile_step
        if compile_step and self.compiled_step is None:
            from ..models.compiled import compile_step as compiled
            self.compiled_step = compiled(self.model)
        self.step_forward = self.compiled_step if compile_step else None

    def batch_rows(self, num_seqs: int) -> int:
        """Rows of a forward over ``num_seqs`` sequences (its KV view must have as many)."""
        return bucket(num_seqs) if self.fixed_shapes else num_seqs

    def pool_length(self, positions: int) -> int:
        """Positions a KV pool row needs for sequences of ``positions`` cache positions."""
        return bucket(positions) if self.fixed_shapes else positions

    def new_cache(self) -> KVCache:
        """An empty KV pool for this process's KV heads (static addresses for a compiled step
        on CUDA: CUDA graphs capture a graph that writes its inputs only if they are static)."""
        p = next(self.model.parameters())
        static = self.compiled_step is not None and p.device.type == "cuda"
        return KVCache(self.num_layers, self.model.num_kv_heads, self.model.config.head_dim, p.dtype, p.device,
                       static)

    def forward(self, seqs: list[Sequence], plans: list[StepPlan], cache: KVCache,
                hooks: LayerHooks | None = None) -> list[tuple[Tensor, Tensor]]:
        """``forward_rows`` with its work accounted to each sequence at once (``account``)."""
        outputs, work = self.forward_rows(seqs, plans, cache, hooks)
        for seq, w in zip(seqs, work):
            self.account(seq, w)
        return outputs

    def forward_rows(self, seqs: list[Sequence], plans: list[StepPlan], cache: KVCache,
                     hooks: LayerHooks | None = None) -> tuple[list[tuple[Tensor, Tensor]], list[float]]:
        """One batched forward. Returns per sequence (positions [n], logits [n, V]) for the
        planned logit positions that are still live at the last layer (a strategy may evict),
        and per sequence the tokens it computed, summed over layers, for ``account``: the
        caller accounts each row at its turn, so a step that fails mid-group leaves the rows
        after the failure as they were. Changes no sequence.
        Everything the layer loop needs is derived here, once (see ``ForwardContext``).
        With ``fixed_shapes`` the forward runs bucketed on ``cache`` widened to its padded rows
        (the pool keeps them spare); layer hooks that shrink the token set (FOCUS, early
        skipping) are padded to the step's rows and tokens (``pad_to``) and keep a bucketed set
        (``compact(..., fixed=True)``), so their forwards take bucket shapes too; hooks without
        ``pad_to`` keep the forward dynamic."""
        plans = [p.finalize(s, self.shift) for s, p in zip(seqs, plans)]
        fixed = self.fixed_shapes and (hooks is None or hasattr(hooks, "pad_to"))
        rows = self.batch_rows(len(plans)) if fixed else len(plans)
        if rows > len(plans):
            cache = cache.widen(rows)
        step = self.inputs(plans, rows, fixed)
        if fixed and hooks is not None:
            hooks.pad_to(rows, step.positions.shape[1])
        flat, counts, logits, processed = self.run(step, self.context(step, cache, hooks))
        work = processed or [n * self.num_layers for n in step.lengths]
        positions = step.logit_positions.reshape(-1)[flat]
        outputs = list(zip(positions.split(counts), logits.split(counts)))
        return outputs[: len(seqs)], work[: len(seqs)]  # not padding rows

    def inputs(self, plans: list[StepPlan], rows: int | None = None, fixed: bool = False) -> StepInputs:
        """The step's tensors: [B, T] from the plans, or ``fixed`` [rows, bucket(T)] (padding
        rows and tokens: position 0, slot 0, invalid). Plans built on the host (every plan the
        decoders and strategies make) give them in one copy of their host arrays (``host_grids``);
        plans built with tensors only are padded on the device, a copy per row and field."""
        lengths = [len(p) for p in plans]
        rows = rows or len(plans)
        width = bucket(max(lengths)) if fixed else max(lengths)
        lengths += [0] * (rows - len(plans))
        whole = not fixed and min(lengths) == width  # no row padded: the write may be a slice
        grids = host_grids(plans, rows, width, next(self.model.parameters()).device)
        if grids is not None:
            token_ids, positions, slots, limit, valid, logit_slots, logit_positions = grids
        else:
            def stack(parts: list[Tensor], value: int) -> Tensor:
                x = pad_stack(parts, value)
                return pad_to(x, rows, width, value) if fixed else x

            positions = stack([p.positions for p in plans], 0)
            token_ids, slots, limit = (stack([getattr(p, name) for p in plans], value)
                                       for name, value in (("token_ids", 0), ("slots", 0), ("key_limit", 1)))
            valid = torch.arange(width, device=positions.device)[None] < torch.tensor(lengths, device=positions.device)[:, None]
            logit_slots = pad_stack([p.logit_slots for p in plans], -1)  # -1: no slot
            logit_slots = pad_to(logit_slots, rows, logit_slots.shape[1], -1)
            logit_positions = pad_stack([p.logit_positions for p in plans], 0)
        num_keys, mask, span = self.attention_keys(plans, limit, valid, slots if whole else None, fixed)
        known = all(p.host_slots is not None and p.host_logit_slots is not None for p in plans)
        return StepInputs(token_ids, positions, valid, mask, num_keys, slots, lengths, logit_slots, span, fixed,
                          host_slots=[p.host_slots for p in plans] if known else None,
                          host_logit_slots=[p.host_logit_slots for p in plans] if known else None,
                          logit_positions=logit_positions)

    def context(self, step: StepInputs, cache, hooks: LayerHooks | None) -> ForwardContext:
        """The step's forward context (frozen: the layer loop derives any narrower one)."""
        return ForwardContext(positions=step.positions, token_valid=step.valid, attn_mask=step.mask,
                              key_length=step.num_keys, cache=cache, hooks=hooks,
                              row_lengths=step.lengths,
                              slots=step.slots, slot_span=step.slot_span, shard=self.model.shard,
                              fixed_shapes=step.fixed_shapes,
                              position_bound=step.num_keys,  # a query sees its own key: position < S
                              host_columns=None if step.host_slots is None else
                              tuple(np.arange(n) for n in step.lengths))

    def run(self, step: StepInputs, ctx: ForwardContext
            ) -> tuple[Tensor, list[int], Tensor, list[float] | None]:
        """The forward and the LM head over the wanted live tokens: (flat index of each logits
        row into [B, N] of ``step.logit_slots``, rows per sequence, logits, the layer loop's
        count of computed tokens per row: None without hooks, when no layer changes the set).
        With ``step.logit_index`` the host knows the rows: (None, None, logits, processed)."""
        ctx = self.model.prepare_context(ctx)
        if step.fixed_shapes and self.step_forward is not None and ctx.hooks is None:  # the compiled stack: no hooks
            hidden, processed = self.step_forward(step.token_ids, ctx), None
        else:
            hidden, ctx, processed = self.model.run_layers(step.token_ids, ctx)
        if step.logit_index is not None:
            return None, None, self.model.logits(hidden.reshape(-1, hidden.shape[-1])[step.logit_index]), processed
        if ctx.host_columns is not None and step.host_logit_slots is not None:
            return *self.host_logits(step, hidden, ctx), processed
        return *self.logits(step.logit_slots, hidden, ctx), processed

    def host_logits(self, step: StepInputs, hidden: Tensor, ctx: ForwardContext) -> tuple[Tensor, list[int], Tensor]:
        """``logits`` from the host's knowledge of the live set (``ctx.host_columns``) and of the
        plans' slots: the same rows, found without a read; their indices go in one copy."""
        s, width, n = ctx.key_length, hidden.shape[1], step.logit_slots.shape[1]
        rows, flat, counts = [], [], []
        for i, (columns, slots, wanted) in enumerate(zip(ctx.host_columns, step.host_slots, step.host_logit_slots)):
            where = np.full(s + 1, -1)
            live = slots[columns]
            inside = live < s
            where[live[inside]] = np.flatnonzero(inside)  # cache slot -> live column
            src = where[np.where((wanted >= 0) & (wanted < s), wanted, s)]
            found = np.flatnonzero(src >= 0)
            rows.append(i * width + src[found])
            flat.append(i * n + found)
            counts.append(len(found))
        sent = to_device(np.concatenate([*rows, *flat]).astype(np.int64), hidden.device)
        total = sum(counts)
        return sent[total:], counts, self.model.logits(hidden.reshape(-1, hidden.shape[-1])[sent[:total]])

    @staticmethod
    def attention_keys(plans: list[StepPlan], limit: Tensor, valid: Tensor, slots: Tensor | None = None,
                       fixed: bool = False) -> tuple[int, Tensor | None, tuple[int, int] | None]:
        """(S, mask [B, 1, T, S] or None, span): how many cache positions the step reads and
        which of them each query sees; None when every live query sees all S (SDPA runs
        maskless). An explicit key mask of a plan (copies isolated from each other) wins over
        its limits. ``slots`` (given when no row is padded): span = (lo, lo + T) when every row
        writes the cache slots [lo, lo + T) in order (``KVCache.write`` copies a slice), else
        None. ``fixed``: S rounded up to its ``bucket`` and always a mask. The plans' host arrays
        give the key facts (``host_key_facts``); plans built on the device cost one read."""
        if any(p.host_key_mask is not None for p in plans) and all(p.host_limit is not None for p in plans):
            return host_key_mask(plans, limit.shape, fixed, limit.device)
        for p in plans:  # a host key mask beside plans built with tensors only: on the device
            if p.host_key_mask is not None and p.key_mask is None:
                p.key_mask = to_device(p.host_key_mask, limit.device)
        facts = host_key_facts(plans, slots is not None)
        if facts is None:  # a plan built with tensors only: read the facts from the device
            explicit = torch.tensor([p.key_mask is not None for p in plans] + [False] * (limit.shape[0] - len(plans)),
                                    device=limit.device)
            limit = limit.masked_fill(explicit[:, None], 0)
            top = limit.max()
            facts = [top, torch.where(valid, limit, top).min()]
            if slots is not None:  # rows all start at slots[0, 0] and count up by one
                steps = torch.arange(slots.shape[1], device=slots.device)
                facts += [(slots == slots[:1, :1] + steps).all().long(), slots[0, 0]]
            hi, lo, *span = torch.stack(facts).tolist()
            span = (span[1], span[1] + slots.shape[1]) if span and span[0] else None
        else:
            hi, lo, span = facts
        widths = [p.key_mask.shape[1] for p in plans if p.key_mask is not None]
        num_keys = max([hi, *widths])
        if fixed:
            num_keys = bucket(num_keys)
        elif not widths and lo >= hi:
            return num_keys, None, span
        keys = torch.arange(num_keys, device=limit.device)
        mask = keys[None, None, :] < limit[:, :, None]  # [B, T, S]
        for i, p in enumerate(plans):
            if p.key_mask is not None:
                mask[i, : len(p), : p.key_mask.shape[1]] = p.key_mask
        return num_keys, mask[:, None], span

    def account(self, seq: Sequence, work: float) -> None:
        """One forward of ``seq``: nfe, processed_tokens (``work``: the tokens it computed,
        summed over layers; recorded layer-averaged), and the prompt's first pass as prefill."""
        work /= self.num_layers
        seq.stats.nfe += 1
        if not seq.prefilled:  # the prompt less what the prefix store gave (engine/prefix_cache.py)
            seq.prefilled = True
            seq.stats.prefill_tokens += seq.prompt_len - seq.stats.cached_tokens
            work -= seq.prompt_len - seq.stats.cached_tokens
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
        flat = nonzero_index(ok.reshape(-1), sum(counts))
        rows = flat // ok.shape[1]
        return flat, counts, self.model.logits(hidden[rows, src.reshape(-1)[flat]])


# the plans' host arrays ``host_grids`` lays out as [rows, T] grids: (field, padding value)
HOST_GRIDS = (("host_tokens", 0), ("host_positions", 0), ("host_slots", 0), ("host_limit", 1))


def host_grids(plans: list[StepPlan], rows: int, width: int, device: torch.device) -> tuple[Tensor, ...] | None:
    """The step's [rows, width] token ids, positions, cache slots, key limits and validity, its
    [rows, N] wanted logit slots (padding -1) and [len(plans), N] their canvas positions (padding
    0), laid out on the host from the plans' host arrays and sent in one copy (``runner.inputs``
    pads each on the device otherwise: on a GPU a copy kernel per row); None when a plan has no
    host arrays."""
    names = [name for name, _ in HOST_GRIDS] + ["host_logit_slots", "host_logits"]
    if not plans or any(getattr(p, name) is None for p in plans for name in names):
        return None
    n = max(len(p.host_logit_slots) for p in plans)
    grid = np.zeros((len(HOST_GRIDS) + 1, rows, width), dtype=np.int64)
    for j, (_, value) in enumerate(HOST_GRIDS):
        grid[j] = value
    wanted = np.full((2, rows, n), -1, dtype=np.int64)
    wanted[1] = 0
    for i, p in enumerate(plans):
        t, k = len(p.host_positions), len(p.host_logit_slots)
        for j, (name, _) in enumerate(HOST_GRIDS):
            grid[j, i, :t] = getattr(p, name)
        grid[len(HOST_GRIDS), i, :t] = 1  # valid
        wanted[0, i, :k], wanted[1, i, :k] = p.host_logit_slots, p.host_logits
    sent = to_device(np.concatenate([grid.reshape(-1), wanted.reshape(-1)]), device)
    tokens, positions, slots, limit, valid = sent[: grid.size].view(grid.shape).unbind(0)
    logit_slots, logit_positions = sent[grid.size:].view(wanted.shape).unbind(0)
    return tokens, positions, slots, limit, valid.bool(), logit_slots, logit_positions[: len(plans)]


def host_key_mask(plans: list[StepPlan], shape: tuple[int, int], fixed: bool, device: torch.device
                  ) -> tuple[int, Tensor, None]:
    """``Runner.attention_keys`` for plans whose key limits (and explicit key masks) are host
    arrays: the [B, 1, T, S] mask built on the host, sent in one copy. Padding tokens see key 0."""
    rows, width = shape
    widths = [p.host_key_mask.shape[1] if p.host_key_mask is not None else int(p.host_limit.max(initial=1))
              for p in plans]
    num_keys = max(widths)
    if fixed:
        num_keys = bucket(num_keys)
    mask = np.zeros((rows, width, num_keys), dtype=bool)
    mask[:, :, 0] = True
    keys = np.arange(num_keys)
    for i, p in enumerate(plans):
        n = len(p.host_limit)
        if p.host_key_mask is not None:
            mask[i, :n, :] = False
            mask[i, :n, : p.host_key_mask.shape[1]] = p.host_key_mask
        else:
            mask[i, :n] = keys[None, :] < p.host_limit[:, None]
    return num_keys, to_device(mask, device)[:, None], None


def host_key_facts(plans: list[StepPlan], contiguous: bool) -> tuple[int, int, tuple[int, int] | None] | None:
    """(largest key limit, smallest key limit of a live token, span) from the plans' host arrays,
    as ``Runner.attention_keys`` reads them from the device; None when some plan has none (or
    an explicit key mask, or its own slots). ``contiguous``: no row is padded, so the span is
    (lo, lo + T) when every row computes the positions [lo, lo + T)."""
    if any(p.host_limit is None or p.host_positions is None or p.key_mask is not None or p.slots is not p.positions
           for p in plans) or not any(len(p) for p in plans):
        return None
    limits = [p.host_limit for p in plans if len(p)]
    hi, lo = max(int(x.max()) for x in limits), min(int(x.min()) for x in limits)
    span = None
    if contiguous:
        first = plans[0].host_positions
        start, width = int(first[0]), len(first)
        if all(np.array_equal(p.host_positions, np.arange(start, start + width)) for p in plans):
            span = (start, start + width)
    return hi, lo, span
