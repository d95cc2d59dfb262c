"""Jump-share speculative decoding of ODB-dLLM (Wei et al., "Orchestrating Dual-Boundaries: An
Arithmetic Intensity Inspired Acceleration Framework for Diffusion Language Models",
arXiv 2511.21759).

With a Fast-dLLM cache, a step after a block's first one is memory-bound: it reads the whole cache
to compute a few dozen block tokens. Jump-share spends the idle arithmetic on candidate copies of
the block, all in ONE forward:

- copy 0 is the block as it is (the base decoder's step, unchanged);
- the other copies have some of the previous step's most confident, not yet committed predictions
  ("drafts") filled in. With k drafts d1..dk (most confident first) the copies are the singletons
  {dj} and the prefixes {d1..dj}: k = 1 -> {d1}; k = 2 -> {d1}, {d2}, {d1, d2}; k = 4 adds {d3},
  {d1, d2, d3}, {d4}, {d1..d4} (2k copies in all, the reference's layout).
- Each copy sits in cache slots past the canvas and sees the cache, the block positions it does
  not recompute (as copy 0 computes them) and its own slots, never another copy
  (``copy_key_mask``). What a copy recomputes (``jump_share_layout``):
  ``official`` (default, the official code's): with at most 4 copies every copy holds the whole
  block, so each computes the committed positions in its own context; with 8 copies only the
  masked positions are copied and the committed ones are shared, computed once in copy 0's
  context (the paper's "share"). ``shared``: the masked positions only, in every layout (fewer
  query tokens; tokens may differ where a committed position's K/V depend on the drafts).

Acceptance ("jump"), as the official code decides it: copy 0 is accepted; a copy holding draft
d_j alone is accepted when copy 0 commits d_j's position with the drafted token; {d1, d2} when
both are, or one is and the copy holding it commits the other. With four drafts the official
code adds its own conditions (``accepted_copy``), among them that accepted sets combine ({d1, d2}
and {d3} give {d1, d2, d3}). The accepted copy with the most drafts wins (ties: the earlier
copy); its drafts and its own commits are applied, so one forward can advance two steps, and its
remaining predictions become the next step's drafts.

Copy count: ``max_copies`` (1, 2, 4, 8). A block's speculative steps start with at most 4
copies; with ``max_copies = 8`` a block moves to 8 copies once the 4-copy layout is small enough,
and stays there. ``jump_share_switch``: ``official`` (default) decides after each 4-copy step t
from the masks step t computed (before its commits): block + 3·n_t <= 92, 89 or 86 (block 32;
the same fractions of other block lengths) when the accepted copy held 2, 1 or 0 drafts, and
never after the block's first speculative step. ``current`` decides before each step from the
masks left now: block + 3·n <= 2.8·block. As in the official code, the
drafts may cover every masked position (a copy holding them all predicts nothing itself and is
accepted on the others' confirmation). With ``max_copies = 1`` the step is the base decoder's
step (same tokens).

Batched: a forward group's layouts, copies and key masks are planned on the host and sent in one
copy (``plan_rows``); every copy of every row is predicted and selected in one pass (the copies
are rows of one ``GroupRules``, each keyed by its index as the salt), and one read per step
brings back the copies' predictions together with the base rows' commits (``decide_rows``). The
acceptance rule then runs in plain Python over at most 8 copies and 4 drafts per row; drafts,
layouts and the copy count are host state.

Restrictions (refused when the method is parsed): models without a logit shift (LLaDA), since a
shifted model (Dream) reads position p's prediction at p - 1, which may be a shared token; no
strategy that drops tokens inside the forward (every copy must reach the last layer). On a
block's first step (the full forward) the base decoder runs unchanged and its argmax predictions
are kept as drafts.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Callable, ClassVar

import numpy as np
import torch
from torch import Tensor

from ..decoding.commit_rules import GroupCommit, RowDecision, gathered
from ..decoding.decide import GroupRules
from ..decoding.plan import StepPlan
from ..decoding.rules import greedy_predictions
from ..engine.sequence import Sequence, to_device
from .base import Strategy

KEY = "jump-share"
SHARE_BUDGET = 2.8  # jump_share_switch="current": 8 copies once block + 3·n_mask <= SHARE_BUDGET·block
# jump_share_switch="official": after a 4-copy step whose accepted copy held 2, 1 or 0 drafts,
# 8 copies once block + 3·n_mask <= OFFICIAL_BUDGET[drafts]·block (92, 89, 86 for a block of 32)
OFFICIAL_BUDGET = {2: 92 / 32, 1: 89 / 32, 0: 86 / 32}
Drafts = tuple[np.ndarray, np.ndarray, np.ndarray]  # positions, tokens, confidences (most confident first)


@dataclass
class CopyLayout:
    """How one step's copies of the block are laid out (host arrays, kept in ``seq.strategy_state``)."""
    masked: np.ndarray  # [n] masked block positions, ascending
    draft_idx: np.ndarray  # [k] index into ``masked`` of each draft, most confident first
    draft_tokens: np.ndarray  # [k]
    sets: list[tuple[int, ...]]  # per copy: which drafts it holds (copy 0: none)
    drafted: np.ndarray  # [C, n] bool: position fed a draft in that copy
    draft_conf: np.ndarray | None = None  # [k] each draft's confidence at the step that drafted it
    # the canvas positions each copy 1.. recomputes, ascending: None = ``masked`` (shared
    # layout); the whole block (official layout, at most 4 copies)
    region: np.ndarray | None = None

    @property
    def num_copies(self) -> int:
        return len(self.sets)

    @property
    def copied(self) -> np.ndarray:
        """[r] the canvas positions each copy recomputes."""
        return self.masked if self.region is None else self.region

    def counts(self) -> list[int]:
        """Logit rows per copy: its masked positions that are not drafted."""
        return [len(self.masked) - len(s) for s in self.sets]

    def own_index(self) -> np.ndarray:
        """Flat index into [C, n] of the positions each copy predicts itself, copy after copy
        (the order of its logits rows)."""
        return np.flatnonzero(~self.drafted)

    def over_copied(self, per_masked: np.ndarray) -> np.ndarray:
        """[C, r] bool: ``per_masked`` [C, n] placed at the masked positions of ``copied``, False
        at the others."""
        if self.region is None:
            return per_masked
        out = np.zeros((per_masked.shape[0], len(self.region)), dtype=bool)
        out[:, np.searchsorted(self.region, self.masked)] = per_masked
        return out


