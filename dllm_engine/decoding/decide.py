"""The decoders' own commit rules over a whole forward group at once.

Every step of every decoder ends the same way: the candidates' logits become tokens (argmax,
or a counter-keyed Gumbel draw, ``rules.sample_tokens``), each token gets a confidence under the
request's ``remasking`` rule (a strategy may reweigh it), and each sequence commits those its
rule selects: fixed-k, threshold with a minimum k, or Fast-dLLM's factor rule
(``threshold_rule``). ``GroupRules`` holds what decides that for B sequences, built on
the host once per step, and runs it in a fixed number of tensor ops whatever B is: the rules
are per-row tensors, not Python branches per row. Rows whose sampling options differ (temperature,
top-k, top-p, remasking) draw in one pass per distinct option set.

A row's tokens and selection depend on its own candidates and keys only (every op is row-wise:
the padded [B, M] selection ranks within a row), so a sequence commits the same alone, in any
batch and in any row order. The engine's batched step, its per-sequence commit and its
per-group commit all decide through this class: the one place a decoder's rule is applied."""
from __future__ import annotations

import math

import numpy as np
import torch
from torch import Tensor

from ..engine.sequence import Sequence, to_device
from ..sampling_params import SamplingParams
from .noise import Noise
from .rules import confidence, rank_in_row, sample_tokens, without_mask


def uses_factor(p: SamplingParams) -> bool:
    """Fast-dLLM's factor rule decides the commit (a full-attention decoder, no threshold)."""
    return p.decoder.supports_factor and p.threshold is None and p.factor is not None


def threshold_rule(seq: Sequence) -> tuple[float, int] | None:
    """The commit rule of ``seq`` as (threshold, min_k): every candidate with confidence >=
    threshold, or the top min_k when fewer pass (a top-k rule is threshold inf); None for the
    factor rule."""
    p = seq.params
    if p.decoder.unmasking:
        k = max(seq.tokens_this_step(), 1)
        return (math.inf, k) if p.unmasking == "low_confidence_static" else (p.threshold, k)
    if p.threshold is not None:
        return p.threshold, 1  # the fixed-k share is not needed
    if uses_factor(p):
        return None
    return math.inf, seq.tokens_this_step()


def signature(seq: Sequence) -> tuple:
    """The options that decide how a row draws: rows that share them draw in one pass."""
    p = seq.params
    return p.temperature, p.top_k, p.top_p, p.remasking


