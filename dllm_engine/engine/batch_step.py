"""The batch-shaped step of a forward group that runs a base decoder as it is (no strategy, no
named commit rule, no classifier-free guidance): its cost in tensor ops and device reads does not
grow with the batch.

As nano-vllm's model runner does, the step's inputs are built on the host from the sequences'
host state (``Sequence.canvas`` and ``undecided`` are NumPy arrays, the cursor plain ints): one
array per input, padded to [B, T], sent to the device in one copy. The device runs the forward,
the LM head over the candidates (their rows into the hidden state are known on the host: no read
to find them) and the commit rule for every row at once (``GroupRules``). One read brings each
candidate's token and whether it commits back to the host, where each sequence's turn writes its
canvas, stats and cursor in NumPy. A trace (``record_steps``) or logprobs add one read, paid only
by the groups whose requests ask for them.

Layout per row: canvas positions [lo, hi) of the decoder's cache policy (``compute_range``), the
slots the same positions, the key limit block-causal or the whole canvas, the candidates the
block's undecided positions (read at slot ``position - shift``: Dream's shift). A fixed-shape
step (``engine/shapes.py``) pads B, T and the key count to their buckets, always with a mask.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from ..decoding.decide import GroupRules, read_commits
from ..decoding.decoders import after_step, host_span
from .runner import Runner, StepInputs
from .sequence import Sequence, to_device
from .shapes import bucket

# the fields of StepInputs built on the host as [B, T] int64, sent in one copy
ROW_FIELDS = ("token_ids", "positions", "slots", "key_limit", "valid")


def batchable(seq: Sequence) -> bool:
    """Whether the batched step runs ``seq``'s step: its decoder's own commit rule (no named
    rule), one canvas (no CFG). Strategies are the pipeline's to say (``Engine.step_group``)."""
    return seq.params.commit_rule is None and seq.params.cfg_scale == 0


@dataclass
class HostStep:
    """One step of a group as host arrays: what it computes and which candidates it predicts."""
    inputs: dict[str, np.ndarray]  # ROW_FIELDS, each [R, T]
    lengths: list[int]  # live tokens per row (R, padding rows 0)
    num_keys: int
    masked: bool  # some query sees fewer than num_keys keys
    span: tuple[int, int] | None
    candidates: list[np.ndarray]  # per sequence, the canvas positions it predicts
    logit_index: np.ndarray  # [K] flat index into [R * T] of each candidate's hidden row


def plan(seqs: list[Sequence], runner: Runner) -> HostStep:
    """The group's step, planned on the host."""
    shift, fixed = runner.shift, runner.fixed_shapes
    spans = [host_span(s, shift) for s in seqs]
    lengths = [len(positions) for positions, _ in spans]
    rows = runner.batch_rows(len(seqs)) if fixed else len(seqs)
    width = bucket(max(lengths)) if fixed else max(lengths)
    arrays = {name: np.zeros((rows, width), dtype=np.int64) for name in ROW_FIELDS}
    arrays["key_limit"][:] = 1  # padding: sees key 0 only (never read: not valid)
    candidates, flat = [], []
    for i, (seq, (positions, limit)) in enumerate(zip(seqs, spans)):
        n = len(positions)
        for name, value in (("token_ids", seq.canvas[positions]), ("positions", positions), ("slots", positions),
                            ("key_limit", limit), ("valid", 1)):
            arrays[name][i, :n] = value
        wanted = seq.masked_index()
        at = wanted - shift - positions[0]  # the column whose output predicts each candidate
        if at.size and (at.min() < 0 or at.max() >= n):
            raise RuntimeError(f"sequence {seq.seq_id}: a candidate's logits come from a token the step "
                               f"does not compute (columns {at.tolist()} of {n})")
        candidates.append(wanted)
        flat.append(i * width + at)
    top = max(int(limit.max()) for _, limit in spans)
    low = min(int(limit.min()) for _, limit in spans)
    num_keys = bucket(top) if fixed else top
    starts = {int(positions[0]) for positions, _ in spans}
    whole = not fixed and min(lengths) == width and len(starts) == 1  # every row writes [lo, lo + width)
    span = (min(starts), min(starts) + width) if whole else None
    return HostStep(arrays, lengths + [0] * (rows - len(seqs)), num_keys, fixed or low < top, span,
                    candidates, np.concatenate(flat))


