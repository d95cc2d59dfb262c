"""Which decoding step makes a phrased answer's canvas unfinishable, and did it commit ahead?

``frontier_probe`` reads the model along the gold answers, where no decoding error compounds. This
probe reads the decoder's own canvases: it decodes the held-out prompts of the phrased tasks with a
trace (recording every step, ``SamplingParams.record_steps``) and asks, after each step, whether the
canvas can still be completed into a phrasing the task generator can write (``check_trace`` on the
canvas: masked slots may take any word, a stop token may only follow the trace). Committing slots
never makes an unfinishable canvas finishable again, so each answer has one step that loses it (or
none, for a right answer); the probe finds it by bisection, twice: for the whole trace (values
checked) and for its form (phrasing alone, any word in the value slots).

Each step is counted as committing ahead (some slot it commits has a masked slot on its left once
it is done) or at the frontier only. Up to and including the losing step, the probe counts both
kinds and how many of each lost the canvas: if committing ahead is what breaks the phrasing, a step
that commits ahead loses the form far more often than one that commits at the frontier.

Under the plain threshold rule (commit every slot at or above the threshold, and at least the most
confident one), the probe also counts the steps at which no slot reached the threshold: the decoder
then commits its single most confident slot below it, and where that slot stands (ahead or at the
frontier) says whether a step's one token is the model's certainty or the rule's minimum. Counted
again over the steps that read a canvas whose form (or whole trace) was still finishable, the share
says whether the model is unsure only once its own canvas has gone wrong; over the steps that read
a canvas without a gap (no committed slot right of a masked one, the state the frontier probe reads
along the gold answers), whether it is unsure only around its own commits ahead.
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from dllm_engine.engine.llm import LLM, RequestOutput
from dllm_engine.engine.trace import MASK, StepRecord, canvas_frames
from dllm_engine.errors import UserError
from dllm_engine.sampling_params import SamplingParams
from ..tasks import TASKS, Example
from .chain_probe import probe_table


@dataclass
class Loss:
    """Where one answer's canvas stopped being finishable, for one grade."""
    lost: int = 0  # answers whose canvas became unfinishable
    lost_ahead: int = 0  # ... at a step that committed ahead
    ahead_steps: int = 0  # steps up to the loss (or the end) that committed ahead
    frontier_steps: int = 0  # ... that committed at the frontier only (or nothing)
    below_steps: int = 0  # ... whose commits were all below the threshold (counted where known)

    def count(self, ahead: list[bool], lost_at: int | None, below: list[bool] | None = None) -> None:
        """One answer: ``ahead[i]`` whether step i committed ahead, ``below[i]`` whether its
        commits were all below the threshold; ``lost_at`` the step after which its canvas was
        unfinishable (None: never). The steps up to the loss are those that read a finishable canvas."""
        end = len(ahead) if lost_at is None else lost_at + 1
        considered = ahead[:end]
        self.ahead_steps += sum(considered)
        self.frontier_steps += len(considered) - sum(considered)
        self.below_steps += sum((below or [])[:end])
        if lost_at is not None:
            self.lost += 1
            self.lost_ahead += int(ahead[lost_at])

    def as_dict(self, answers: int, prefix: str) -> dict:
        frontier_losses = self.lost - self.lost_ahead
        considered = self.ahead_steps + self.frontier_steps
        return {f"{prefix}_lost": round(self.lost / max(1, answers), 4),
                f"{prefix}_lost_ahead": round(self.lost_ahead / max(1, self.lost), 4),
                f"{prefix}_loss_per_ahead_step": round(self.lost_ahead / max(1, self.ahead_steps), 4),
                f"{prefix}_loss_per_frontier_step": round(frontier_losses / max(1, self.frontier_steps), 4),
                f"{prefix}_below_before_loss": round(self.below_steps / max(1, considered), 4)}