class GroupRules:
    """The commit rules of B sequences with ``counts`` candidates each (K in all, one after
    another), as host arrays sent to ``device`` in one copy; ``forwards``: each sequence's
    forward index for the sampling keys (``stats.nfe`` once this step's forward is accounted);
    ``salts``: a key part per row that tells apart rows of one sequence in one forward
    (jump-share's copies: the copy's index; none: 0)."""

    def __init__(self, seqs: list[Sequence], counts: list[int], forwards: list[int], device: torch.device,
                 salts: list[int] | None = None) -> None:
        self.device = device
        self.num_rows, self.width = len(seqs), max(counts, default=0)
        self.row = row = np.repeat(np.arange(len(seqs)), counts)  # [K] each candidate's row
        starts = np.cumsum([0, *counts[:-1]])
        column = np.arange(len(row)) - np.repeat(starts, counts)  # [K] index within its row
        rules = [threshold_rule(s) for s in seqs]
        self.any_factor = any(r is None for r in rules)
        factor = np.array([s.params.factor if r is None else math.nan for s, r in zip(seqs, rules)])
        threshold = np.array([math.inf if r is None else r[0] for r in rules])
        k = np.array([0 if r is None else r[1] for r in rules], dtype=np.int64)
        masks = np.array([s.ids.mask_id for s in seqs], dtype=np.int64)
        self.mask_id = int(masks[0]) if (masks == masks[0]).all() else None  # one mask id: a column
        self.signatures: dict[tuple, list[int]] = {}  # option set -> its rows
        for i, s in enumerate(seqs):
            self.signatures.setdefault(signature(s), []).append(i)
        seeds, steps = np.array([s.seed for s in seqs], dtype=np.int64), np.array(forwards, dtype=np.int64)
        # one buffer: per candidate (row, column, mask id, seed, forward[, salt]), per row (k,
        # count, threshold and factor as float64 bits)
        n, b = len(row), len(seqs)
        keys = [row, column, masks[row], seeds[row], steps[row]]
        if salts is not None:
            keys.append(np.asarray(salts, dtype=np.int64)[row])
        packed = np.concatenate([*keys, k, np.asarray(counts, dtype=np.int64), threshold.view(np.int64),
                                 factor.view(np.int64)])
        sent = to_device(packed, device)
        per_candidate, rest = sent[: len(keys) * n].view(len(keys), n), sent[len(keys) * n:]
        self.row_t, self.column_t, self.masks_t, self.seeds_t, self.steps_t = per_candidate[:5]
        self.salts_t = per_candidate[5] if salts is not None else None
        self.k_t, self.counts_t = rest[:b], rest[b: 2 * b]
        self.floats_t = rest[2 * b:].view(torch.float64).view(2, b)  # threshold, factor

    def predict(self, logits: Tensor, positions: Tensor, owned: bool = False) -> tuple[Tensor, Tensor, Tensor]:
        """(the candidates' logits with the mask excluded; the token x0 [K] each draws; its
        confidence [K]) from logits [K, V] at canvas ``positions`` [K]. The logits returned are a
        new tensor unless ``owned`` (the caller built them for this: the mask is excluded in place)."""
        logits = self.without_mask(logits, owned)
        return (logits, *self.tokens(logits, positions))

    def without_mask(self, logits: Tensor, owned: bool = False) -> Tensor:
        """``logits`` [K, V] with each row's mask token excluded (``rules.without_mask``)."""
        return without_mask(logits, self.masks_t if self.mask_id is None else self.mask_id, owned)

    def per_row(self, values: list[list[float]]) -> Tensor:
        """float32 [F, B] on the device from F lists of one value per row (a rule's options), in one copy."""
        return to_device(np.asarray(values, dtype=np.float32).reshape(len(values), self.num_rows), self.device)

    def tokens(self, logits: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        """(the token x0 [K] each candidate draws from ``logits`` [K, V], the mask already
        excluded; its confidence [K]) under its row's sampling options."""
        if len(self.signatures) == 1:
            (options,) = self.signatures
            return self.draw(logits, positions, options, None)
        x0 = torch.empty(logits.shape[0], dtype=torch.long, device=logits.device)
        conf = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
        for options, rows in self.signatures.items():
            index = np.flatnonzero(np.isin(self.row, rows))
            if not index.size:
                continue
            at = to_device(index, self.device)
            tokens, c = self.draw(logits[at], positions[at], options, at)
            x0.index_copy_(0, at, tokens)
            conf.index_copy_(0, at, c.float())
        return x0, conf

    def draw(self, logits: Tensor, positions: Tensor, options: tuple, at: Tensor | None) -> tuple[Tensor, Tensor]:
        """x0 and its confidence for candidates that share ``options`` (``at``: which of the K
        they are; None: all)."""
        temperature, top_k, top_p, remasking = options
        noise = None
        if temperature != 0 or remasking == "random":
            seeds, steps, salts = ((self.seeds_t, self.steps_t, self.salts_t) if at is None else
                                   (self.seeds_t[at], self.steps_t[at], None if self.salts_t is None else self.salts_t[at]))
            noise = Noise(seeds, positions.long(), steps, salts)
        x0 = sample_tokens(logits, temperature, noise, top_k, top_p)
        return x0, confidence(logits, x0, remasking, noise)

    def select(self, conf: Tensor, eligible: Tensor | None = None) -> Tensor:
        """bool [K]: which candidates their rows commit, from confidences [K]: every one at or
        above the row's threshold, or its top k when fewer pass (fixed-k: threshold inf); the
        factor rule's k is the largest n whose n-th highest confidence is >= 1 - factor / (n + 1)
        (at least 1). Ties go to the lower index; thresholds compare in conf's dtype.
        ``eligible`` [K] bool: only these candidates take part (the others are never chosen and
        not counted), as if each row held its eligible ones alone."""
        dev, width = conf.device, self.width
        row, column, k, counts = self.row_t, self.column_t, self.k_t, self.counts_t
        threshold, factor = self.floats_t.to(conf.dtype).unbind(0)
        padded = torch.full((self.num_rows, width), -math.inf, dtype=conf.dtype, device=dev)
        valid = torch.arange(width, device=dev)[None] < counts[:, None]  # [B, W] a candidate
        ranked_valid = valid  # [B, W] a candidate among the row's eligible ones, sorted
        if eligible is not None:  # the others count as absent (finite confidences rank first)
            conf = conf.masked_fill(~eligible, -math.inf)
            valid = torch.zeros_like(valid).index_put_((row, column), eligible)
            counts = torch.zeros_like(counts).index_add_(0, row, eligible.long())
            ranked_valid = torch.arange(width, device=dev)[None] < counts[:, None]
        padded[row, column] = conf
        if self.any_factor:  # rows whose factor is not nan take their k from it
            n = torch.arange(1, width + 1, device=dev, dtype=conf.dtype)
            ranked = padded.sort(dim=1, descending=True, stable=True).values
            ok = (ranked >= 1 - factor[:, None] / (n + 1)) & ranked_valid
            fitted = (ok * n).amax(1).clamp(min=1).long()
            k = torch.where(torch.isnan(factor), k, fitted)
        passed = (padded >= threshold[:, None]) & valid
        top = (rank_in_row(padded, valid) < k[:, None]) & valid
        enough = passed.sum(1) >= torch.minimum(k, counts)
        return torch.where(enough[:, None], passed, top)[row, column]


def read_commits(chosen: Tensor, x0: Tensor, positions: Tensor, counts: list[int]
                 ) -> tuple[np.ndarray, list[np.ndarray], list[np.ndarray]]:
    """A group's commit on the host in one read: (the indices into the K candidates of those
    that commit; per row, their canvas positions; per row, their tokens), for rows of ``counts``
    candidates each (``select``'s flags [K], the tokens ``x0`` [K], ``positions`` [K])."""
    flags, tokens, where_at = torch.stack([chosen.long(), x0, positions.long()]).cpu().numpy()
    where = np.flatnonzero(flags)
    ends = np.searchsorted(where, np.cumsum(counts)[:-1])
    return where, np.split(where_at[where], ends), np.split(tokens[where], ends)