class JumpShare(Strategy):
    name: ClassVar[str] = KEY  # replaces the commit rule; refused on Dream (methods.STRATEGIES)

    def setup(self, seq: Sequence) -> None:
        # eight: the block runs 8 copies from its next step on (jump_share_switch="official")
        seq.strategy_state[KEY] = {"drafts": None, "layout": None, "accepted": None, "eight": False}

    def extra_cache_slots(self, seq: Sequence) -> int:
        return (seq.params.max_copies - 1) * seq.params.block_length

    # -- plan ------------------------------------------------------------------------------
    def plan(self, seq: Sequence, plan: StepPlan) -> StepPlan:
        return self.plan_rows([seq], [plan])[0]

    def plan_rows(self, seqs: list[Sequence], plans: list[StepPlan]) -> list[StepPlan]:
        """Each row's copies (its layout decided on the host from its drafts), every row's
        extended plan sent in one copy and its key masks in another."""
        layouts = [self.layout(seq, plan) for seq, plan in zip(seqs, plans)]
        rows = [i for i, layout in enumerate(layouts) if layout is not None]
        if not rows:
            return plans
        shift = self.model.config.logit_shift
        hosts = [share_plan(seqs[i], plans[i], layouts[i], shift) for i in rows]
        out = list(plans)
        for i, plan in zip(rows, sent_plans(hosts, seqs[0].device)):
            out[i] = plan
        return out

    def layout(self, seq: Sequence, plan: StepPlan) -> CopyLayout | None:
        """This step's copies of ``seq``'s block (None: the base step alone), kept as step scratch."""
        state = seq.strategy_state[KEY]
        state["layout"] = state["accepted"] = None
        if seq.step == 0:
            return None
        if plan.host_logits is None or plan.host_positions is None or plan.host_limit is None:
            raise RuntimeError(f"{self.name}: a plan without host arrays (every plan is built on the host)")
        masked = plan.host_logits
        if not len(masked):
            return None
        p = seq.params
        if p.jump_share_switch == "current":
            copies = num_copies(p.max_copies, len(masked), p.block_length, first=seq.step == 1)
        else:
            copies = 8 if state["eight"] else min(p.max_copies, 4)
        whole = p.jump_share_layout == "official" and copies < 8
        state["layout"] = make_layout(seq, masked, state["drafts"], copies, whole)
        return state["layout"]

    # -- verify and commit -----------------------------------------------------------------
    def decide_rows(self, seqs: list[Sequence], positions: list[Tensor], logits: list[Tensor],
                    commit: Callable[..., GroupCommit]) -> list[RowDecision]:
        """The group's step, every row at once: a row without copies commits by its decoder's
        rule and keeps its argmax predictions as drafts; a row with copies verifies them. Every
        row's copies (one for a base row) are rows of one ``copy_predictions`` pass, and one read
        brings back their predictions, the candidates' positions and the base rows' drafts.
        (``commit`` is not needed: no strategy that reweighs confidences composes with jump-share.)"""
        layouts = [s.strategy_state[KEY]["layout"] for s in seqs]
        counts = [p.numel() for p in positions]
        for layout, n in zip(layouts, counts):
            if layout is not None and n != sum(layout.counts()):  # check_method refuses what could cause it
                raise RuntimeError(f"jump-share expected {sum(layout.counts())} logit rows, got {n}: a "
                                   f"strategy dropped tokens inside the forward")
        if not seqs:
            return []
        at, everything = torch.cat(positions), torch.cat(logits)
        masked_logits, predicted = copy_predictions(seqs, layouts, counts, at, everything)
        starts = np.cumsum([0, *counts[:-1]])
        base = [i for i, layout in enumerate(layouts) if layout is None]
        drafts = []
        if base:  # drafts: the base rows' argmax and its probability at each candidate
            index = np.concatenate([np.arange(starts[i], starts[i] + counts[i]) for i in base])
            tokens, conf = greedy_predictions(everything[to_device(index, everything.device)], seqs[0].ids.mask_id)
            drafts = [tokens, conf.float().view(torch.int32).long()]
        read = torch.cat([at.long(), *predicted, *drafts]).cpu().numpy()  # the group's one read
        k = len(at)
        where, x0, conf_bits, chosen = read[:k], read[k: 2 * k], read[2 * k: 3 * k], read[3 * k: 4 * k].astype(bool)
        conf = conf_bits.astype(np.int32).view(np.float32)
        out: list[RowDecision | None] = [None] * len(seqs)
        for i, layout in enumerate(layouts):
            if layout is not None:
                own = slice(starts[i], starts[i] + counts[i])
                out[i] = self.verified(seqs[i], layout, x0[own], conf[own], chosen[own])
        if base:
            draft_tokens, draft_conf = read[4 * k:].reshape(2, -1)
            draft_conf = draft_conf.astype(np.int32).view(np.float32)
            picked = [np.flatnonzero(chosen[starts[i]: starts[i] + counts[i]]) for i in base]
            rows = gathered(masked_logits, [seqs[i].trace is not None for i in base], picked, starts[base])
            offset = 0
            for i, mine, trace_rows in zip(base, picked, rows):
                own = slice(starts[i], starts[i] + counts[i])
                mine_drafts = slice(offset, offset + counts[i])
                offset += counts[i]
                candidates = where[own]
                out[i] = RowDecision(candidates[mine], x0[own][mine], trace_rows, candidates=candidates,
                                     after=partial(keep_drafts, first=seqs[i].step == 0,
                                                   drafts=argmax_drafts(seqs[i], candidates, draft_tokens[mine_drafts],
                                                                        draft_conf[mine_drafts])))
        return out

    def verified(self, seq: Sequence, layout: CopyLayout, x0: np.ndarray, conf: np.ndarray, chosen: np.ndarray
                 ) -> RowDecision:
        """The accepted copy of a row's step (its copies' own predictions as read): its drafts and
        its own commits; its other predictions become the next step's drafts."""
        c, n = layout.drafted.shape
        own = layout.own_index()
        grid = {name: np.full(c * n, fill, dtype=dtype) for name, fill, dtype in
                (("x0", -1, np.int64), ("conf", -np.inf, np.float32), ("commit", False, bool))}
        grid["x0"][own], grid["conf"][own], grid["commit"][own] = x0, conf, chosen
        x0, conf, commit = (grid[name].reshape(c, n) for name in ("x0", "conf", "commit"))
        best = accepted_copy(layout.draft_idx, layout.draft_tokens, x0, commit)
        mine = list(layout.sets[best])
        tokens = x0[best].copy()
        tokens[layout.draft_idx[mine]] = layout.draft_tokens[mine]
        done = layout.drafted[best] | commit[best]
        trace = None if seq.trace is None else commit_confidence(layout, mine, conf[best])[done]
        drafts = ranked(layout.masked[~done], x0[best][~done], conf[best][~done])
        eight = switches_to_eight(seq, layout, best)
        return RowDecision(layout.masked[done], tokens[done], confidence=trace,
                           after=partial(keep_verified, drafts=drafts, accepted=best, eight=eight))

    def step_record(self, seq: Sequence) -> dict:
        """After a speculative step: ``copies`` run, the ``drafted`` positions, and the
        ``accepted`` drafts (committed without being predicted this step)."""
        state = seq.strategy_state[KEY]
        layout, best = state["layout"], state["accepted"]
        if layout is None or best is None:
            return {}
        drafted = layout.masked[layout.draft_idx]
        accepted = drafted[list(layout.sets[best])]
        return {"copies": layout.num_copies, "drafted": sorted(drafted.tolist()),
                "accepted": sorted(accepted.tolist())}