@dataclass
class CanvasRow:
    task: str
    answers: int = 0
    steps: int = 0  # decoding steps, all of them
    ahead: int = 0  # of them, steps that committed ahead
    # steps whose commits were all below the threshold (the rule's one forced slot), and of them
    # those that committed ahead; None where the decoder's rule is not the plain threshold
    below: int | None = None
    below_ahead: int | None = None
    # steps that read a canvas without a gap (no committed slot right of a masked one: the state a
    # left-to-right decoder reads, as the frontier probe does), and of them those below the threshold
    gapless: int = 0
    gapless_below: int | None = None
    form: Loss = field(default_factory=Loss)  # the form lost (phrasing, values unchecked)
    trace: Loss = field(default_factory=Loss)  # the whole trace lost (a phrasing or a value)

    def as_dict(self) -> dict:
        def share(part: int | None, whole: int) -> float | None:
            return None if part is None else round(part / max(1, whole), 4)
        out = {"task": self.task, "answers": self.answers, "ahead_steps": share(self.ahead, self.steps),
               "below_steps": share(self.below, self.steps), "below_ahead": share(self.below_ahead, self.below),
               "gapless_steps": share(self.gapless, self.steps),
               "gapless_below": share(self.gapless_below, self.gapless),
               **self.form.as_dict(self.answers, "form"), **self.trace.as_dict(self.answers, "trace")}
        if self.below is None:  # no threshold: nothing was counted below it
            out["form_below_before_loss"] = out["trace_below_before_loss"] = None
        return out


def first_masked(frame: list[int | None]) -> int:
    """The frame's first masked slot (its length when none is)."""
    return next((i for i, tok in enumerate(frame) if tok is MASK), len(frame))


def ahead_steps(frames: list[list[int | None]], records: list[StepRecord], prompt_len: int) -> list[bool]:
    """Per step: whether a slot it committed has a masked slot on its left once it is done."""
    return [any(c.position - prompt_len > frontier for c in record.committed)
            for frontier, record in zip(map(first_masked, frames), records)]


def gapless_reads(frames: list[list[int | None]]) -> list[bool]:
    """Per step: whether the canvas it read (the frame before it) had no committed slot right of a
    masked one."""
    return [True] + [all(tok is MASK for tok in f[first_masked(f):]) for f in frames[:-1]]


def below_threshold(records: list[StepRecord], threshold: float) -> list[bool]:
    """Per step: whether every slot it committed had a confidence below ``threshold``."""
    return [bool(r.committed) and all(c.confidence is not None and c.confidence < threshold
                                      for c in r.committed) for r in records]


def first_unfinishable(finishable, n: int) -> int | None:
    """The first of frames 0..n-1 that ``finishable(i)`` refuses, by bisection (it is monotone:
    once refused, every later frame is); None if the last frame is finishable."""
    if n == 0 or finishable(n - 1):
        return None
    lo, hi = 0, n - 1  # frame hi is refused; find the first
    while lo < hi:
        mid = (lo + hi) // 2
        if finishable(mid):
            lo = mid + 1
        else:
            hi = mid
    return lo


def refuse_untraced(tasks) -> None:
    """UserError naming any of ``tasks`` that is not a phrased task with a trace."""
    from ..tasks.phrased import PhrasedTask
    other = [t for t in dict.fromkeys(tasks) if not isinstance(TASKS[t], PhrasedTask)]
    if other:
        traced = ", ".join(n for n, t in TASKS.items() if isinstance(t, PhrasedTask))
        raise UserError(f"this reads the phrased tasks with a trace ({traced}), not {', '.join(other)}")


