"""Adaptive length prediction (ALP) of ODB-dLLM (Wei et al., "Orchestrating Dual-Boundaries: An
Arithmetic Intensity Inspired Acceleration Framework for Diffusion Language Models",
arXiv 2511.21759).

A semi-AR dLLM is given a fixed, generous canvas (e.g. 1024 slots) and every full-canvas forward
pays for all of it. At each full forward (the first step of a block) ALP reads the argmax
prediction of every still-masked generation slot; if a stop token (EOS or a configured stop id)
is predicted with confidence >= ``eos_threshold`` (tau), the canvas is cut at the block boundary
after the first such slot. Later forwards, key limits and the block list then use the shorter
canvas, and the sequence finishes when its new last block completes.

Rules: slots before ``prompt_len + min_length`` are ignored; the cut never removes a
committed non-stop token; tau > 1 never cuts. With block diffusion (SDAR) a forward computes only
the current block, so ALP can at most end the sequence after the current block.
"""
from __future__ import annotations

from typing import ClassVar

import numpy as np
import torch
from torch import Tensor

from ..decoding.plan import StepPlan
from ..decoding.rules import greedy_predictions
from ..engine.sequence import Sequence, host, to_device
from ..models.context import nonzero_index
from .base import Strategy

KEY = "adaptive-length"