def inputs(host: HostStep, device: torch.device, fixed: bool) -> tuple[StepInputs, Tensor]:
    """The step's tensors from its host arrays in one copy, and the candidates' canvas positions."""
    rows, width = host.inputs["positions"].shape
    grid = len(ROW_FIELDS) * rows * width
    packed = np.concatenate([np.stack([host.inputs[name] for name in ROW_FIELDS]).reshape(-1), host.logit_index,
                             *host.candidates])
    sent = to_device(packed, device)
    token_ids, positions, slots, limit, valid = sent[:grid].view(len(ROW_FIELDS), rows, width).unbind(0)
    logit_index, candidates = sent[grid:].view(2, -1).unbind(0)
    mask = None
    if host.masked:
        keys = torch.arange(host.num_keys, device=device)
        mask = (keys[None, None, :] < limit[:, :, None])[:, None]  # [R, 1, T, S]
    step = StepInputs(token_ids=token_ids, positions=positions, valid=valid.bool(), mask=mask,
                      num_keys=host.num_keys, slots=slots, lengths=host.lengths, logit_slots=None,
                      slot_span=host.span, fixed_shapes=fixed, logit_index=logit_index)
    return step, candidates


def twins(seqs: list[Sequence], shift: int) -> list[int] | None:
    """For each row, the row whose forward it shares (itself when none), or None when no row
    shares. Rows at their first step whose canvases (prompt and masks), computed spans, key
    limits and candidates are equal compute the same forward: the ``n`` copies of one request,
    one prompt sent together. Exact: the forward of a row depends on nothing but these and its
    cache, which holds nothing before the first step but what the prefix store gave, itself a
    function of the canvas. Later steps differ (each copy commits its own draws)."""
    source, seen = list(range(len(seqs))), {}
    for i, seq in enumerate(seqs):
        if seq.stats.nfe == 0:
            positions, limit = host_span(seq, shift)
            key = (seq.canvas.tobytes(), positions.tobytes(), limit.tobytes(), seq.masked_index().tobytes())
            source[i] = seen.setdefault(key, i)
    return source if any(j != i for i, j in enumerate(source)) else None


def step_group(runner: Runner, seqs: list[Sequence], cache) -> None:
    """One batch-shaped step of a forward group (the replay contract of ``Engine.step_group``:
    nothing changes a sequence before its turn; a turn that raises marks its sequence). Rows
    that share their first forward (``twins``) run it once: the forward covers the other rows,
    its K/V are copied into the sharing rows and its logits repeated for them, each of which
    then draws and commits with its own seed."""
    fixed = runner.fixed_shapes
    source = twins(seqs, runner.shift) if runner.shares_forwards and isinstance(cache.rows, slice) else None
    computed = seqs if source is None else [s for i, s in enumerate(seqs) if source[i] == i]
    host = plan(computed, runner)
    device = next(runner.model.parameters()).device
    step, positions = inputs(host, device, fixed)
    group = cache
    if source is not None:
        cache = shared_rows(group, source, len(host.lengths))
    elif len(host.lengths) > len(seqs):
        cache = cache.widen(len(host.lengths))
    _, _, logits, _ = runner.run(step, runner.context(step, cache, None))
    work = [n * runner.num_layers for n in host.lengths]
    if source is not None:
        logits, positions, host, work = repeat_shared(group, source, host, logits, positions, work)
    counts = [c.size for c in host.candidates]
    rules = GroupRules(seqs, counts, [s.stats.nfe + 1 for s in seqs], device)  # the keys of this forward
    logits, x0, conf = rules.predict(logits, positions, owned=True)  # fresh from the LM head
    where, committed, tokens = read_commits(rules.select(conf), x0, positions, counts)  # the step's one read
    chosen = np.zeros(len(x0), dtype=bool)
    chosen[where] = True
    probs = recorded_probs(seqs, counts, logits, x0, chosen)
    logprobs = recorded_logprobs(seqs, counts, logits, x0, chosen)
    for i, seq in enumerate(seqs):
        try:
            if source is not None and source[i] != i:  # its prompt's K/V came from another row
                seq.stats.cached_tokens = seq.prompt_len
            turn(runner, seq, work[i], committed[i], tokens[i], probs.get(i), logprobs.get(i))
        except Exception as e:
            seq.step_error = e
            raise


def shared_rows(view, source: list[int], rows: int):
    """The pool rows the forward over the computed rows (those their own ``source``) runs on:
    theirs, then as padding (a fixed-shape step's spare rows; padding writes only the sink)
    the group's other rows and the pool's spare rows after it."""
    start, group = view.rows.start, len(source)
    own = [start + i for i, j in enumerate(source) if i == j]
    rest = [start + i for i, j in enumerate(source) if i != j] + list(range(start + group, view.cache.num_rows))
    return view.cache.select(own + rest[: rows - len(own)])