def keep_drafts(seq: Sequence, drafts: Drafts, first: bool) -> None:
    """At a base step's turn: its argmax predictions are the next step's drafts; a block's
    speculative steps start with at most 4 copies."""
    state = seq.strategy_state[KEY]
    state["drafts"] = drafts
    if first:
        state["eight"] = False


def keep_verified(seq: Sequence, drafts: Drafts, accepted: int, eight: bool) -> None:
    """At a speculative step's turn: the copy accepted, the next drafts, the copy count."""
    state = seq.strategy_state[KEY]
    state["drafts"], state["accepted"] = drafts, accepted
    state["eight"] = state["eight"] or eight


def copy_predictions(seqs: list[Sequence], layouts: list[CopyLayout | None], counts: list[int], positions: Tensor,
                     logits: Tensor) -> tuple[Tensor, list[Tensor]]:
    """Every copy of every row in one pass (a row without a layout is one copy, its base step):
    (the logits with the mask excluded; [sampled token, its confidence as float32 bits, whether
    the decoder's rule commits it]) for each candidate a copy predicts itself, laid out row after
    row, copy after copy (``positions`` [K], ``logits`` [K, V]; ``counts`` per row). Each copy is
    a row of one ``GroupRules``, as if it were the sequence alone; a sampled copy draws with its
    own keys (its index as the salt, 0 for copy 0 and a base step)."""
    members, rows, salts = [], [], []
    for seq, layout, n in zip(seqs, layouts, counts):
        copies = 1 if layout is None else layout.num_copies
        members += [seq] * copies
        rows += [n] if layout is None else layout.counts()
        salts += list(range(copies))
    rules = GroupRules(members, rows, [s.stats.nfe + 1 for s in members], logits.device, salts)
    masked, x0, conf = rules.predict(logits, positions, owned=True)
    return masked, [x0, conf.float().view(torch.int32).long(), rules.select(conf).long()]


