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

Restrictions (refused when the method is parsed): models without a logit shift (LLaDA), since a
shifted model (Dream) reads position p's prediction at p - 1, which may be a shared token; no
strategy that drops tokens inside the forward (every copy must reach the last layer). On a
block's first step (the full forward) the base decoder runs unchanged and its argmax predictions
are kept as drafts.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from ..decoding.decide import GroupRules
from ..decoding.commit_rules import predict
from ..decoding.decoders import StepPlan
from ..decoding.rules import greedy_predictions
from ..engine.sequence import Sequence
from .base import CommitRule, Strategy

KEY = "jump-share"
SHARE_BUDGET = 2.8  # jump_share_switch="current": 8 copies once block + 3·n_mask <= SHARE_BUDGET·block
# jump_share_switch="official": after a 4-copy step whose accepted copy held 2, 1 or 0 drafts,
# 8 copies once block + 3·n_mask <= OFFICIAL_BUDGET[drafts]·block (92, 89, 86 for a block of 32)
OFFICIAL_BUDGET = {2: 92 / 32, 1: 89 / 32, 0: 86 / 32}


@dataclass
class CopyLayout:
    """How one step's copies of the block are laid out (kept in ``seq.strategy_state``)."""
    masked: Tensor  # [n] masked block positions, ascending
    draft_idx: Tensor  # [k] index into ``masked`` of each draft, most confident first
    draft_tokens: Tensor  # [k]
    sets: list[tuple[int, ...]]  # per copy: which drafts it holds (copy 0: none)
    drafted: Tensor  # [C, n] bool: position fed a draft in that copy
    draft_conf: Tensor | None = None  # [k] each draft's confidence at the step that drafted it
    # the canvas positions each copy 1.. recomputes, ascending: None = ``masked`` (shared
    # layout); the whole block (official layout, at most 4 copies)
    region: Tensor | None = None

    @property
    def num_copies(self) -> int:
        return len(self.sets)

    @property
    def copied(self) -> Tensor:
        """[r] the canvas positions each copy recomputes."""
        return self.masked if self.region is None else self.region

    def counts(self) -> list[int]:
        """Logit rows per copy: its masked positions that are not drafted (host arithmetic)."""
        return [self.masked.numel() - len(s) for s in self.sets]

    def own_index(self, first: int = 0) -> Tensor:
        """Flat index into [C - first, n] of the positions copies ``first``.. predict themselves,
        copy after copy (the order of their logits rows); no host read."""
        own = ~self.drafted[first:]
        return torch.nonzero_static(own.flatten(), size=sum(self.counts()[first:]))[:, 0]

    def over_copied(self, per_masked: Tensor) -> Tensor:
        """[C, r] bool: ``per_masked`` [C, n] placed at the masked positions of ``copied``, False
        at the others."""
        if self.region is None:
            return per_masked
        out = per_masked.new_zeros((per_masked.shape[0], self.region.numel()))
        out[:, torch.searchsorted(self.region, self.masked)] = per_masked
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
        state = seq.strategy_state[KEY]
        state["layout"] = state["accepted"] = None
        if seq.step == 0 or not plan.logit_positions.numel():
            return plan
        p = seq.params
        masked = plan.logit_positions
        if p.jump_share_switch == "current":
            copies = num_copies(p.max_copies, masked.numel(), p.block_length, first=seq.step == 1)
        else:
            copies = 8 if state["eight"] else min(p.max_copies, 4)
        whole = p.jump_share_layout == "official" and copies < 8
        layout = make_layout(seq, masked, state["drafts"], copies, whole)
        state["layout"] = layout
        return share_plan(seq, plan, layout, self.model.config.logit_shift)

    # -- verify and commit -----------------------------------------------------------------
    def commit(self, seq: Sequence, positions: Tensor, logits: Tensor, base: CommitRule) -> Tensor:
        """Verify the copies and commit the accepted one; on a block's first step the base rule
        commits and its argmax predictions become the drafts."""
        state = seq.strategy_state[KEY]
        layout: CopyLayout | None = state["layout"]
        if layout is None:
            state["drafts"] = argmax_drafts(seq, positions, logits)
            if seq.step == 0:
                state["eight"] = False  # a block's speculative steps start with at most 4 copies
            return base(seq, positions, logits)
        if positions.numel() != sum(layout.counts()):  # check_method refuses what could cause it
            raise RuntimeError(f"jump-share expected {sum(layout.counts())} logit rows, got "
                               f"{positions.numel()}: a strategy dropped tokens inside the forward")
        x0, conf, commit = self.copy_predictions(seq, layout, logits)
        best = accepted_copy(layout.draft_idx, layout.draft_tokens, x0, commit)
        state["accepted"] = best
        state["eight"] = state["eight"] or switches_to_eight(seq, layout, best)
        return self.apply(seq, layout, best, x0[best], conf[best], commit[best])

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

    @staticmethod
    def copy_predictions(seq: Sequence, layout: CopyLayout, logits: Tensor
                         ) -> tuple[Tensor, Tensor, Tensor]:
        """Per copy, over the n masked positions: sampled token, confidence and whether the
        commit rule would commit it ([C, n] each; drafted positions get -1 / -inf / False). Every
        copy in one pass; a sampled copy draws with its own keys (its index as the salt)."""
        c, n = layout.drafted.shape
        counts = layout.counts()
        own = layout.own_index()
        # own indexes [C, n]: the copy of each row is own // n, its masked position own % n
        _, tokens, own_conf = predict(seq, layout.masked[own % n], logits, salt=own // n)
        own_conf = own_conf.float()
        x0 = torch.full((c * n,), -1, dtype=torch.long, device=logits.device).index_copy_(0, own, tokens)
        conf = torch.full((c * n,), -float("inf"), device=logits.device).index_copy_(0, own, own_conf)
        commit = torch.zeros(c * n, dtype=torch.bool, device=logits.device)
        commit[own] = select_copies(seq, own_conf, counts)
        return x0.view(c, n), conf.view(c, n), commit.view(c, n)

    @staticmethod
    def apply(seq: Sequence, layout: CopyLayout, best: int, x0: Tensor, conf: Tensor,
              commit: Tensor) -> Tensor:
        """Commit copy ``best``'s drafts and its own commits (returns their positions); its other
        predictions become the next step's drafts."""
        mine = list(layout.sets[best])
        tokens = x0.clone()
        tokens[layout.draft_idx[mine]] = layout.draft_tokens[mine]
        done = layout.drafted[best] | commit
        num_done = int(done.sum())  # one host read
        order = torch.sort((~done).to(torch.int8), stable=True).indices  # done first, each part ascending
        done, rest = order[:num_done], order[num_done:]
        seq.commit(layout.masked[done], tokens[done],
                   confidence=None if seq.trace is None else commit_confidence(layout, mine, conf)[done])
        seq.strategy_state[KEY]["drafts"] = ranked(layout.masked[rest], x0[rest], conf[rest])
        return layout.masked[done]


def commit_confidence(layout: CopyLayout, drafts: list[int], conf: Tensor) -> Tensor:
    """[n] for a trace: the accepted copy's own confidences, and at its ``drafts`` the
    confidence each had when it was drafted."""
    out = conf.clone()
    if layout.draft_conf is not None:
        out[layout.draft_idx[drafts]] = layout.draft_conf[drafts].to(out.dtype)
    return out


def select_copies(seq: Sequence, conf: Tensor, counts: list[int]) -> Tensor:
    """bool [sum counts]: the decoder's rule applied to each copy's own candidates (``conf``:
    copy after copy, ``counts`` each) as if each were the sequence alone, in one pass."""
    live = [k for k in counts if k]
    if not live:
        return torch.zeros(0, dtype=torch.bool, device=conf.device)
    return GroupRules([seq] * len(live), live, [seq.stats.nfe] * len(live), conf.device).select(conf)


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
    return p.block_length + 3 * layout.masked.numel() <= budget * p.block_length


def draft_sets(k: int) -> list[tuple[int, ...]]:
    """Copy 0 holds no draft; then for each draft j: the singleton {j} and, from the second draft
    on, the prefix {0..j}. k = 2 -> [(), (0,), (1,), (0, 1)]."""
    sets: list[tuple[int, ...]] = [()]
    for j in range(k):
        sets.append((j,))
        if j:
            sets.append(tuple(range(j + 1)))
    return sets


def ranked(positions: Tensor, tokens: Tensor, conf: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Draft candidates sorted by confidence, most confident first (ties: lower position)."""
    order = torch.sort(conf, descending=True, stable=True).indices
    return positions[order], tokens[order], conf[order]


def argmax_drafts(seq: Sequence, positions: Tensor, logits: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Drafts from a base step: argmax token and its probability at the block's positions."""
    start, end = seq.block
    inside = (positions >= start) & (positions < end)
    tokens, conf = greedy_predictions(logits[inside], seq.ids.mask_id)
    return ranked(positions[inside], tokens, conf)


def make_layout(seq: Sequence, masked: Tensor, drafts: tuple[Tensor, Tensor, Tensor] | None,
                copies: int, whole: bool = False) -> CopyLayout:
    """Pick the drafts (most confident still-masked predictions) for ``copies`` copies and the
    copies that hold them; ``whole``: each copy recomputes the whole block (official layout)."""
    n = masked.numel()
    idx = torch.empty(0, dtype=torch.long, device=masked.device)
    tokens, conf = idx.clone(), None
    if drafts is not None:
        pos, tok, confs = drafts
        live = torch.isin(pos, masked)  # keeps the confidence order
        k = min(copies // 2, int(live.sum()))
        idx = torch.searchsorted(masked, pos[live][:k])
        tokens, conf = tok[live][:k], confs[live][:k]
    sets = draft_sets(idx.numel())
    holds = torch.tensor([[j in s for j in range(idx.numel())] for s in sets], dtype=torch.bool,
                         device=masked.device)  # [C, k]: which drafts each copy holds
    drafted = torch.zeros(len(sets), n, dtype=torch.bool, device=masked.device)
    drafted[:, idx] = holds  # the drafts sit at distinct positions
    region = torch.arange(*seq.block, device=masked.device) if whole and len(sets) > 1 else None
    return CopyLayout(masked, idx, tokens, sets, drafted, conf, region)


def share_plan(seq: Sequence, plan: StepPlan, layout: CopyLayout, shift: int) -> StepPlan:
    """Copy 0 = the base plan's tokens; copies 1.. = the ``copied`` positions again (the masked
    ones, or the whole block), their drafts filled in, in cache slots past the canvas. Logits:
    copy 0's masked positions, then each copy's (``shift`` is 0: ``check_method`` refuses
    jump-share on a model with a logit shift)."""
    copied, extra = layout.copied, layout.num_copies - 1
    current = seq.tokens(copied)
    drafted = layout.over_copied(layout.drafted)  # [C, r]
    at = torch.searchsorted(copied, layout.masked[layout.draft_idx])
    filled = current.index_copy(0, at, layout.draft_tokens)  # every draft in place
    copy_tokens = torch.where(drafted[1:], filled, current)  # [C-1, r]
    copy_slots = seq.canvas_len + torch.arange(extra * copied.numel(), device=copied.device)  # [(C-1)·r]
    own = layout.over_copied(~layout.drafted)[1:]  # [C-1, r]: masked and not drafted
    predict = torch.nonzero_static(own.flatten(), size=sum(layout.counts()[1:]))[:, 0]
    return plan.with_tokens(seq, shift, positions=copied.repeat(extra), slots=copy_slots,
                            token_ids=copy_tokens.flatten(),
                            key_mask=copy_key_mask(plan.key_limit, seq.canvas_len, copied, extra),
                            predict=predict)


def copy_key_mask(base_limit: Tensor, canvas_len: int, copied: Tensor, extra: int) -> Tensor:
    """[T, S] bool. Base tokens keep their key limits. A copy token sees the canvas except the
    positions copies recompute (``copied``: copy 0's version of them) plus its own copy's slots."""
    n = copied.numel()
    width = canvas_len + extra * n
    keys = torch.arange(width, device=copied.device)
    base = keys[None, :] < base_limit[:, None]  # [T0, S]
    canvas = (keys < canvas_len) & ~torch.isin(keys, copied)  # [S]
    owner = torch.arange(extra * n, device=copied.device) // n  # copy of each extra token / slot
    key_owner = torch.where(keys >= canvas_len, (keys - canvas_len) // max(n, 1), -1)
    copies = canvas[None, :] | (owner[:, None] == key_owner[None, :])  # [(C-1)·r, S]
    return torch.cat([base, copies])


# -- acceptance --------------------------------------------------------------------------------
def accepted_copy(draft_idx: Tensor, draft_tokens: Tensor, x0: Tensor, commit: Tensor) -> int:
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
    # one host transfer, then plain Python over at most 8 copies and 4 drafts
    k, (c, n) = draft_idx.numel(), x0.shape
    flat = torch.cat([draft_idx, draft_tokens, x0.flatten(), commit.flatten().long()]).tolist()
    where, want = flat[:k], flat[k: 2 * k]
    pred = [flat[2 * k + i * n: 2 * k + (i + 1) * n] for i in range(c)]
    takes = [flat[2 * k + (c + i) * n: 2 * k + (c + i + 1) * n] for i in range(c)]

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
