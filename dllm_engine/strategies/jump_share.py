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
- "Share": committed block positions (and, for prefix-cache, the suffix) are computed once, as
  part of copy 0; only the masked positions are duplicated per copy, into cache slots past the
  canvas (``extra_cache_slots``). A copy token sees the cache, the shared tokens and its own
  copy, never copy 0's masks nor another copy (``copy_key_mask``). The shared tokens themselves
  are computed in copy 0's context, the sharing approximation of the paper. (Deviation: the
  official code's 4-copy layout copies the whole block, so each copy recomputes the committed
  positions in its own context; the engine shares them in every layout, as the paper's
  "share" does and as the official 8-copy layout does, which keeps one layout and one cost model.
  Tokens differ only where a committed position's K/V depend on the drafts, seen at threshold
  0.99 on the copy-only tiny-llada of commit ffd686a.)

Acceptance ("jump"): copy 0 is accepted. A copy with draft set D is accepted when a smaller
accepted copy D' (a subset of D) predicts every draft of D \\ D' with the same token and would
commit it under the commit rule. The accepted copy with the most drafts wins; its drafts and its
own commits are applied, so one forward can advance two steps. Its remaining predictions become
the next step's drafts.

Copy count: ``max_copies`` (1, 2, 4, 8). As in the official code, a block's first speculative
step uses at most 4 copies; later, 8 copies (block + 7·n_mask tokens) are used once the 4-copy
layout is small enough: block + 3·n_mask <= 2.8·block (89 for block 32, the official code's 86-92
switch point), else 4. As in the official code, the drafts may cover every masked position (a
copy holding them all predicts nothing itself and is accepted on the others' confirmation). With
``max_copies = 1`` the step is the base decoder's step (same tokens).

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

from ..decoding.decoders import StepPlan, predict, select, select_rows, threshold_rule
from ..decoding.rules import greedy_predictions
from ..engine.sequence import Sequence
from .base import CommitRule, Strategy

KEY = "jump-share"
SHARE_BUDGET = 2.8  # 8 copies once block + 3·n_mask <= SHARE_BUDGET · block


@dataclass
class CopyLayout:
    """How one step's copies of the block are laid out (kept in ``seq.strategy_state``)."""
    masked: Tensor  # [n] masked block positions, ascending
    draft_idx: Tensor  # [k] index into ``masked`` of each draft, most confident first
    draft_tokens: Tensor  # [k]
    sets: list[tuple[int, ...]]  # per copy: which drafts it holds (copy 0: none)
    drafted: Tensor  # [C, n] bool: position fed a draft in that copy
    draft_conf: Tensor | None = None  # [k] each draft's confidence at the step that drafted it

    @property
    def num_copies(self) -> int:
        return len(self.sets)

    def counts(self) -> list[int]:
        """Logit rows per copy: its masked positions that are not drafted (host arithmetic)."""
        return [self.masked.numel() - len(s) for s in self.sets]

    def own_index(self, first: int = 0) -> Tensor:
        """Flat index into [C - first, n] of the positions copies ``first``.. predict themselves,
        copy after copy (the order of their logits rows); no host read."""
        own = ~self.drafted[first:]
        return torch.nonzero_static(own.flatten(), size=sum(self.counts()[first:]))[:, 0]


class JumpShare(Strategy):
    name: ClassVar[str] = KEY  # replaces the commit rule; refused on Dream (methods.STRATEGIES)

    def setup(self, seq: Sequence) -> None:
        seq.strategy_state[KEY] = {"drafts": None, "layout": None, "accepted": None}

    def extra_cache_slots(self, seq: Sequence) -> int:
        return (seq.params.max_copies - 1) * seq.params.block_length

    # -- plan ------------------------------------------------------------------------------
    def plan(self, seq: Sequence, plan: StepPlan) -> StepPlan:
        state = seq.strategy_state[KEY]
        state["layout"] = state["accepted"] = None
        if seq.step == 0 or not plan.logit_positions.numel():
            return plan
        layout = make_layout(seq, plan.logit_positions, state["drafts"])
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
            return base(seq, positions, logits)
        if positions.numel() != sum(layout.counts()):  # check_method refuses what could cause it
            raise RuntimeError(f"jump-share expected {sum(layout.counts())} logit rows, got "
                               f"{positions.numel()}: a strategy dropped tokens inside the forward")
        x0, conf, commit = self.copy_predictions(seq, layout, logits)
        best = accepted_copy(layout.sets, layout.draft_idx, layout.draft_tokens, x0, commit)
        state["accepted"] = best
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
        commit rule would commit it ([C, n] each; drafted positions get -1 / -inf / False)."""
        p = seq.params
        c, n = layout.drafted.shape
        counts = layout.counts()
        if p.temperature == 0 and p.remasking != "random":  # row-wise rules: every copy at once
            _, tokens, own_conf = predict(seq, logits)
        else:  # the generator draws copy after copy, as each copy's step alone would
            drawn = [predict(seq, rows)[1:] for rows in logits.split(counts) if rows.shape[0]]
            tokens, own_conf = (torch.cat(part) for part in zip(*drawn))
        own_conf = own_conf.float()
        own = layout.own_index()
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
    """bool [sum counts]: ``select`` of each copy's own candidates (``conf``: copy after copy,
    ``counts`` each), in one pass when the rule is a threshold or top-k (``select_rows`` gives
    each row what ``select`` gives it alone)."""
    rule = threshold_rule(seq)
    live = [k for k in counts if k]
    if not live:
        return torch.zeros(0, dtype=torch.bool, device=conf.device)
    if rule is None:  # the factor rule: copy by copy
        return torch.cat([select(seq, part) for part in conf.split(counts) if part.numel()])
    chosen = select_rows(conf, live, [rule] * len(live))  # [C', M], padded
    valid = torch.arange(chosen.shape[1], device=conf.device)[None] < torch.tensor(live, device=conf.device)[:, None]
    return chosen.flatten()[torch.nonzero_static(valid.flatten(), size=sum(live))[:, 0]]


# -- layout ------------------------------------------------------------------------------------
def num_copies(max_copies: int, num_masked: int, block_length: int, first: bool = False) -> int:
    """Copies this step: at most 4 on the block's ``first`` speculative step; later 8 only once
    block + 3·n_mask <= SHARE_BUDGET·block, else at most 4."""
    if max_copies == 8 and (first or block_length + 3 * num_masked > SHARE_BUDGET * block_length):
        return 4
    return max_copies


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


def make_layout(seq: Sequence, masked: Tensor, drafts: tuple[Tensor, Tensor, Tensor] | None
                ) -> CopyLayout:
    """Pick the drafts (most confident still-masked predictions) and the copies that hold them."""
    n = masked.numel()
    copies = num_copies(seq.params.max_copies, n, seq.params.block_length, first=seq.step == 1)
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
    return CopyLayout(masked, idx, tokens, sets, drafted, conf)


def share_plan(seq: Sequence, plan: StepPlan, layout: CopyLayout, shift: int) -> StepPlan:
    """Copy 0 = the base plan's tokens; copies 1.. = the masked positions again, drafts filled
    in, in cache slots past the canvas. Logits: copy 0's masked positions, then each copy's
    (``shift`` is 0: ``check_method`` refuses jump-share on a model with a logit shift)."""
    masked, n, extra = layout.masked, layout.masked.numel(), layout.num_copies - 1
    current = seq.canvas[masked]
    filled = current.index_copy(0, layout.draft_idx, layout.draft_tokens)  # every draft in place
    copy_tokens = torch.where(layout.drafted[1:], filled, current)  # [C-1, n]
    copy_slots = seq.canvas_len + torch.arange(extra * n, device=masked.device)  # [(C-1)·n]
    return plan.with_tokens(seq, shift, positions=masked.repeat(extra), slots=copy_slots,
                            token_ids=copy_tokens.flatten(),
                            key_mask=copy_key_mask(plan.key_limit, seq.canvas_len, masked, extra),
                            predict=layout.own_index(first=1))


def copy_key_mask(base_limit: Tensor, canvas_len: int, masked: Tensor, extra: int) -> Tensor:
    """[T, S] bool. Base tokens keep their key limits. A copy token sees the canvas except
    copy 0's masked positions (cache, shared committed tokens, suffix) plus its own copy's slots."""
    n = masked.numel()
    width = canvas_len + extra * n
    keys = torch.arange(width, device=masked.device)
    base = keys[None, :] < base_limit[:, None]  # [T0, S]
    canvas = (keys < canvas_len) & ~torch.isin(keys, masked)  # [S]
    owner = torch.arange(extra * n, device=masked.device) // n  # copy of each extra token / slot
    key_owner = torch.where(keys >= canvas_len, (keys - canvas_len) // max(n, 1), -1)
    copies = canvas[None, :] | (owner[:, None] == key_owner[None, :])  # [(C-1)·n, S]
    return torch.cat([base, copies])


# -- acceptance --------------------------------------------------------------------------------
def accepted_copy(sets: list[tuple[int, ...]], draft_idx: Tensor, draft_tokens: Tensor,
                  x0: Tensor, commit: Tensor) -> int:
    """The copy to apply. ``x0``, ``commit``: [C, n] each copy's prediction at each masked
    position and whether its commit rule takes it. Copy 0 is accepted; copy D is accepted when an
    accepted copy D' ⊊ D predicts each draft in D \\ D' with the drafted token and commits it.
    Returns the accepted copy with the most drafts (ties: the earlier copy)."""
    # one host transfer, then plain Python over at most 8 copies and 4 drafts
    k, (c, n) = draft_idx.numel(), x0.shape
    flat = torch.cat([draft_idx, draft_tokens, x0.flatten(), commit.flatten().long()]).tolist()
    where, want = flat[:k], flat[k: 2 * k]
    pred = [flat[2 * k + i * n: 2 * k + (i + 1) * n] for i in range(c)]
    takes = [flat[2 * k + (c + i) * n: 2 * k + (c + i + 1) * n] for i in range(c)]
    members = [set(s) for s in sets]

    def verifies(b: int, drafts: set[int]) -> bool:
        return all(takes[b][where[j]] and pred[b][where[j]] == want[j] for j in drafts)

    ok = [False] * len(sets)
    for c in sorted(range(len(sets)), key=lambda i: len(sets[i])):
        ok[c] = not members[c] or any(ok[b] and verifies(b, members[c] - members[b])
                                      for b in range(len(sets)) if members[b] < members[c])
    return max(range(len(sets)), key=lambda c: (ok[c], len(sets[c]), -c))
