"""Per-step decoding traces: ``SamplingParams(record_steps=True)`` gives each output ``steps``, one
``StepRecord`` per forward of its sequence (docs/traces.md).

A sequence that records carries a ``StepTrace`` (``Sequence.trace``; None otherwise, so a run
that records nothing pays one ``is None`` check per commit and per step). ``Sequence.commit``
hands it the committed slots; the engine closes the step after the strategies' ``after_commit``
with what each strategy reports (``Strategy.step_record``). Token text is added where a
tokenizer exists (``with_text``), after the run: the engine never decodes.

``replay`` rebuilds the output tokens from the records alone (tests check it equals the output
for every decoder and strategy); ``canvas_frames`` gives the canvas after each step (the
playground animates them); ``format_steps`` is ``dllm generate --show-steps``'s text view.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field, replace

import numpy as np
import torch
from torch import Tensor

MASK = None  # a slot not committed yet, in ``canvas_frames``


@dataclass
class Commit:
    """One slot committed by a step."""
    position: int  # canvas index (the answer's first slot is ``prompt_len``)
    token_id: int
    # the model's probability of the token in the logits it was drawn from (softmax before
    # temperature / top-k / top-p, the mask token excluded); jump-share's accepted drafts: the
    # probability at the step that drafted them
    confidence: float | None
    text: str | None = None  # the token's text, where the model has a tokenizer


@dataclass
class StepRecord:
    """One forward of one sequence and what it committed."""
    step: int  # this sequence's forward index, from 0
    block: int  # index of the block the step decoded
    block_start: int  # the block's canvas slots [block_start, block_end)
    block_end: int
    block_step: int  # step inside the block, from 0
    canvas_len: int  # canvas length after the step (adaptive length may cut it)
    processed_tokens: float  # tokens the forward computed, averaged over layers (as SequenceStats counts them)
    seconds: float  # wall clock from the sequence's admission to the end of this step (varies by run)
    committed: list[Commit] = field(default_factory=list)
    # what each strategy did this step, by strategy name (``Strategy.step_record``); a strategy
    # that did nothing visible this step is absent
    strategies: dict[str, dict] = field(default_factory=dict)

    def as_dict(self) -> dict:
        """Plain JSON data (the server's ``steps`` field)."""
        return asdict(self)


class StepTrace:
    """The recorder of one sequence: commits collect until the engine closes the step."""

    def __init__(self) -> None:
        self.records: list[StepRecord] = []
        self.pending: list[Commit] = []
        self.processed_before = 0.0

    def commit(self, positions: np.ndarray, tokens: np.ndarray, logits: Tensor | None,
               confidence: np.ndarray | None) -> None:
        """Slots committed by the current step (host arrays); ``confidence`` [N] wins over the
        probabilities of ``tokens`` in ``logits`` [N, V]."""
        if confidence is None and logits is not None:
            probs = torch.softmax(logits.float(), dim=-1)
            confidence = probs.gather(-1, torch.as_tensor(tokens, device=probs.device)[:, None])[:, 0]
        confs = confidence.tolist() if confidence is not None else [None] * len(positions)
        for pos, tok, conf in zip(positions.tolist(), tokens.tolist(), confs):
            self.pending.append(Commit(pos, tok, conf))

    def end_step(self, block: int, span: tuple[int, int], block_step: int, canvas_len: int, processed: float,
                 seconds: float, strategies: dict[str, dict]) -> None:
        """Close the step just committed (``Sequence.record_step``, before ``Sequence.advance``
        moves the cursor): its block (index and canvas ``span``), the step within it, the canvas
        length, the sequence's processed tokens so far and seconds since it started."""
        self.records.append(StepRecord(
            step=len(self.records), block=block, block_start=span[0], block_end=span[1],
            block_step=block_step, canvas_len=canvas_len,
            processed_tokens=round(processed - self.processed_before, 4),
            seconds=round(seconds, 6),
            committed=sorted(self.pending, key=lambda c: c.position), strategies=strategies))
        self.pending = []
        self.processed_before = processed


def with_text(records: list[StepRecord], decode: Callable[[int], str]) -> list[StepRecord]:
    """Copies of ``records`` whose commits carry ``decode(token_id)``."""
    return [replace(r, committed=[replace(c, text=decode(c.token_id)) for c in r.committed])
            for r in records]


def without_time(records: Iterable[dict]) -> list[dict]:
    """Record dicts less ``seconds``: what two runs of one request share."""
    return [{k: v for k, v in r.items() if k != "seconds"} for r in records]


def record_from_dict(data: dict) -> StepRecord:
    """A ``StepRecord`` back from ``as_dict`` (the server's JSON)."""
    commits = [Commit(**c) for c in data["committed"]]
    return StepRecord(**{**data, "committed": commits})


def replay(records: Iterable[StepRecord], prompt_len: int, max_new_tokens: int,
           stop_ids: Iterable[int]) -> list[int]:
    """The output tokens the records rebuild: the committed slots from ``prompt_len`` on, up to
    the first stop token, the first slot never committed (the engine fills those with EOS when
    the sequence finishes), the canvas end, or ``max_new_tokens``."""
    records = list(records)
    tokens: dict[int, int] = {}
    for r in records:
        for c in r.committed:
            if c.position in tokens:
                raise ValueError(f"slot {c.position} committed twice (steps of one sequence?)")
            tokens[c.position] = c.token_id
    end = min(prompt_len + max_new_tokens, records[-1].canvas_len if records else prompt_len)
    stops, out = set(stop_ids), []
    for pos in range(prompt_len, end):
        tok = tokens.get(pos)
        if tok is None or tok in stops:
            break
        out.append(tok)
    return out


def canvas_frames(records: list[StepRecord], prompt_len: int) -> list[list[int | None]]:
    """The answer's slots after each step (``MASK`` where none committed yet): frame k is the
    canvas after step k, cut to that step's canvas length."""
    frames, slots = [], {}
    for r in records:
        for c in r.committed:
            slots[c.position] = c.token_id
        frames.append([slots.get(p, MASK) for p in range(prompt_len, r.canvas_len)])
    return frames


def summary(strategies: dict[str, dict]) -> str:
    """``focus evicted=12 | jump-share copies=4 accepted=1``: lists counted."""
    parts = []
    for name, rec in strategies.items():
        values = " ".join(f"{k}={len(v) if isinstance(v, list) else v}" for k, v in rec.items())
        parts.append(f"{name} {values}".strip())
    return " | ".join(parts)


def commit_runs(commits: list[Commit], prompt_len: int) -> list[str]:
    """Commits as text, a run of one token at adjacent slots merged (its lowest confidence):
    ``#5 'b' .97``, ``#32-63 '<|endoftext|>' x32 1.00``."""
    runs: list[list[Commit]] = []
    for c in commits:
        last = runs[-1][-1] if runs else None
        if last is not None and c.token_id == last.token_id and c.position == last.position + 1:
            runs[-1].append(c)
        else:
            runs.append([c])
    out = []
    for run in runs:
        first, n = run[0], len(run)
        where = f"#{first.position - prompt_len}" + (f"-{run[-1].position - prompt_len}" if n > 1 else "")
        token = repr(first.text) if first.text is not None else str(first.token_id)
        confs = [c.confidence for c in run if c.confidence is not None]
        conf = f" {min(confs):.2f}".replace(" 0.", " .") if confs else ""
        out.append(f"{where} {token}" + (f" x{n}" if n > 1 else "") + conf)
    return out


def format_steps(records: list[StepRecord], prompt_len: int, width: int = 120) -> str:
    """``dllm generate --show-steps``: one line per forward, answer slots counted from 0.

    ``step   3  block 0.2  +2   #5 'b' .97  #6 'c' .91  | focus evicted=12``"""
    lines = [f"{len(records)} steps (block.step, +committed, then #answer slot, token, confidence)"]
    for r in records:
        head = f"step {r.step:>3}  block {r.block}.{r.block_step:<3} +{len(r.committed):<3}"
        line = f"{head} " + "  ".join(commit_runs(r.committed, prompt_len))
        if len(line) > width:
            line = line[: width - 3] + "..."
        extra = summary(r.strategies)
        lines.append(f"{line}  | {extra}" if extra else line)
    return "\n".join(lines)