class AdaptiveLength(Strategy):
    name: ClassVar[str] = KEY

    def setup(self, seq: Sequence) -> None:
        # per step: the positions the commit rule sees, the canvas length to cut to, the cut made
        # (for the step's trace record); kept: the cuts
        seq.strategy_state[KEY] = {"commit_positions": None, "cut_to": None, "step_cut": None, "cuts": []}

    def plan(self, seq: Sequence, plan: StepPlan) -> StepPlan:
        return self.plan_rows([seq], [plan])[0]

    def plan_rows(self, seqs: list[Sequence], plans: list[StepPlan]) -> list[StepPlan]:
        """On a block's first step, also ask for the logits of every masked generation slot
        the forward computes (the current block's stay first, for the commit rule): decided on
        the host, the group's new logit positions sent in one copy."""
        shift = self.model.config.logit_shift
        out, extended = list(plans), []
        for i, (seq, plan) in enumerate(zip(seqs, plans)):
            state = seq.strategy_state[KEY]
            state["commit_positions"] = state["cut_to"] = state["step_cut"] = None  # this step's scratch
            if seq.step != 0:
                continue
            if plan.host_positions is None or plan.host_logits is None:
                raise RuntimeError(f"{self.name}: a plan without host arrays (every plan is built on the host)")
            cfg = seq.params.cfg_scale > 0  # a CFG plan lists the canvas and its logits twice
            wanted = plan.host_logits[: len(plan.host_logits) // 2] if cfg else plan.host_logits
            state["commit_positions"] = wanted
            if len(extra := host_inspected(seq, plan.host_positions, wanted)):
                wanted = np.concatenate([wanted, extra])
                slots = np.concatenate([wanted - shift, wanted - shift + seq.canvas_len]) if cfg else wanted - shift
                extended.append((i, np.tile(wanted, 2) if cfg else wanted, slots))
        if extended:
            sent = to_device(np.concatenate([a for _, w, sl in extended for a in (w, sl)]), seqs[0].device)
            views = iter(sent.split([len(a) for _, w, sl in extended for a in (w, sl)]))
            for i, wanted, slots in extended:
                out[i] = plans[i].predicting(wanted, slots, (next(views), next(views)))
        return out

    def after_forward(self, seq: Sequence, positions: Tensor, logits: Tensor) -> tuple[Tensor, Tensor]:
        return self.after_forward_rows([seq], [(positions, logits)])[0]

    def after_forward_rows(self, seqs: list[Sequence], outputs: list[tuple[Tensor, Tensor]]
                           ) -> list[tuple[Tensor, Tensor]]:
        """Inspect every predicted slot of the sequences at a block's first step, decide where
        a canvas is cut (a confident stop token; ``after_commit`` cuts it), and hand only the
        originally planned (block) positions on to the commit rule. Batched over the forward
        group: the rows' facts (each candidate's row, which positions the commit rule sees) go
        to the device in one copy, and one host read brings back each row's first confident
        stop and how many of its outputs are commit positions."""
        rows = [i for i, s in enumerate(seqs) if s.strategy_state[KEY]["commit_positions"] is not None]
        if not rows:
            return outputs
        positions = torch.cat([outputs[i][0] for i in rows])  # [N], the rows one after another
        logits = torch.cat([outputs[i][1] for i in rows])  # [N, V]
        counts = [outputs[i][0].numel() for i in rows]
        owner, is_commit = row_facts([seqs[i] for i in rows], counts, positions)
        tokens, conf = greedy_predictions(logits, seqs[rows[0]].ids.mask_id)
        stop = first_stops(seqs, rows, positions, tokens, conf, owner, counts)
        kept = torch.zeros(len(rows), dtype=torch.long, device=positions.device).index_add_(0, owner, is_commit.long())
        firsts, kept = torch.stack([stop, kept]).tolist()
        for i, first in zip(rows, firsts):  # decided on the canvas the forward saw
            seqs[i].strategy_state[KEY]["cut_to"] = None if first == NO_STOP else cut_at(seqs[i], first)
        index = nonzero_index(is_commit, sum(kept))
        out = list(outputs)
        for i, pos, lg in zip(rows, positions[index].split(kept), logits[index].split(kept)):
            out[i] = (pos, lg)
        return out

    def after_commit(self, seq: Sequence, committed: np.ndarray) -> None:
        """Cut the canvas where ``after_forward_rows`` decided, before the sequence advances
        (its new last block ends it)."""
        state = seq.strategy_state[KEY]
        if state["cut_to"] is not None:
            seq.truncate(state["cut_to"])
            state["cuts"].append(state["cut_to"] - seq.prompt_len)
            state["step_cut"], state["cut_to"] = state["cut_to"], None

    def step_record(self, seq: Sequence) -> dict:
        """``cut_to``: the canvas length this step cut the canvas to (answer slots: minus the
        prompt)."""
        cut = seq.strategy_state[KEY]["step_cut"]
        return {} if cut is None else {"cut_to": cut, "answer_slots": cut - seq.prompt_len}


NO_STOP = 1 << 62  # a row's first stop position when it has none


def host_inspected(seq: Sequence, positions: np.ndarray, wanted: np.ndarray) -> np.ndarray:
    """The slots a block's first step inspects: the masked generation slots among its computed
    ``positions`` beyond its logit positions ``wanted``, ascending."""
    pos = np.unique(positions)  # a CFG plan lists the canvas twice
    pos = pos[(pos >= seq.prompt_len) & seq.undecided[pos]]
    return pos[~np.isin(pos, wanted)]


def row_facts(seqs: list[Sequence], counts: list[int], positions: Tensor) -> tuple[Tensor, Tensor]:
    """(each candidate's row [N]; whether it is one of its row's commit positions [N]) for rows
    of ``counts`` candidates at canvas ``positions``: a [R, L] map of each row's commit positions
    built on the host and sent with the rows in one copy."""
    width = max(s.canvas_len for s in seqs)
    commit = np.zeros((len(seqs), width), dtype=np.int64)
    for j, s in enumerate(seqs):
        commit[j, host(s.strategy_state[KEY]["commit_positions"])] = 1
    owner = np.repeat(np.arange(len(seqs)), counts)
    sent = to_device(np.concatenate([owner, commit.reshape(-1)]), positions.device)
    owner_t = sent[: len(owner)]
    return owner_t, sent[len(owner):].view(len(seqs), width)[owner_t, positions].bool()


def first_stops(seqs: list[Sequence], rows: list[int], positions: Tensor, tokens: Tensor, conf: Tensor,
                owner: Tensor, counts: list[int]) -> Tensor:
    """[R]: per inspected row (``seqs[i]`` for i in ``rows``, whose ``counts`` candidates follow
    one another; ``owner`` maps each candidate to its row) the first position predicting a stop
    token with confidence >= its ``eos_threshold``, at or after ``prompt_len + min_length``;
    ``NO_STOP`` where none (the module's rule, for every row at once)."""
    dev = positions.device
    if len({frozenset(seqs[i].ids.stop_ids) for i in rows}) == 1:
        stop = torch.isin(tokens, seqs[rows[0]].stop_tensor())
    else:  # requests with their own stop ids
        stop = torch.cat([torch.isin(t, seqs[i].stop_tensor()) for i, t in zip(rows, tokens.split(counts))])
    threshold = torch.tensor([seqs[i].params.eos_threshold for i in rows], dtype=conf.dtype, device=dev)
    lowest = torch.tensor([seqs[i].prompt_len + seqs[i].params.min_length for i in rows], device=dev)
    stop &= (conf >= threshold[owner]) & (positions >= lowest[owner])
    first = torch.full((len(rows),), NO_STOP, dtype=torch.long, device=dev)
    return first.scatter_reduce(0, owner, torch.where(stop, positions, NO_STOP), "amin")


def cut_at(seq: Sequence, first: int) -> int | None:
    """New canvas length for a first confident stop at ``first``: the end of its block, never
    removing a committed non-stop token; None when that is the whole canvas."""
    end = next(e for s, e in seq.blocks if s <= first < e)
    end = max(end, last_kept_end(seq))
    return end if end < seq.canvas_len else None


def last_kept_end(seq: Sequence) -> int:
    """End of the block after the last committed non-stop generation token (0 when none)."""
    gen = seq.canvas[seq.prompt_len:]
    kept = np.flatnonzero(~seq.undecided[seq.prompt_len:] & ~np.isin(gen, seq.stop_array()))
    if not kept.size:
        return 0
    last = seq.prompt_len + int(kept[-1])
    return next(e for s, e in seq.blocks if s <= last < e)
