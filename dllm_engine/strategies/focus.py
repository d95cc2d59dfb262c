"""FOCUS token eviction: "FOCUS: DLLMs Know How to Tame Their Compute Bound" (ICML 2026,
arXiv 2601.23278).

Only ~10% of a block's tokens are committed per step, yet every step computes the whole block.
FOCUS predicts, after layer 1, which masked tokens can be decoded this step and evicts the rest:
layers 2.. (and layer 1's attention/MLP) run on the kept tokens only.

- Predictor: the importance of a masked token j is how much attention the block's masked queries
  give it, I_j = sum_{i,h} softmax_j(maxpool_j(q_i k_j / sqrt(d))) over the masked set only.
  Layer 0 carries a position prior shared by all tokens; the delta I(layer 1) - I(layer 0)
  keeps what layer 1 adds, and high-delta tokens are the decodable ones.
- Budget: K = clamp(ceil(alpha * max(avg_decoded, 1)), 1, |M|), the running mean of tokens
  committed per step in this block; eviction only when |M| > K. If at least K tokens have
  delta >= mean + std, all of those are kept instead of the top-K.
- Structure rules: keep each kept token's left neighbour (AR context); keep everything if nothing
  is kept; re-keep evicted tokens left of the rightmost kept one that were never processed in
  this block (they need K/V: placeholder integrity).
- Delayed, neighbour-aware in-block cache: a committed position stops being recomputed (its K/V
  freeze) once it and its right neighbour were both committed before the step; the first step of
  a block computes every position.

Layer 1's K/V are written for the whole processing set before eviction (attention writes before
calling ``after_qk``). Block positions never processed through all layers hold no valid K/V above
layer 1, so from layer 1's attention on they are hidden from the kept queries; every other evicted
position is attended to through its cached K/V. The reference implementation
(LMDeploy fork) instead ends every query's key range at the rightmost processed (delayed cache) or
kept (after eviction) block position, hiding cached positions to its right as well; on tiny-sdar's
held-out split that variant scored no better, so the rule above stays.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from ..decoding.plan import StepPlan
from ..decoding.rules import greedy_predictions, rank_in_row
from ..engine.sequence import Sequence, host, to_device
from ..engine.shapes import pad_to
from ..models.context import ForwardContext, Kept, compact
from .base import Strategy

STATE_KEY = "focus"


# -- selection math (pure functions, batched over rows; padding marked by ``valid``) ----------
def masked_importance(q: Tensor, k: Tensor, valid: Tensor) -> Tensor:
    """Attention importance I [B, M] of each masked token as a key.

    q [B, H, M, D], k [B, Hkv, M, D]: the masked tokens' queries / keys after q/k-norm and RoPE,
    padded to M per row; valid [B, M] marks real tokens. Per head S = q kᵀ / sqrt(D) (GQA: K heads
    repeated), max-pooled along keys (kernel 3, stride 1, -inf padding), softmax over keys,
    summed over queries and heads."""
    b, h, m, d = q.shape
    if m == 0:
        return q.new_zeros(b, 0, dtype=torch.float32)
    k = k.repeat_interleave(h // k.shape[1], dim=1)
    scores = q.float() @ k.float().transpose(-1, -2) / math.sqrt(d)  # [B, H, M, M]
    key_ok = valid[:, None, None, :]
    scores = scores.masked_fill(~key_ok, float("-inf"))
    pooled = F.max_pool1d(scores.reshape(-1, 1, m), 3, stride=1, padding=1).view(b, h, m, m)
    pooled = pooled.masked_fill(~key_ok, float("-inf"))
    probs = torch.softmax(pooled, dim=-1)
    probs = torch.where(valid[:, None, :, None] & key_ok, probs, torch.zeros_like(probs))
    return probs.sum(dim=(1, 2))  # [B, M]: over heads and queries


def eviction_budget(avg_decoded: np.ndarray, num_masked: np.ndarray, alpha: float | np.ndarray) -> np.ndarray:
    """K [B] = clamp(ceil(alpha * max(avg_decoded, 1)), 1, |M|) (0 when nothing is masked), on
    the host."""
    want = np.maximum(np.ceil(alpha * np.maximum(np.asarray(avg_decoded, dtype=np.float64), 1.0)), 1)
    return np.minimum(want.astype(np.int64), np.asarray(num_masked, dtype=np.int64))


def select_candidates(delta: Tensor, valid: Tensor, budget: Tensor) -> Tensor:
    """bool [B, M]: the top-``budget`` tokens by ``delta`` (ties to the lower index), or, when at
    least ``budget`` tokens have delta >= mean + std over the row, all of those (N_sigma term)."""
    top = (rank_in_row(delta, valid) < budget[:, None]) & valid
    count = valid.sum(1).clamp(min=1)
    mean = delta.masked_fill(~valid, 0).sum(1) / count
    var = ((delta - mean[:, None]).masked_fill(~valid, 0) ** 2).sum(1) / count  # population std
    strong = (delta >= (mean + var.sqrt())[:, None]) & valid
    use_strong = strong.sum(1) >= budget
    return torch.where(use_strong[:, None], strong, top)


def keep_left_neighbours(kept: Tensor, positions: Tensor, valid: Tensor) -> Tensor:
    """Also keep the masked token right before every kept one (one pass, not transitive).
    ``positions`` [B, M] are canvas positions in ascending order per row."""
    adjacent = (positions[:, 1:] - positions[:, :-1] == 1) & valid[:, 1:] & valid[:, :-1]
    out = kept.clone()
    out[:, :-1] |= adjacent & kept[:, 1:]
    return out


def keep_all_if_empty(kept: Tensor, valid: Tensor) -> Tensor:
    """A row that kept nothing keeps all its tokens."""
    empty = ~(kept & valid).any(1, keepdim=True)
    return torch.where(empty, valid, kept & valid)


def keep_placeholders(kept: Tensor, positions: Tensor, valid: Tensor, never_processed: Tensor) -> Tensor:
    """Re-keep evicted tokens left of the rightmost kept one that were never processed in this
    block: later steps attend to them, so they need K/V from every layer."""
    rightmost = positions.masked_fill(~(kept & valid), -1).max(1, keepdim=True).values
    return kept | (valid & never_processed & (positions < rightmost))


def apply_structure_rules(kept: Tensor, positions: Tensor, valid: Tensor, never_processed: Tensor) -> Tensor:
    kept = keep_left_neighbours(kept, positions, valid)
    kept = keep_all_if_empty(kept, valid)
    return keep_placeholders(kept, positions, valid, never_processed) & valid


def select_kept(delta: Tensor, positions: Tensor, valid: Tensor, never_processed: Tensor,
                budget: Tensor) -> Tensor:
    """bool [B, M]: the masked tokens that stay after layer 1 (rows with |M| <= K keep all)."""
    evict = valid.sum(1) > budget
    kept = torch.where(evict[:, None], select_candidates(delta, valid, budget), valid)
    return apply_structure_rules(kept, positions, valid, never_processed)


def delayed_cache_ready(is_committed: np.ndarray) -> np.ndarray:
    """bool [L] over a block: committed positions whose right neighbour is committed too (the
    block's last position counts its right neighbour as committed); their K/V may freeze."""
    right = np.ones_like(is_committed)
    right[..., :-1] = is_committed[..., 1:]
    return is_committed & right


# -- per-sequence state, on the host ----------------------------------------------------------
@dataclass
class FocusState:
    """Per sequence, reset at each new block (``seq.strategy_state["focus"]``): host arrays over
    the block's positions, and this step's scratch (``computed`` resets it, ``layer_hooks`` and
    the layer-1 hook fill it, ``after_commit`` applies it)."""
    block_idx: int
    start: int
    processed: np.ndarray  # [L] bool: computed through every layer at some step of this block
    frozen: np.ndarray  # [L] bool: K/V final, no longer recomputed (delayed cache)
    committed: int = 0  # tokens committed in this block ...
    steps: int = 0  # ... over this many steps that committed something
    planned: np.ndarray | None = None  # this step's computed canvas positions
    in_block: np.ndarray | None = None  # [T] of them, in the block
    ready: np.ndarray | None = None  # [L] K/V final once this step has run (``delayed_cache_ready``)
    evicted: np.ndarray | None = None  # [T] stopped after layer 1 (None: the step evicted nothing)
    would_keep: tuple[Tensor, Tensor] | None = None  # probe: (masked positions, bool kept)
    probed: tuple[Tensor, Tensor, float] | None = None  # probe: (confidences, kept, threshold) to count

    @property
    def avg_decoded(self) -> float:
        return self.committed / self.steps if self.steps else 1.0

    def clear_step(self) -> None:
        self.planned = self.in_block = self.ready = self.evicted = self.would_keep = self.probed = None

    def kept_positions(self) -> np.ndarray | None:
        """Canvas positions that survived this step's eviction (None: nothing was evicted)."""
        return None if self.evicted is None else self.planned[~self.evicted]


def block_state(seq: Sequence) -> FocusState:
    """The sequence's state for its current block (fresh on the block's first step)."""
    state = seq.strategy_state.get(STATE_KEY)
    if state is None or state.block_idx != seq.block_idx:
        start, end = seq.block
        state = FocusState(seq.block_idx, start, np.zeros(end - start, dtype=bool), np.zeros(end - start, dtype=bool))
        seq.strategy_state[STATE_KEY] = state
    return state


def in_block(positions: np.ndarray, start: int, flags: np.ndarray) -> np.ndarray:
    """bool [T]: the block map ``flags`` [L] (block start ``start``) at canvas ``positions`` [T];
    False outside the block."""
    local = positions - start
    inside = (local >= 0) & (local < len(flags))
    out = np.zeros(len(positions), dtype=bool)
    out[inside] = flags[local[inside]]
    return out


def block_step(positions: np.ndarray, start: int, undecided: np.ndarray, processed: np.ndarray
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """One sequence's step in its block, on the host: of the computed canvas ``positions`` [T],
    (in the block, candidates = undecided block positions FOCUS may evict, candidates never
    processed through every layer in this block), and the block positions [L] whose K/V are
    final after the step (``undecided`` [L]: the block's canvas before the step)."""
    candidate = in_block(positions, start, undecided)
    # positions committed before this step are computed with their real token, so their K/V
    # are final once the neighbour's are too
    return (in_block(positions, start, np.ones_like(undecided)), candidate,
            candidate & ~in_block(positions, start, processed), delayed_cache_ready(~undecided))


def padded(rows: list[np.ndarray], width: int, fill: int = 0) -> np.ndarray:
    """Host rows as one [B, width] int64 array, padded with ``fill``."""
    out = np.full((len(rows), width), fill, dtype=np.int64)
    for i, row in enumerate(rows):
        out[i, : len(row)] = row
    return out


# -- the hooks inside the layer stack ---------------------------------------------------------
class EvictionHooks:
    """Layer 0: importance of the masked tokens. Layer 1: delta, selection, eviction.

    Everything a layer needs (the candidates, the masked tokens' columns, positions and
    history, the budgets) is built on the host before the layer loop and sent in one copy;
    layer 1 reads the device once: which tokens it evicted (that sizes the kept set, and the
    sequences' bookkeeping is done on the host from it)."""

    def __init__(self, candidate: Tensor, never: Tensor, index: Tensor, valid: Tensor, positions: Tensor,
                 never_masked: Tensor, budget: Tensor, any_never: bool, states: list[FocusState],
                 evicting: np.ndarray | None = None) -> None:
        self.candidate, self.never = candidate, never  # [B, T]: over the step's tokens
        self.index, self.valid = index, valid  # [B, M]: the masked tokens' columns, row padding
        self.positions, self.never_masked = positions, never_masked  # [B, M]: canvas positions, history
        self.budget = budget  # [B]
        self.any_never = any_never  # some candidate was never processed in its block (host)
        self.states = states
        self.evicting = evicting  # per row: more masked tokens than its budget (host; the probe's)
        self.base: Tensor | None = None  # layer-0 importance [B, M]
        self.dry_run = False  # select but evict nothing (``PredictorProbe``)

    @classmethod
    def build(cls, states: list[FocusState], candidate: list[np.ndarray], never: list[np.ndarray],
              budget: np.ndarray, evicting: np.ndarray, device: torch.device) -> "EvictionHooks":
        """The hooks of one step from each row's host facts (``block_step``; ``evicting``: the
        rows with more candidates than their ``budget``), in one copy."""
        width = max(len(c) for c in candidate)
        masked = [np.flatnonzero(c) for c in candidate]
        m = max(len(i) for i in masked)
        grid = [padded(candidate, width), padded(never, width), padded(masked, m),
                padded([np.ones(len(i)) for i in masked], m),
                padded([st.planned[i] for st, i in zip(states, masked)], m),
                padded([n[i] for n, i in zip(never, masked)], m)]
        b = len(states)
        sent = to_device(np.concatenate([g.reshape(-1) for g in grid] + [budget.astype(np.int64)]), device)
        rows, masked_rows, budget_row = sent[: 2 * b * width], sent[2 * b * width: -b], sent[-b:]
        cand, nev = rows.view(2, b, width).bool().unbind(0)
        index, valid, positions, never_m = masked_rows.view(4, b, m).unbind(0)
        return cls(cand, nev, index, valid.bool(), positions, never_m.bool(), budget_row,
                   bool(any(n.any() for n in never)), states, evicting)

    @staticmethod
    def importance(q: Tensor, k: Tensor, index: Tensor, valid: Tensor) -> Tensor:
        qi = index[:, None, :, None]
        q_m = torch.gather(q, 2, qi.expand(-1, q.shape[1], -1, q.shape[3]))  # [B, H, M, D]
        k_m = torch.gather(k, 2, qi.expand(-1, k.shape[1], -1, k.shape[3]))  # [B, Hkv, M, D]
        return masked_importance(q_m, k_m, valid)

    def pad_to(self, rows: int, width: int) -> None:
        """A fixed-shape step's [rows, width] (``Runner.forward_rows``): padding rows and tokens
        are no candidates, their masked tokens not valid, their budget 0."""
        b, t = self.candidate.shape
        self.candidate, self.never = (pad_to(x, rows, width, False) for x in (self.candidate, self.never))
        m = self.index.shape[1]
        self.index, self.valid, self.positions, self.never_masked = (
            pad_to(x, rows, m, 0) for x in (self.index, self.valid, self.positions, self.never_masked))
        self.budget = pad_to(self.budget[:, None], rows, 1, 0)[:, 0]
        if self.evicting is not None:
            self.evicting = np.concatenate([self.evicting, np.zeros(rows - b, dtype=bool)])

    def rank_message(self) -> dict:
        """What another tensor-parallel rank needs to decide as this one does (plain data; it
        records nothing on sequences: ``from_rank_message`` gives it no states)."""
        names = ("candidate", "never", "index", "valid", "positions", "never_masked", "budget", "any_never",
                 "dry_run")
        return {name: getattr(self, name) for name in names}

    @classmethod
    def from_rank_message(cls, message: dict) -> "EvictionHooks":
        fields = dict(message)
        dry_run = fields.pop("dry_run")
        hooks = cls(**fields, states=[])
        hooks.dry_run = dry_run
        return hooks

    def after_qk(self, layer_idx: int, q: Tensor, k: Tensor, ctx: ForwardContext) -> Kept | None:
        # layers 0 and 1 see the step's own token set: nothing shrinks it before layer 1
        if layer_idx > 1:
            return None
        scores = ctx.all_reduce(self.importance(q, k, self.index, self.valid))  # this rank's heads -> all
        if layer_idx == 0:
            self.base = scores
            return None
        kept_m = select_kept(scores - self.base, self.positions, self.valid, self.never_masked, self.budget)
        if self.dry_run:
            self.record_probe(kept_m)
            return None
        cand = self.candidate
        b, t = cand.shape  # a padding entry of the masked tokens writes to the sink column t
        kept = cand.new_zeros(b, t + 1).scatter_(1, self.index.masked_fill(~self.valid, t), kept_m)
        evicted = cand & ~kept[:, :t]
        evicted_host = host(evicted)  # the step's read inside the layer loop
        hidden = self.unprocessed_keys(ctx, evicted & self.never) if self.any_never else None
        for state, row in zip(self.states, evicted_host):
            state.evicted = row[: len(state.planned)]
        lengths = [n - int(row.sum()) for n, row in zip(ctx.row_lengths, evicted_host)]
        host_keep = [~row[:n] for n, row in zip(ctx.row_lengths, evicted_host)]
        return compact(ctx.token_valid & ~evicted, lengths, hidden_keys=hidden, host_keep=host_keep,
                       fixed=ctx.fixed_shapes)

    def after_layer(self, layer_idx: int, hidden: Tensor, ctx: ForwardContext) -> None:
        return None

    @staticmethod
    def unprocessed_keys(ctx: ForwardContext, hidden: Tensor) -> Tensor:
        """[B, S] the cache slots of the tokens ``hidden`` [B, T] marks: evicted tokens never
        processed in their block have no K/V above layer 1, so no query may see them."""
        num_keys = ctx.num_keys()
        slots = torch.where(hidden, ctx.slots, torch.full_like(ctx.slots, num_keys))
        invisible = torch.zeros(slots.shape[0], num_keys + 1, dtype=torch.bool, device=slots.device)
        invisible.scatter_(1, slots, hidden)  # [B, S + 1]; the last column collects the rest
        return invisible[:, :num_keys]

    def record_probe(self, kept: Tensor) -> None:
        for i, state in enumerate(self.states):  # the rows that would evict (views)
            if self.evicting[i]:
                valid = self.valid[i]
                state.would_keep = (self.positions[i][valid], kept[i][valid])


# -- the strategy -----------------------------------------------------------------------------
class TokenEviction(Strategy):
    """FOCUS (arXiv 2601.23278): delayed neighbour-aware in-block cache + layer-1 token eviction.

    Option: ``SamplingParams.focus_alpha`` (>= 1, default 1.5) scales the eviction budget.

    Its bookkeeping is host state (``FocusState``): what a step computes, which tokens it may
    evict and what it computed are NumPy arrays, so the per-sequence work of a step costs no
    tensor op; the device gets one copy before the layer loop and is read once at layer 1."""
    name = "focus"
    evict = True

    def computed(self, seq: Sequence, positions: np.ndarray) -> np.ndarray | None:
        """Drop frozen block positions."""
        state = block_state(seq)
        state.clear_step()
        return ~in_block(positions, state.start, state.frozen)

    def layer_hooks(self, seqs: list[Sequence], plans: list[StepPlan]) -> EvictionHooks | None:
        """Each sequence's step in its block (``block_step``, on the host) and, when some row
        has more masked tokens than its budget, the eviction hooks. No host read."""
        states = [block_state(s) for s in seqs]
        candidate, never = [], []
        for seq, state, plan in zip(seqs, states, plans):
            if plan.host_positions is None:
                raise RuntimeError(f"{self.name}: a plan without host positions (planned row by row on the device)")
            state.planned = plan.host_positions
            start, end = seq.block
            state.in_block, cand, nev, state.ready = block_step(state.planned, start, seq.undecided[start:end],
                                                                state.processed)
            candidate.append(cand)
            never.append(nev)
        if not self.evict or self.model.config.num_layers < 2:
            return None
        num_masked = np.array([c.sum() for c in candidate])
        budget = eviction_budget(np.array([st.avg_decoded for st in states]), num_masked,
                                 np.array([s.params.focus_alpha for s in seqs]))
        evicting = num_masked > budget
        if not evicting.any():
            return None
        return EvictionHooks.build(states, candidate, never, budget, evicting, seqs[0].device)

    def after_forward(self, seq: Sequence, positions: Tensor, logits: Tensor
                      ) -> tuple[Tensor, Tensor]:
        return self.after_forward_rows([seq], [(positions, logits)])[0]

    def after_forward_rows(self, seqs: list[Sequence], outputs: list[tuple[Tensor, Tensor]]
                           ) -> list[tuple[Tensor, Tensor]]:
        """Let only kept tokens commit. The runner returns logits of the tokens live at the last
        layer only; Dream reads position p's at p - 1, which may have stayed while p was
        evicted: such rows are dropped for the whole group at once (one read: which stay)."""
        if not self.model.config.logit_shift:
            return outputs
        rows = [i for i, s in enumerate(seqs) if block_state(s).evicted is not None and outputs[i][0].numel()]
        if not rows:
            return outputs
        width = max(seqs[i].canvas_len for i in rows)
        kept = np.zeros((len(rows), width), dtype=np.int64)  # kept[r, p]: position p stayed in row r
        for r, i in enumerate(rows):
            kept[r, block_state(seqs[i]).kept_positions()] = 1
        counts = [outputs[i][0].numel() for i in rows]
        owner = np.repeat(np.arange(len(rows)), counts)
        positions = torch.cat([outputs[i][0] for i in rows])
        sent = to_device(np.concatenate([kept.reshape(-1), owner]), positions.device)
        ok = host(sent[: kept.size].view(len(rows), width)[sent[kept.size:], positions].bool())  # the read
        index = to_device(np.flatnonzero(ok), positions.device)
        sizes = [int(part.sum()) for part in np.split(ok, np.cumsum(counts)[:-1])]
        logits = torch.cat([outputs[i][1] for i in rows])[index].split(sizes)
        out = list(outputs)
        for i, pos, lg in zip(rows, positions[index].split(sizes), logits):
            out[i] = (pos, lg)
        return out

    def after_commit(self, seq: Sequence, committed: np.ndarray) -> None:
        """Mark what the step computed through every layer, freeze stable K/V, and count the
        commits (the eviction budget's running mean): host arrays only."""
        state = block_state(seq)
        if state.planned is not None:
            done = state.in_block if state.evicted is None else state.in_block & ~state.evicted
            state.processed[state.planned[done] - state.start] = True
            state.frozen |= state.ready
        if len(committed):
            state.committed += len(committed)
            state.steps += 1

    def step_record(self, seq: Sequence) -> dict:
        """``evicted``: the masked block positions that stopped after layer 1 this step."""
        state = block_state(seq)
        if state.evicted is None or not state.evicted.any():
            return {}
        return {"evicted": sorted(state.planned[state.evicted].tolist())}


class DelayedCache(TokenEviction):
    """FOCUS's delayed, neighbour-aware in-block cache without eviction (the paper's "DC+"
    ablation, arXiv 2601.23278 §4): frozen K/V only, every remaining token runs every layer."""
    name = "delayed-cache"
    evict = False


# -- diagnostic: does the predictor find the decodable tokens of this checkpoint? -----------
@dataclass
class PredictorCounts:
    """FOCUS's selection at the steps where it would evict, scored against the confidences of
    the full model (every token through every layer) at the same step."""
    steps: int = 0
    masked: int = 0
    kept: int = 0  # masked tokens the selection keeps (structure rules included)
    top_kept: int = 0  # steps where it keeps the most confident masked token ...
    top_by_chance: float = 0.0  # ... and the expected count for a random pick of the same size
    confident: int = 0  # masked tokens whose confidence reaches the threshold ...
    confident_kept: int = 0  # ... of which the selection keeps

    def __add__(self, other: "PredictorCounts") -> "PredictorCounts":
        return PredictorCounts(*(a + b for a, b in zip(dataclasses.astuple(self), dataclasses.astuple(other))))

    def add(self, conf: Tensor, kept: Tensor, threshold: float) -> None:
        """conf [M]: the full model's confidence in each masked token; kept [M] bool."""
        self.steps += 1
        self.masked += conf.numel()
        self.kept += int(kept.sum())
        self.top_kept += int(kept[conf.argmax()])
        self.top_by_chance += float(kept.float().mean())
        sure = conf >= threshold
        self.confident += int(sure.sum())
        self.confident_kept += int((sure & kept).sum())

    def summary(self) -> dict:
        def share(a: float, b: float) -> float:
            return round(a / b, 4) if b else 0.0
        return {"probed_steps": self.steps, "kept_share": share(self.kept, self.masked),
                "top_kept": share(self.top_kept, self.steps),
                "top_kept_by_chance": share(self.top_by_chance, self.steps),
                "confident_kept": share(self.confident_kept, self.confident)}


class PredictorProbe(TokenEviction):
    """Diagnostic, not an acceleration (``block+focus-probe``, ``dual-cache+focus-probe``): FOCUS's
    selection is made at every step but nothing is evicted, so the full model's confidences
    show whether the kept tokens were the decodable ones. FOCUS rests on that premise; where
    ``top_kept`` is no better than ``top_kept_by_chance`` the checkpoint does not meet it and
    eviction will hold back the tokens it could commit. Tokens are those of the delayed cache
    alone; confidence is the top softmax probability (the mask token excluded), compared with
    the method's threshold (0.9 when it has none)."""
    name = "focus-probe"

    def setup(self, seq: Sequence) -> None:
        seq.strategy_state[self.name] = PredictorCounts()

    def layer_hooks(self, seqs: list[Sequence], plans: list[StepPlan]) -> EvictionHooks | None:
        hooks = super().layer_hooks(seqs, plans)
        if hooks is not None:
            hooks.dry_run = True
        return hooks

    def after_forward_rows(self, seqs: list[Sequence], outputs: list[tuple[Tensor, Tensor]]
                           ) -> list[tuple[Tensor, Tensor]]:
        """The full model's confidences in the masked tokens the selection scored, row by row (a
        diagnostic), kept for the sequence's turn."""
        outputs = super().after_forward_rows(seqs, outputs)
        for seq, (positions, logits) in zip(seqs, outputs):
            if (would := block_state(seq).would_keep) is not None:
                masked, kept = would
                row = {p: i for i, p in enumerate(positions.tolist())}
                _, conf = greedy_predictions(logits[[row[p] for p in masked.tolist()]], seq.ids.mask_id)
                threshold = seq.params.threshold if seq.params.threshold is not None else 0.9
                block_state(seq).probed = (conf, kept, threshold)  # counted at the sequence's turn
        return outputs

    def after_commit(self, seq: Sequence, committed: np.ndarray) -> None:
        state = block_state(seq)
        if state.probed is not None:
            seq.strategy_state[self.name].add(*state.probed)
        super().after_commit(seq, committed)

    def diagnostics(self, seq: Sequence) -> dict:
        return {self.name: seq.strategy_state[self.name]}
