"""ES-dLLM early skipping on the dual-cache decoder (full-attention LLaDA / Dream).

Paper: Zhu et al., "ES-dLLM: Efficient Inference for Diffusion Large Language Models by
Early-Skipping", ICLR 2026, arXiv 2603.10088.

On a normal step the dual-cache decoder forwards only the current block. Early skipping shrinks
that set inside the layer stack: at the output of every layer where the keep fraction p changes,
each block token gets an importance score

    I = alpha * conf_prev + (1 - alpha) * dh,    dh = mean|h - h_prev| / (RMS(h_prev) + 1e-6)

(dh divided by max(its maximum over the row, 1), as the official code does; h_prev = the token's hidden state at the same layer the
last time it was computed) plus bonuses that protect progress: +2 for the two most confident
tokens (when alpha > 0), +5 for the leftmost masked position, +3 for positions committed at the
previous step (when alpha < 1). The top ``max(int(p * |block|), min(last_decoded + 2, |block|))``
go on; the others are skipped for the rest of the forward. Later layers write K/V for the
survivors only, so skipped positions keep their previous K/V and stay visible to attention: the
paper's partial cache update falls out of the engine's write-then-read cache.

Choices where the paper leaves room (documented so results can be read against the reference):
- conf_prev of a position is the softmax probability of its argmax (mask id excluded) at the
  last step that computed it; a committed position has conf_prev 0, since it has nothing left to
  decode (the reference code zeroes it too); its refresh is protected by the +3 bonus instead.
- Dream (logit shift 1): a token's conf_prev and the leftmost-masked bonus follow the position its
  output predicts (p + 1); the +3 bonus goes to the committed token itself (its input changed).
  The token before the block is in the plan only to predict the first block position: it is
  never skipped and not counted in |block|.
- Pruning after the last layer would save nothing and only drop logits, so it is never done.
- Steps are counted as the official code counts them: ``block_idx * block_length + step`` (its
  counter jumps to the next block's multiple when a block ends early). ``prompt_refresh`` steps
  recompute [0, block end) without skipping, ``block_refresh`` steps skip nothing.
- Block starts (``skip_block_start``): ``prefix`` (default, the official schedule: its
  ``prompt_update_freq`` is the block length) recomputes [0, block end) without skipping; the
  suffix keeps the K/V of the first, full-canvas forward. ``last-commits`` (cheaper) computes
  from the leftmost position committed at the previous step (its K/V were computed while it was
  still masked) to the block end. ``canvas`` recomputes the whole canvas, as the dual-cache
  decoder does. A block's first step never skips: it fills the new block's hidden-state window.
- ``delay_eos`` (default on, the official ``delay_eos_generation``): an EOS predicted at a position
  whose left neighbour in the block is still masked, while no EOS is committed yet, gets
  confidence 0, for the commit rule and for the next step's skip score. (The official Dream path
  zeroes it after recording the skip score; the engine uses one rule for both families.)
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from ..decoding.decoders import sent_rows, span_row
from ..decoding.plan import StepPlan
from ..decoding.rules import greedy_tokens, rank_in_row
from ..engine.sequence import Sequence, host, to_device
from ..engine.shapes import pad_to
from ..models.context import ForwardContext, Kept, compact
from ..models.layers import DiffusionLM
from .base import Strategy

KEY = "early-skip"
TOP_CONF_BONUS, LEFTMOST_BONUS, COMMITTED_BONUS = 2.0, 5.0, 3.0


# -- the schedule and the selection math (pure functions, tested against plain references) ------
def layer_fractions(num_layers: int, keep_fractions: tuple[float, ...],
                    skip_depths: tuple[float, ...]) -> list[float]:
    """Keep fraction of each layer: layer i uses the last (p, s) pair with i >= s * num_layers."""
    out = []
    for i in range(num_layers):
        passed = [p for p, s in zip(keep_fractions, skip_depths) if i >= s * num_layers]
        out.append(passed[-1] if passed else 1.0)
    return out


def prune_layers(fractions: list[float]) -> list[int]:
    """Layers at whose output the kept set shrinks: where p changes (the last layer excluded)."""
    before = [1.0] + fractions[:-1]
    return [i for i in range(len(fractions) - 1) if fractions[i] != before[i]]


def kept_count(fraction: float, block_size: int, last_decoded: int) -> int:
    """How many block tokens go on: max(int(p * |block|), min(last_decoded + 2, |block|))."""
    return max(int(fraction * block_size), min(last_decoded + 2, block_size))


def hidden_delta(hidden: Tensor, previous: Tensor) -> Tensor:
    """[B, T] mean |h - h_prev| / (RMS(h_prev) + 1e-6) of hidden states [B, T, d]."""
    h, prev = hidden.float(), previous.float()
    return (h - prev).abs().mean(-1) / (prev.pow(2).mean(-1).sqrt() + 1e-6)


def importance(conf: Tensor, delta: Tensor, candidate: Tensor, bonus: Tensor, alpha: Tensor) -> Tensor:
    """[B, T] importance of each candidate token (-inf elsewhere).

    conf, delta, bonus: [B, T]; candidate: [B, T] bool; alpha: [B] (skip_alpha per row)."""
    delta = delta.masked_fill(~candidate, 0.0)
    delta = delta / delta.amax(1, keepdim=True).clamp_min(1.0)  # the official max(row max, 1)
    a = alpha[:, None].to(conf.dtype)
    score = a * conf + (1 - a) * delta + bonus
    top2 = (rank_in_row(conf, candidate) < 2) & candidate & (a > 0)
    score = score + TOP_CONF_BONUS * top2
    return score.masked_fill(~candidate, -float("inf"))


def select_kept(score: Tensor, candidate: Tensor, live: Tensor, count: Tensor) -> Tensor:
    """bool [B, T]: the top ``count`` [B] candidates by score (ties: lower index) and every live
    token that is not a candidate (Dream's token before the block)."""
    top = (rank_in_row(score, candidate) < count[:, None]) & candidate
    return top | (live & ~candidate)


Window = tuple[Tensor, int]  # a sequence's hidden-state window: row ``int`` of a group's [B, W + 1, d] tensor


def group_windows(windows: list[Window | None], width: int, hidden_size: int, dtype: torch.dtype,
                  device: torch.device) -> Tensor:
    """[B, width + 1, d] (the last column a sink) holding each sequence's window (None: a new
    block's, zeros). When every window is a row of one tensor of this width (the group of the last
    step, unchanged or with rows gone), a copy of it or one gather of its rows, the new blocks'
    rows zeroed; else one gather per tensor the windows come from (sequences joined): a number
    of ops that does not grow with the batch."""
    sources: dict[int, tuple[Tensor, list[int], list[int]]] = {}  # tensor -> (itself, rows here, rows there)
    for b, w in enumerate(windows):
        if w is not None:
            _, here, there = sources.setdefault(id(w[0]), (w[0], [], []))
            here.append(b)
            there.append(w[1])
    fresh = [b for b, w in enumerate(windows) if w is None]
    shape = (len(windows), width + 1, hidden_size)
    if len(sources) == 1 and (src := next(iter(sources.values())))[0].shape[1:] == shape[1:]:
        if src[1] == src[2] and src[0].shape[0] == shape[0]:  # the last step's group, unchanged
            out = src[0].clone()
        else:  # rows left or moved: one gather (a new block's rows take row 0, zeroed below)
            there = np.zeros(len(windows), dtype=np.int64)
            there[src[1]] = src[2]
            out = src[0].index_select(0, to_device(there, device))
        if fresh:
            out[to_device(np.array(fresh), device)] = 0
        return out
    out = torch.zeros(shape, dtype=dtype, device=device)
    for tensor, here, there in sources.values():
        n = min(tensor.shape[1], width + 1)
        rows = to_device(np.array([here, there]), device)
        out[rows[0], :n] = tensor[rows[1], :n]
    return out


# -- per-sequence state ----------------------------------------------------------------------
@dataclass
class SkipState:
    """Host state (NumPy), but for the hidden-state windows, which stay on the device as rows of
    the group's window tensors (``group_windows``)."""
    conf: np.ndarray  # [L] float32: last confidence of each canvas position (0 once committed)
    last_committed: np.ndarray  # positions committed at the previous step
    skip: bool = False  # whether this step may skip (set by plan)
    window_lo: int = -1  # first canvas position of the hidden-state window
    hidden: dict[int, Window] = field(default_factory=dict)  # layer -> the block window's hidden states
    pending: dict[int, Window] = field(default_factory=dict)  # this forward's update of ``hidden``
    pending_conf: tuple[np.ndarray, np.ndarray] | None = None  # this forward's update of ``conf``: (positions, values)
    # record_steps only: per prune layer of this step, (layer, token positions, skipped there) views
    skipped: list[tuple[int, Tensor, Tensor]] = field(default_factory=list)


def state(seq: Sequence) -> SkipState:
    return seq.strategy_state[KEY]


# -- the layer hook --------------------------------------------------------------------------
class SkipHooks:
    """Scores and prunes block tokens at the prune layers; keeps the hidden-state caches.

    How many tokens each row keeps is known on the host (the kept counts, the candidates per
    row), so pruning reads nothing back from the device inside the layer loop."""

    def __init__(self, seqs: list[Sequence], rows: dict[str, Tensor], counts: dict[int, list[int]],
                 window: Tensor, previous: dict[int, Tensor], num_candidates: list[int],
                 record: bool = False) -> None:
        self.seqs = seqs
        self.record = record  # some sequence records its steps: keep views of what each layer skipped
        self.rows = rows  # candidate / conf / bonus [B, T] in plan order; alpha [B]
        self.counts = counts  # prune layer -> kept count per row
        self.window = window  # [B, 2]: first canvas position and width of each row's window
        self.previous = previous  # prune layer -> [B, W_max + 1, d] hidden states of the last
        # steps; the last column is a sink for the tokens a partial update leaves out
        self.num_candidates = num_candidates  # per row: live block tokens that may be skipped

    def pad_to(self, rows: int, width: int) -> None:
        """A fixed-shape step's [rows, width] (``Runner.forward_rows``): padding rows have no
        candidate, no window and keep nothing."""
        b = len(self.num_candidates)
        self.rows = {name: pad_to(x, rows, width, 0) if x.dim() == 2 else pad_to(x[:, None], rows, 1, 0)[:, 0]
                     for name, x in self.rows.items()}
        self.window = pad_to(self.window, rows, self.window.shape[1], 0)
        self.previous = {layer: pad_to(x, rows, x.shape[1], 0) for layer, x in self.previous.items()}
        self.counts = {layer: c + [0] * (rows - b) for layer, c in self.counts.items()}
        self.num_candidates = self.num_candidates + [0] * (rows - b)

    def rank_message(self) -> dict:
        """What another tensor-parallel rank needs to prune as this one does (plain data; it
        keeps no hidden states for sequences: ``from_rank_message`` gives it none)."""
        return {"rows": self.rows, "counts": self.counts, "window": self.window, "previous": self.previous,
                "num_candidates": self.num_candidates}

    @classmethod
    def from_rank_message(cls, message: dict) -> "SkipHooks":
        return cls([], message["rows"], message["counts"], message["window"], message["previous"],
                   message["num_candidates"])

    def after_qk(self, layer_idx: int, q: Tensor, k: Tensor, ctx: ForwardContext) -> None:
        return None

    def after_layer(self, layer_idx: int, hidden: Tensor, ctx: ForwardContext) -> Kept | None:
        if layer_idx not in self.counts:
            return None
        hidden = ctx.unpack(hidden)
        live = ctx.token_valid
        offset, in_window = self.window_offsets(ctx.slots)
        lengths = self.kept_lengths(layer_idx, ctx.live_counts())
        keep = live
        if any(self.num_candidates):
            candidate = self.rows["candidate"].gather(1, ctx.token_index) & live
            keep = self.choose(layer_idx, hidden, ctx, candidate, offset)
            if self.record:
                for b, seq in enumerate(self.seqs):
                    state(seq).skipped.append((layer_idx, ctx.positions[b], candidate[b] & ~keep[b]))
        self.store(layer_idx, hidden, offset, keep & in_window)
        return None if lengths is None else compact(keep, lengths, fixed=ctx.fixed_shapes)

    def kept_lengths(self, layer_idx: int, live: list[int]) -> list[int] | None:
        """Live tokens per row after pruning at ``layer_idx`` (the top ``count`` candidates go
        on), None when no row drops any; updates the candidates left."""
        left = [min(n, c) for n, c in zip(self.num_candidates, self.counts[layer_idx])]
        dropped = [n - k for n, k in zip(self.num_candidates, left)]
        self.num_candidates = left
        return [n - d for n, d in zip(live, dropped)] if any(dropped) else None

    def window_offsets(self, slots: Tensor) -> tuple[Tensor, Tensor]:
        offset = slots - self.window[:, :1]
        in_window = (offset >= 0) & (offset < self.window[:, 1:])
        return offset.clamp(0, self.width - 1), in_window

    @property
    def width(self) -> int:
        return next(iter(self.previous.values())).shape[1] - 1

    def choose(self, layer_idx: int, hidden: Tensor, ctx: ForwardContext, candidate: Tensor,
               offset: Tensor) -> Tensor:
        prev = ctx.gather(self.previous[layer_idx], offset)  # [B, T', d]
        conf = self.rows["conf"].gather(1, ctx.token_index)
        bonus = self.rows["bonus"].gather(1, ctx.token_index)
        score = importance(conf, hidden_delta(hidden, prev), candidate, bonus, self.rows["alpha"])
        count = torch.tensor(self.counts[layer_idx], device=hidden.device)
        return select_kept(score, candidate, ctx.token_valid, count)

    def store(self, layer_idx: int, hidden: Tensor, offset: Tensor, keep: Tensor) -> None:
        """Partial update: the survivors' hidden states replace the cached ones (the others go
        to the sink column). The sequences' own caches take it after the commit
        (``EarlySkip.after_commit``), so a replayed step sees the same hidden states."""
        cache = self.previous[layer_idx]
        index = torch.where(keep, offset, self.width)[..., None].expand(-1, -1, cache.shape[-1])
        cache.scatter_(1, index, hidden.to(cache.dtype))
        for b, seq in enumerate(self.seqs):
            state(seq).pending[layer_idx] = (cache, b)


# -- the strategy ----------------------------------------------------------------------------
class EarlySkip(Strategy):
    """ES-dLLM: skip low-importance block tokens at early layers (arXiv 2603.10088)."""
    name = KEY

    def __init__(self, model: DiffusionLM) -> None:
        super().__init__(model)
        self.shift = model.config.logit_shift
        self.num_layers = model.config.num_layers
        self.hidden_size = model.config.hidden_size
        self.dtype = next(model.parameters()).dtype

    def setup(self, seq: Sequence) -> None:
        seq.strategy_state[KEY] = SkipState(conf=np.zeros(seq.canvas_len, dtype=np.float32),
                                            last_committed=np.zeros(0, dtype=np.int64))

    # -- step planning -------------------------------------------------------------------------
    def plan(self, seq: Sequence, plan: StepPlan) -> StepPlan:
        return self.plan_rows([seq], [plan])[0]

    def plan_rows(self, seqs: list[Sequence], plans: list[StepPlan]) -> list[StepPlan]:
        """What each row computes this step (no side effect but ``skip``, rewritten at every
        plan): a refresh recomputes from ``refresh_start`` to the block end, the same logits; the
        refreshed rows' plans built on the host and sent in one copy."""
        out, spans = list(plans), []
        for i, (seq, plan) in enumerate(zip(seqs, plans)):
            p = seq.params
            count = seq.block_idx * p.block_length + seq.step  # the official step counter
            positions = plan.host_positions
            if (lo := self.refresh_start(seq, count)) is not None:
                end = seq.block[1]
                if plan.host_logits is None:
                    raise RuntimeError(f"{self.name}: a plan without host arrays (every plan is built on the host)")
                spans.append((i, span_row(seq, lo, end, plan.host_logits, self.shift)))
                positions = np.arange(lo, end)
            no_skip_step = p.block_refresh is not None and count % p.block_refresh == 0
            state(seq).skip = self.block_only(seq, positions) and not no_skip_step
        for (i, _), plan in zip(spans, sent_rows([row for _, row in spans], seqs[0].device)):
            out[i] = plan
        return out

    def refresh_start(self, seq: Sequence, count: int) -> int | None:
        """Where this step's recomputation starts when it refreshes (None: the decoder's plan):
        the official prompt refresh every ``prompt_refresh`` steps and, at a block's first step,
        ``skip_block_start`` "prefix" (from position 0) or "last-commits" (from the leftmost
        position committed at the previous step, whose K/V were computed while it was still
        masked; at most the block start, Dream's token before it)."""
        p = seq.params
        if count > 0 and p.prompt_refresh is not None and count % p.prompt_refresh == 0:
            return 0
        if count > 0 and seq.step == 0 and p.skip_block_start == "prefix":
            return 0
        if count > 0 and seq.step == 0 and p.skip_block_start == "last-commits":
            start, last = seq.block[0], state(seq).last_committed
            return min(int(last.min()) if last.size else start, start - self.shift)
        return None

    def block_only(self, seq: Sequence, positions: np.ndarray) -> bool:
        """Whether a step computing ``positions`` is a normal dual-cache step (the block, plus
        Dream's token before it)."""
        start, end = seq.block
        return bool(((positions >= start - self.shift) & (positions < end)).all())

    # -- the layer hook ------------------------------------------------------------------------
    def layer_hooks(self, seqs: list[Sequence], plans: list[StepPlan]) -> SkipHooks:
        fractions = [layer_fractions(self.num_layers, s.params.keep_fractions, s.params.skip_depths)
                     for s in seqs]
        layers = sorted({i for f in fractions for i in prune_layers(f)})
        record = any(seq.trace is not None for seq in seqs)
        for seq in seqs:
            self.ensure_window(seq)
            state(seq).pending, state(seq).pending_conf = {}, None  # this step's scratch
            if record:
                state(seq).skipped = []
        rows, num_candidates = self.row_values(seqs, plans)
        counts = {i: self.layer_counts(seqs, fractions, i) for i in layers}
        window = to_device(np.array([[state(s).window_lo, s.params.block_length + self.shift] for s in seqs]),
                           seqs[0].device)
        width = max(s.params.block_length for s in seqs) + self.shift
        previous = {i: group_windows([state(s).hidden.get(i) for s in seqs], width, self.hidden_size, self.dtype,
                                     seqs[0].device) for i in layers}
        return SkipHooks(seqs, rows, counts, window, previous, num_candidates, record)

    def ensure_window(self, seq: Sequence) -> None:
        """Hidden-state caches cover the current block (and Dream's token before it); a new
        block starts from zeros (none held: its first step skips nothing, which fills them)."""
        st = state(seq)
        lo = seq.block[0] - self.shift
        if st.window_lo != lo:
            st.window_lo, st.hidden = lo, {}

    def row_values(self, seqs: list[Sequence], plans: list[StepPlan]) -> tuple[dict[str, Tensor], list[int]]:
        """candidate / conf / bonus [B, T] of every planned token of the group (padding: False /
        0 / 0) and alpha [B], built on the host and sent in one copy; and the candidates per row."""
        width = max(len(p) for p in plans)
        values = np.zeros((3, len(seqs), width), dtype=np.float32)  # candidate, conf, bonus
        for i, (seq, plan) in enumerate(zip(seqs, plans)):
            st, pos = state(seq), plan.host_positions
            start, end = seq.block
            row = values[:, i, : len(pos)]
            row[0] = (pos >= start) & (pos < end) & st.skip
            target = pos + self.shift  # the position each token's output predicts
            has_conf = target < len(st.conf)
            row[1, has_conf] = st.conf[target[has_conf]]
            undecided = seq.undecided[start:end]
            if undecided.any():  # the first masked position
                row[2] += LEFTMOST_BONUS * (target == start + int(undecided.argmax()))
            if seq.params.skip_alpha < 1:
                row[2] += COMMITTED_BONUS * np.isin(pos, st.last_committed)
        alpha = np.array([s.params.skip_alpha for s in seqs], dtype=np.float32)
        sent = to_device(np.concatenate([values.reshape(-1), alpha]), seqs[0].device)
        candidate, conf, bonus = sent[:-len(seqs)].view(3, len(seqs), width).unbind(0)
        rows = {"candidate": candidate.bool(), "conf": conf, "bonus": bonus, "alpha": sent[-len(seqs):]}
        return rows, values[0].sum(1).astype(np.int64).tolist()

    def layer_counts(self, seqs: list[Sequence], fractions: list[list[float]], layer: int) -> list[int]:
        counts = []
        for seq, frac in zip(seqs, fractions):
            block = seq.block[1] - seq.block[0]
            last = len(state(seq).last_committed)
            counts.append(kept_count(frac[layer], block, last))
        return counts

    # -- after the forward ---------------------------------------------------------------------
    def after_forward(self, seq: Sequence, positions: Tensor, logits: Tensor) -> tuple[Tensor, Tensor]:
        return self.after_forward_rows([seq], [(positions, logits)])[0]

    def after_forward_rows(self, seqs: list[Sequence], outputs: list[tuple[Tensor, Tensor]]
                           ) -> list[tuple[Tensor, Tensor]]:
        """Each predicted position's confidence (softmax probability of the argmax, the mask id
        excluded, as the commit rule sees it; 0 for a delayed EOS), recorded for the next step's
        scores at the sequence's turn (``after_commit``), over the whole group's logits at once
        (row-wise ops: each sequence gets what it would get alone) and read in one read."""
        live = [(seq, pos, lg) for seq, (pos, lg) in zip(seqs, outputs) if pos.numel()]
        if not live:
            return outputs
        if len({seq.ids.mask_id for seq, _, _ in live}) > 1:  # one masked column per pass
            return [self.after_forward_rows([seq], [out])[0] for seq, out in zip(seqs, outputs)]
        group, positions, logits = zip(*live)
        counts = [pos.numel() for pos in positions]
        positions = torch.cat(positions)
        # [sum N, V], a new tensor: the mask is excluded in place
        scores, tokens = greedy_tokens(torch.cat(logits).float(), group[0].ids.mask_id, owned=True)
        top = scores.gather(1, tokens[:, None])[:, 0]
        conf = (top - torch.logsumexp(scores, -1)).exp()
        conf = conf.masked_fill(delayed_eos_flat(list(group), counts, positions, tokens), 0.0)
        read = host(torch.stack([positions.double(), conf.double()]))  # the one read
        for seq, pos, c in zip(group, *(np.split(r, np.cumsum(counts)[:-1]) for r in read)):
            state(seq).pending_conf = (pos.astype(np.int64), c.astype(np.float32))
        return outputs

    def confidence(self, seq: Sequence, positions: Tensor, tokens: Tensor, conf: Tensor) -> Tensor:
        return self.confidence_rows([seq], [positions.numel()], positions, tokens, conf)

    def confidence_rows(self, seqs: list[Sequence], counts: list[int], positions: Tensor, tokens: Tensor,
                        conf: Tensor) -> Tensor:
        return conf.masked_fill(delayed_eos_flat(seqs, counts, positions, tokens), 0.0)

    def after_commit(self, seq: Sequence, committed: np.ndarray) -> None:
        """The step's confidences and hidden states become the next step's; committed
        positions have nothing left to decode (confidence 0). Host arrays, but for the
        hidden-state windows, which become this step's group tensors (no copy)."""
        st = state(seq)
        if st.pending_conf is not None:
            positions, values = st.pending_conf
            st.conf[positions] = values
            st.pending_conf = None
        st.conf[committed] = 0.0
        st.last_committed = committed
        st.hidden.update(st.pending)
        st.pending = {}

    def step_record(self, seq: Sequence) -> dict:
        """``skipped``: [position, layer] of each block token dropped this step, after that layer."""
        skipped = [[pos, layer] for layer, positions, dropped in state(seq).skipped
                   for pos in positions[dropped].tolist()]
        return {"skipped": sorted(skipped)} if skipped else {}


def delayed_eos_flat(seqs: list[Sequence], counts: list[int], positions: Tensor, tokens: Tensor) -> Tensor:
    """bool [K]: ES-dLLM's ``delay_eos_generation`` for the candidates of a group laid out row
    after row (``counts`` per sequence; ``tokens`` predicted at canvas ``positions``): an EOS
    predicted while its left neighbour in the current block is still masked and no EOS has been
    committed yet. Which positions would delay an EOS is known on the host: one copy, no read."""
    width = max(s.canvas_len for s in seqs) + 1
    late_at = np.zeros((len(seqs), width), dtype=np.int64)  # position q delays an EOS
    for i, seq in enumerate(seqs):
        start, end = seq.block
        if seq.params.delay_eos and not (seq.canvas[seq.prompt_len:] == seq.ids.eos_id).any():
            late_at[i, start + 1: end + 1] = seq.undecided[start:end]  # left neighbour q - 1 masked
    eos = np.array([s.ids.eos_id for s in seqs])
    owner = np.repeat(np.arange(len(seqs)), counts)
    sent = to_device(np.concatenate([late_at.reshape(-1), eos, owner]), positions.device)
    late_at, eos, owner = sent.split([late_at.size, len(eos), len(owner)])
    return (tokens == eos[owner]) & late_at.view(len(seqs), width)[owner, positions].bool()



def delayed_eos(seq: Sequence, positions: Tensor, tokens: Tensor) -> Tensor:
    """``delayed_eos_flat`` of one sequence."""
    return delayed_eos_flat([seq], [positions.numel()], positions, tokens)