def repeat_shared(view, source: list[int], host: HostStep, logits: Tensor, positions: Tensor, work: list[float]
                  ) -> tuple[Tensor, Tensor, HostStep, list[float]]:
    """After a forward over the computed rows (``view``: the group's rows): their K/V copied
    into the rows sharing them (the positions each forward row wrote), and the step's
    candidates, logits and work laid out for every row of the group (a sharing row computed
    nothing: work 0)."""
    start = view.rows.start
    index = {i: k for k, i in enumerate(i for i, j in enumerate(source) if i == j)}  # group row -> forward row
    spans: dict[tuple[int, int], list[int]] = {}
    for i, j in enumerate(source):
        if i != j:
            written = host.inputs["positions"][index[j], : host.lengths[index[j]]]
            spans.setdefault((int(written.min()), int(written.max()) + 1), []).append(i)
    for (lo, hi), rows in spans.items():
        view.cache.copy_rows([start + source[i] for i in rows], [start + i for i in rows], lo, hi)
    rows = [index[j] for j in source]
    take = to_device(candidate_rows([c.size for c in host.candidates], rows), logits.device)
    full = HostStep(host.inputs, host.lengths, host.num_keys, host.masked, host.span,
                    [host.candidates[k] for k in rows], host.logit_index)
    return logits[take], positions[take], full, [work[index[i]] if j == i else 0.0 for i, j in enumerate(source)]


def candidate_rows(counts: list[int], rows: list[int]) -> np.ndarray:
    """Indices into the K candidates of the candidates of ``rows``."""
    starts = np.cumsum([0, *counts[:-1]])
    return np.concatenate([np.arange(starts[i], starts[i] + counts[i]) for i in rows])


def committed_per_row(counts: list[int], rows: list[int], chosen: np.ndarray) -> list[int]:
    """How many candidates of each of ``rows`` commit (``chosen`` [K])."""
    return [int(chosen[candidate_rows(counts, [i])].sum()) for i in rows]


def split_rows(values: np.ndarray, sizes: list[int], rows: list[int]) -> dict[int, np.ndarray]:
    """``values`` laid out row after row (``sizes`` each) as a dict by row."""
    return dict(zip(rows, np.split(values, np.cumsum(sizes)[:-1])))


def recorded_probs(seqs: list[Sequence], counts: list[int], logits: Tensor, x0: Tensor, chosen: np.ndarray
                   ) -> dict[int, np.ndarray]:
    """A trace's probabilities of its committed tokens (softmax of the mask-excluded logits),
    by row, for the rows that record steps: one read, only when some do."""
    rows = [i for i, s in enumerate(seqs) if s.trace is not None and counts[i]]
    if not rows:
        return {}
    index = candidate_rows(counts, rows)
    index = index[chosen[index]]
    at = to_device(index, logits.device)
    probs = torch.softmax(logits[at], dim=-1).gather(-1, x0[at][:, None])[:, 0]
    return split_rows(probs.cpu().numpy(), committed_per_row(counts, rows, chosen), rows)


def recorded_logprobs(seqs: list[Sequence], counts: list[int], logits: Tensor, x0: Tensor, chosen: np.ndarray
                      ) -> dict[int, tuple[list, list, list]]:
    """The committed tokens' logprobs and the top ``params.logprobs`` of their rows, for the rows
    whose requests ask: (chosen logprobs, top ids, top logprobs), one read, only when some ask."""
    rows = [i for i, s in enumerate(seqs) if s.params.logprobs is not None and counts[i]]
    if not rows:
        return {}
    index = candidate_rows(counts, rows)
    index = index[chosen[index]]
    sizes = committed_per_row(counts, rows, chosen)
    top_k = max(seqs[i].params.logprobs for i in rows)
    at = to_device(index, logits.device)
    logp = torch.log_softmax(logits[at], dim=-1)
    top = logp.topk(top_k, dim=-1)
    read = torch.cat([logp.gather(-1, x0[at][:, None]), top.values, top.indices.to(logp.dtype)], 1).cpu().numpy()
    out = {}
    for i, part in split_rows(read, sizes, rows).items():
        k = seqs[i].params.logprobs
        out[i] = (part[:, 0].tolist(), part[:, 1 + top_k: 1 + top_k + k].astype(np.int64).tolist(),
                  part[:, 1: 1 + k].tolist())
    return out


def turn(runner: Runner, seq: Sequence, work: float, positions: np.ndarray, tokens: np.ndarray,
         probs: np.ndarray | None, logprobs: tuple | None) -> None:
    """Everything the step changes on ``seq``, in ``Engine.turn``'s order: its stats, the
    decoder's record, the commit (the canvas ``positions`` it commits, their ``tokens``, for a
    trace their ``probs``, for logprobs what ``recorded_logprobs`` read), the trace, the cursor."""
    runner.account(seq, work)
    after_step(seq)
    seq.commit(positions, tokens, confidence=probs)
    if logprobs is not None:
        seq.add_logprobs(positions, *logprobs)
    if seq.trace is not None:
        seq.record_step({})
    seq.advance()