def commit_confidence(layout: CopyLayout, drafts: list[int], conf: np.ndarray) -> np.ndarray:
    """[n] for a trace: the accepted copy's own confidences, and at its ``drafts`` the
    confidence each had when it was drafted."""
    out = conf.copy()
    if layout.draft_conf is not None:
        out[layout.draft_idx[drafts]] = layout.draft_conf[drafts]
    return out


# -- copy count and layout ---------------------------------------------------------------------
def num_copies(max_copies: int, num_masked: int, block_length: int, first: bool = False) -> int:
    """jump_share_switch="current": copies this step, from the masks left now: at most 4 on the
    block's ``first`` speculative step; later 8 only once block + 3·n_mask <= SHARE_BUDGET·block,
    else at most 4."""
    if max_copies == 8 and (first or block_length + 3 * num_masked > SHARE_BUDGET * block_length):
        return 4
    return max_copies


def switches_to_eight(seq: Sequence, layout: CopyLayout, best: int) -> bool:
    """jump_share_switch="official": after this 4-copy step, the block moves to 8 copies. The
    official code decides it after a step from the masks that step computed (``layout``, before
    its commits) against a budget set by the drafts the accepted copy ``best`` held, never after
    the block's first speculative step (its budget variable starts above every threshold)."""
    p = seq.params
    if p.jump_share_switch != "official" or p.max_copies != 8 or seq.step < 2 or layout.num_copies > 4:
        return False
    budget = OFFICIAL_BUDGET[len(layout.sets[best])]
    return p.block_length + 3 * len(layout.masked) <= budget * p.block_length


def draft_sets(k: int) -> list[tuple[int, ...]]:
    """Copy 0 holds no draft; then for each draft j: the singleton {j} and, from the second draft
    on, the prefix {0..j}. k = 2 -> [(), (0,), (1,), (0, 1)]."""
    sets: list[tuple[int, ...]] = [()]
    for j in range(k):
        sets.append((j,))
        if j:
            sets.append(tuple(range(j + 1)))
    return sets