def decoded_canvases(llm: LLM, params: SamplingParams, examples: list[Example], batch_size: int,
                     progress=None) -> Iterator[tuple[Example, RequestOutput, list, list]]:
    """Decode ``examples`` with ``params`` (resolved, ``record_steps`` on) in batches and yield,
    per example, its output, the frames after each step (``canvas_frames``) and the same frames as
    ``check_trace`` reads canvases: a word per slot, ``None`` masked (the canvas's slots past a
    frame too), ``END`` a stop token. ``progress``: a bar advanced per batch."""
    from ..tasks.phrased import END
    stop_ids = llm.token_ids.stop_ids
    words = {}  # token id -> its word in a canvas

    def word(tok: int | None):
        if tok is MASK:
            return None
        if tok in stop_ids:
            return END
        if tok not in words:
            words[tok] = llm.token_text(tok).strip()
        return words[tok]

    for start in range(0, len(examples), batch_size):
        chunk = examples[start:start + batch_size]
        for ex, out in zip(chunk, llm.chat([e.chat() for e in chunk], params)):
            frames = canvas_frames(out.steps or [], len(out.prompt_token_ids))
            yield ex, out, frames, [tuple(map(word, f)) + (None,) * (params.max_new_tokens - len(f)) for f in frames]
        if progress is not None:
            progress.update(len(chunk))


def canvas_probe(llm: LLM, params: SamplingParams, examples: list[Example],
                 batch_size: int = 32) -> dict[str, CanvasRow]:
    """Per task, which steps of ``params``'s decoding made the canvas unfinishable (see the
    module's docstring); the phrased tasks with a trace only (``describe`` has no steps)."""
    from ..tasks.phrased import check_trace
    refuse_untraced(ex.task for ex in examples)
    if batch_size < 1:
        raise UserError(f"batch_size must be >= 1, got {batch_size}")
    params = llm.resolve(params.replace(record_steps=True))
    threshold = params.threshold if params.commit_rule is None else None  # the plain threshold rule
    rows: dict[str, CanvasRow] = {}
    for ex, out, frames, canvases in decoded_canvases(llm, params, examples, batch_size):
        task = TASKS[ex.task]
        steps = tuple(task.steps_of(ex))
        ahead = ahead_steps(frames, out.steps or [], len(out.prompt_token_ids))
        row = rows.setdefault(ex.task, CanvasRow(ex.task))
        row.answers += 1
        row.steps += len(ahead)
        row.ahead += sum(ahead)
        below = None if threshold is None else below_threshold(out.steps or [], threshold)
        gapless = gapless_reads(frames)
        row.gapless += sum(gapless)
        if below is not None:
            row.below = (row.below or 0) + sum(below)
            row.below_ahead = (row.below_ahead or 0) + sum(a and b for a, b in zip(ahead, below))
            row.gapless_below = (row.gapless_below or 0) + sum(g and b for g, b in zip(gapless, below))
        for loss, form in ((row.form, True), (row.trace, False)):
            lost_at = first_unfinishable(lambda i: check_trace(task, steps, canvases[i], form=form),
                                         len(canvases))
            loss.count(ahead, lost_at, below)
    return rows


CANVAS_COLUMNS = (("answers", "answers", "d"), ("ahead steps", "ahead_steps", ".1%"),
                  ("below threshold", "below_steps", ".1%"), ("of them ahead", "below_ahead", ".1%"),
                  ("below, form kept", "form_below_before_loss", ".1%"),
                  ("below, trace kept", "trace_below_before_loss", ".1%"),
                  ("gapless reads", "gapless_steps", ".1%"), ("below, gapless", "gapless_below", ".1%"),
                  ("form lost", "form_lost", ".1%"), ("at ahead", "form_lost_ahead", ".1%"),
                  ("per ahead step", "form_loss_per_ahead_step", ".2%"),
                  ("per frontier step", "form_loss_per_frontier_step", ".2%"),
                  ("trace lost", "trace_lost", ".1%"), ("at ahead", "trace_lost_ahead", ".1%"),
                  ("per ahead step", "trace_loss_per_ahead_step", ".2%"),
                  ("per frontier step", "trace_loss_per_frontier_step", ".2%"))


def canvas_table(rows: dict[str, CanvasRow]) -> str:
    return probe_table(rows, CANVAS_COLUMNS)