def ranked(positions: np.ndarray, tokens: np.ndarray, conf: np.ndarray) -> Drafts:
    """Draft candidates sorted by confidence, most confident first (ties: the earlier one)."""
    order = np.argsort(-conf, kind="stable")
    return positions[order], tokens[order], conf[order]


def argmax_drafts(seq: Sequence, positions: np.ndarray, tokens: np.ndarray, conf: np.ndarray) -> Drafts:
    """Drafts from a base step: at the block's candidate ``positions``, the argmax token and its
    probability (``tokens``, ``conf``: every candidate's)."""
    start, end = seq.block
    inside = (positions >= start) & (positions < end)
    return ranked(positions[inside], tokens[inside], conf[inside])


def make_layout(seq: Sequence, masked: np.ndarray, drafts: Drafts | None, copies: int,
                whole: bool = False) -> CopyLayout:
    """Pick the drafts (most confident still-masked predictions) for ``copies`` copies and the
    copies that hold them; ``whole``: each copy recomputes the whole block (official layout)."""
    masked = np.asarray(masked, dtype=np.int64)
    idx, tokens, conf = np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64), None
    if drafts is not None:
        pos, tok, confs = (np.asarray(d) for d in drafts)
        live = np.isin(pos, masked)  # keeps the confidence order
        k = min(copies // 2, int(live.sum()))
        idx = np.searchsorted(masked, pos[live][:k])
        tokens, conf = tok[live][:k].astype(np.int64), confs[live][:k]
    sets = draft_sets(len(idx))
    drafted = np.zeros((len(sets), len(masked)), dtype=bool)
    for c, held in enumerate(sets):
        drafted[c, idx[list(held)]] = True  # the drafts sit at distinct positions
    region = np.arange(*seq.block) if whole and len(sets) > 1 else None
    return CopyLayout(masked, idx, tokens, sets, drafted, conf, region)


@dataclass
class HostPlan:
    """A row's extended plan as host arrays (``share_plan``), sent with the group's (``sent_plans``)."""
    positions: np.ndarray  # [T]
    key_limit: np.ndarray  # [T]
    logit_positions: np.ndarray  # [N]
    logit_slots: np.ndarray  # [N]
    slots: np.ndarray  # [T]
    token_ids: np.ndarray  # [T]
    key_mask: np.ndarray  # [T, S] bool


def share_plan(seq: Sequence, plan: StepPlan, layout: CopyLayout, shift: int) -> HostPlan:
    """Copy 0 = the base plan's tokens; copies 1.. = the ``copied`` positions again (the masked
    ones, or the whole block), their drafts filled in, in cache slots past the canvas. Logits:
    copy 0's masked positions, then each copy's (``shift`` is 0: ``check_method`` refuses
    jump-share on a model with a logit shift). Built on the host from the base plan's host arrays."""
    positions, limit = plan.host_positions, plan.host_limit
    copied, extra = layout.copied, layout.num_copies - 1
    current = seq.canvas[copied]
    drafted = layout.over_copied(layout.drafted)  # [C, r]
    filled = current.copy()
    filled[np.searchsorted(copied, layout.masked[layout.draft_idx])] = layout.draft_tokens  # every draft in place
    copy_tokens = np.where(drafted[1:], filled, current)  # [C-1, r]
    copy_slots = seq.canvas_len + np.arange(extra * len(copied))  # [(C-1)·r]
    own = layout.over_copied(~layout.drafted)[1:]  # [C-1, r]: masked and not drafted
    predict = np.flatnonzero(own)
    copy_positions = np.tile(copied, extra)
    return HostPlan(positions=np.concatenate([positions, copy_positions]),
                    key_limit=np.concatenate([limit, np.full(len(copy_positions), seq.canvas_len)]),
                    logit_positions=np.concatenate([layout.masked, copy_positions[predict] + shift]),
                    logit_slots=np.concatenate([layout.masked - shift, copy_slots[predict]]),
                    slots=np.concatenate([positions, copy_slots]),
                    token_ids=np.concatenate([seq.canvas[positions], copy_tokens.reshape(-1)]),
                    key_mask=copy_key_mask(limit, seq.canvas_len, copied, extra))


def sent_plans(hosts: list[HostPlan], device: torch.device) -> list[StepPlan]:
    """The rows' plans from their host arrays: the int arrays in one copy, the key masks in
    another; each plan keeps its host arrays (the runner builds the step's mask from them)."""
    fields = ("positions", "key_limit", "logit_positions", "logit_slots", "slots", "token_ids")
    parts = [getattr(h, f) for h in hosts for f in fields]
    views = to_device(np.concatenate(parts).astype(np.int64), device).split([len(p) for p in parts])
    out = []
    for j, h in enumerate(hosts):
        t = dict(zip(fields, views[j * len(fields): (j + 1) * len(fields)]))
        out.append(StepPlan(**t, host_positions=h.positions, host_limit=h.key_limit, host_logits=h.logit_positions,
                            host_key_mask=h.key_mask, host_slots=h.slots, host_logit_slots=h.logit_slots,
                            host_tokens=h.token_ids))
    return out


def copy_key_mask(base_limit: np.ndarray, canvas_len: int, copied: np.ndarray, extra: int) -> np.ndarray:
    """[T, S] bool. Base tokens keep their key limits. A copy token sees the canvas except the
    positions copies recompute (``copied``: copy 0's version of them) plus its own copy's slots."""
    n = len(copied)
    width = canvas_len + extra * n
    keys = np.arange(width)
    base = keys[None, :] < np.asarray(base_limit)[:, None]  # [T0, S]
    canvas = (keys < canvas_len) & ~np.isin(keys, copied)  # [S]
    owner = np.arange(extra * n) // max(n, 1)  # copy of each extra token / slot
    key_owner = np.where(keys >= canvas_len, (keys - canvas_len) // max(n, 1), -1)
    copies = canvas[None, :] | (owner[:, None] == key_owner[None, :])  # [(C-1)·r, S]
    return np.concatenate([base, copies])


# -- acceptance --------------------------------------------------------------------------------
def accepted_copy(draft_idx: np.ndarray, draft_tokens: np.ndarray, x0: np.ndarray, commit: np.ndarray) -> int:
    """The copy to apply, by the official code's rule. ``x0``, ``commit``: [C, n] each copy's
    prediction at each masked position and whether its commit rule takes it; the copies are
    ``draft_sets(k)`` of the k = len(draft_idx) drafts d1..dk. v(c, j): copy c commits d_j's
    position with the drafted token; a_j = v(0, j).

    - {d_j} alone: a_j. {d1, d2}: a1 and a2, or a1 and v({d1}, 2), or a2 and v({d2}, 1) (a12).
    - {d1, d2, d3} (a123): a1, a2 and a3; a3 and a12; a3, v({d3}, 1) and v({d3}, 2); a12 and
      v(c, 3) for a copy c among {d1}, {d2}, {d1, d2}.
    - {d1..d4}: a1..a4; a4 and a123; a4 and v({d4}, j) for j = 1, 2, 3; a123 and v(c, 4) for a
      copy c among {d1}, {d2}, {d1, d2}, {d3}, {d1, d2, d3}; and, as the official code writes it,
      a4, a12 and copy {d4} committing d3's position with the token copy {d3} predicts at d1's (a
      comparison across two positions, kept so that the tokens are the official ones).
    The accepted copy with the most drafts wins (ties: the earlier copy)."""
    # plain Python over at most 8 copies and 4 drafts (host arrays)
    k, c = len(draft_idx), len(x0)
    where, want = np.asarray(draft_idx).tolist(), np.asarray(draft_tokens).tolist()
    pred, takes = np.asarray(x0).tolist(), np.asarray(commit).tolist()

    def v(copy: int, j: int) -> bool:  # copy commits draft j (0-based) with its drafted token
        return j < k and copy < c and bool(takes[copy][where[j]]) and pred[copy][where[j]] == want[j]

    a = [v(0, j) for j in range(4)]
    a12 = (a[1] and v(2, 0)) or (a[0] and v(1, 1))
    a123 = k >= 3 and ((a[2] and (a12 or (v(4, 0) and v(4, 1))))
                       or (a12 and any(v(b, 2) for b in (3, 1, 2))))
    a1234 = k == 4 and ((a[3] and (a123 or all(v(6, j) for j in range(3))
                                   or (a12 and bool(takes[6][where[2]]) and pred[6][where[2]] == pred[4][where[0]])))
                        or (a123 and any(v(b, 3) for b in (5, 4, 3, 2, 1))))
    if a1234 or all(a):
        return 7
    if a123 or all(a[:3]):
        return 5
    if a12 or (a[0] and a[1]):
        return 3
    return next((copy for copy, ok in zip((1, 2, 4, 6), a) if ok), 0)
