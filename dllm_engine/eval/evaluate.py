"""Run a decoding method over a dataset's held-out prompts (``datasets``) or a prompts file's, with
the chat template; grade each answer by its example's own grades."""
from __future__ import annotations

import json
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from ..errors import UserError
from ..engine.llm import LLM
from ..engine.sequence import SequenceStats
from ..outputs import percent
from ..sampling_params import SamplingParams
from ..strategies.base import merge_diagnostics
from .. import datasets
from ..datasets import Prompt


@dataclass
class TaskResult:
    task: str
    num_prompts: int = 0
    correct: int = 0
    stats: SequenceStats = field(default_factory=SequenceStats)  # summed over the task's prompts
    final_correct: int | None = None  # final-answer-only grade; None for a task without one
    form_correct: int | None = None  # form-only grade (phrased tasks); None for a task without one
    graded: int = 0  # prompts with an answer to grade (a prompts file without answers: none)

    @property
    def accuracy(self) -> float | None:
        """Whole answers right over the prompts graded; None when none had an answer to grade."""
        if not self.graded:  # prompts without answers: not measured (no prompts yet: 0.0)
            return None if self.num_prompts else 0.0
        return self.correct / self.graded

    @property
    def final_accuracy(self) -> float | None:
        return self.share(self.final_correct)

    @property
    def form_accuracy(self) -> float | None:
        return self.share(self.form_correct)

    def share(self, count: int | None) -> float | None:
        """``count`` over the prompts (None for a grade the task does not have)."""
        if count is None:
            return None
        return count / self.num_prompts if self.num_prompts else 0.0

    def add(self, ok: bool | None, stats: SequenceStats, final_ok: bool | None = None,
            form_ok: bool | None = None) -> None:
        """One prompt's grades (``ok`` None: it had no answer to grade) and stats."""
        self.num_prompts += 1
        if ok is not None:
            self.graded += 1
            self.correct += int(ok)
        if final_ok is not None:
            self.final_correct = (self.final_correct or 0) + int(final_ok)
        if form_ok is not None:
            self.form_correct = (self.form_correct or 0) + int(form_ok)
        self.stats.add(stats)

    def row(self) -> dict:
        return {"task": self.task, "num_prompts": self.num_prompts, "accuracy": rounded(self.accuracy),
                "final_accuracy": rounded(self.final_accuracy), "form_accuracy": rounded(self.form_accuracy),
                "mean_output_tokens": round(self.stats.output_tokens / max(1, self.num_prompts), 2),
                "nfe": self.stats.nfe, "tokens_per_step": round(self.stats.tokens_per_step, 3),
                "answer_tokens_per_step": round(self.stats.answer_tokens_per_step, 3),
                "redundancy": round(self.stats.redundancy, 3),
                "stop_share": round(self.stats.stop_share, 4),
                "ahead_share": round(self.stats.ahead_share, 4),
                "mean_ahead_gap": round(self.stats.mean_ahead_gap, 2),
                "steps_by_commits": commit_histogram(self.stats)}


def rounded(share: float | None) -> float | None:
    """A share to 4 places, None (a grade not measured) kept."""
    return None if share is None else round(share, 4)


def mean_known(values) -> float | None:
    """The mean of the values that are not None (None if all are)."""
    known = [v for v in values if v is not None]
    return sum(known) / len(known) if known else None


COMMIT_BUCKETS = ((0, 0), (1, 1), (2, 2), (3, 4), (5, 8), (9, 16), (17, None))


def commit_histogram(stats: SequenceStats) -> dict[str, float]:
    """Share of steps by the number of tokens they committed (``"3-4"``: 3 or 4 tokens)."""
    steps = sum(stats.step_commits.values())
    out = {}
    for lo, hi in COMMIT_BUCKETS:
        n = sum(c for k, c in stats.step_commits.items() if k >= lo and (hi is None or k <= hi))
        out[f"{lo}+" if hi is None else str(lo) if lo == hi else f"{lo}-{hi}"] = round(n / max(1, steps), 4)
    return out


@dataclass
class EvalReport:
    method: str
    tasks: dict[str, TaskResult] = field(default_factory=dict)
    stats: SequenceStats = field(default_factory=SequenceStats)
    diagnostics: dict = field(default_factory=dict)  # from diagnostic strategies (focus-probe)
    outputs: list[list[int]] = field(default_factory=list)  # each prompt's answer token ids, in order

    @property
    def accuracy(self) -> float | None:
        """Mean of the per-task accuracies (None when no prompt had an answer to grade)."""
        return mean_known(t.accuracy for t in self.tasks.values()) if self.tasks else 0.0

    @property
    def final_accuracy(self) -> float | None:
        """Mean of the final-answer grades of the tasks that have one (None if none has)."""
        return mean_known(t.final_accuracy for t in self.tasks.values())

    @property
    def form_accuracy(self) -> float | None:
        """Mean of the form-only grades of the tasks that have one (None if none has)."""
        return mean_known(t.form_accuracy for t in self.tasks.values())

    @property
    def throughput(self) -> float:
        return self.stats.output_tokens / self.stats.seconds if self.stats.seconds else 0.0

    def as_dict(self) -> dict:
        return {"method": self.method, "accuracy": rounded(self.accuracy),
                "final_accuracy": rounded(self.final_accuracy), "form_accuracy": rounded(self.form_accuracy),
                "throughput": round(self.throughput, 2), **self.stats.as_dict(),
                "stop_share": round(self.stats.stop_share, 4),
                "ahead_share": round(self.stats.ahead_share, 4),
                "steps_by_commits": commit_histogram(self.stats),
                "tasks": [t.row() for t in self.tasks.values()],
                **({"diagnostics": self.diagnostics} if self.diagnostics else {})}

    def table(self) -> str:
        buckets = list(commit_histogram(self.stats))
        lines = [f"{'task':<10} {'n':>4} {'acc':>7} {'final':>7} {'form':>7} {'out_len':>8} {'nfe':>6} {'tok/step':>9} {'ans/step':>9} {'redund':>7} "
                 f"{'stop%':>6} {'ahead%':>6} | steps committing " + " ".join(f"{b:>5}" for b in buckets) + " tokens"]
        for t in self.tasks.values():
            r = t.row()
            lines.append(f"{t.task:<10} {t.num_prompts:>4} {percent(t.accuracy):>7} {percent(t.final_accuracy):>7} "
                         f"{percent(t.form_accuracy):>7} {r['mean_output_tokens']:>8.2f} "
                         f"{r['nfe']:>6} {r['tokens_per_step']:>9.2f} {r['answer_tokens_per_step']:>9.2f} {r['redundancy']:>7.2f} {r['stop_share']:>6.1%} {r['ahead_share']:>6.1%}"
                         f" | {'':>16} " + " ".join(f"{v:>5.0%}" for v in r["steps_by_commits"].values()))
        s = self.stats
        lines.append(f"{'mean':<10} {sum(t.num_prompts for t in self.tasks.values()):>4} {percent(self.accuracy):>7}"
                     f" {'' if self.final_accuracy is None else f'{self.final_accuracy:.1%}':>7}"
                     f" {'' if self.form_accuracy is None else f'{self.form_accuracy:.1%}':>7}"
                     f"   throughput {self.throughput:.1f} tok/s, redundancy {s.redundancy:.2f}, "
                     f"tokens/step {s.tokens_per_step:.2f}, answer tokens/step {s.answer_tokens_per_step:.2f}, stop share {s.stop_share:.1%}, "
                     f"committed ahead of the frontier {s.ahead_share:.1%}, {s.seconds:.1f} s")
        if self.diagnostics:
            lines.append("diagnostics: " + ", ".join(f"{k} {v}" for k, v in self.diagnostics.items()))
        return "\n".join(lines)


def sample_record(ex: Prompt, text: str, stats: SequenceStats, ok: bool | None, final_ok: bool | None,
                  form_ok: bool | None) -> dict:
    """One prompt's line of ``--samples``: what was asked, what was expected, what came out, its
    grades (None for a grade the task does not have) and its decoding counts."""
    return {"id": ex.id, "task": ex.task, "prompt": ex.prompt, "target": ex.answer, "output": text,
            "correct": ok, "final_correct": final_ok, "form_correct": form_ok, "nfe": stats.nfe,
            "output_tokens": stats.output_tokens, "decoded_tokens": stats.decoded_tokens,
            "ahead_tokens": stats.ahead_tokens}


def evaluate(llm: LLM, params: SamplingParams, tasks: str | list[str] | None = None, limit: int | None = None,
             batch_size: int = 32, use_tqdm: bool = True, examples: list[Prompt] | None = None,
             desc: str | None = None, samples: str | Path | None = None) -> EvalReport:
    """Accuracy and stats (``SequenceStats``) of ``params`` on ``examples`` (a dataset's, or a
    prompts file's: ``bench.prompts``), else on the held-out ``tasks`` of the default dataset
    (``datasets.load``, ``limit`` per task);
    ``use_tqdm``: a progress bar of the prompts done, named ``desc`` (default: eval METHOD);
    ``samples``: a JSON-lines file that gets every prompt's ``sample_record``, a batch at a time as
    it finishes (an interrupted run keeps the prompts it graded)."""
    if batch_size < 1:
        raise UserError(f"batch size must be >= 1, got {batch_size}")
    if params.n != 1:
        raise UserError(f"n={params.n}: an evaluation grades one answer per prompt; drop n")
    examples = examples if examples is not None else datasets.load(tasks, limit)
    params = llm.resolve(params)
    report = EvalReport(method=params.method)
    all_stats: list[SequenceStats] = []
    records: list[dict] = []
    # a named bar (a bench row's) gives way to the row it measures; closed on Ctrl-C or an error too
    with tqdm(total=len(examples), desc=desc or f"eval {params.method}", unit="prompt", disable=not use_tqdm,
              leave=desc is None) as bar, \
            (open(samples, "w", encoding="utf-8") if samples is not None else nullcontext()) as log:
        start = time.perf_counter()
        for i in range(0, len(examples), batch_size):
            chunk = examples[i:i + batch_size]
            outs = llm.chat([e.chat() for e in chunk], params)
            report.method, records = outs.method, records + [outs.diagnostics]
            for ex, out in zip(chunk, outs):
                ok, final_ok, form_ok = ex.grades(out.text)
                report.tasks.setdefault(ex.task, TaskResult(ex.task)).add(ok, out.stats, final_ok, form_ok)
                all_stats.append(out.stats)
                report.outputs.append(list(out.token_ids))
                if log is not None:
                    log.write(json.dumps(sample_record(ex, out.text, out.stats, ok, final_ok, form_ok)) + "\n")
            if log is not None:
                log.flush()
            bar.update(len(chunk))
    report.stats = SequenceStats.total(all_stats, time.perf_counter() - start)
    report.diagnostics = {k: v for rec in merge_diagnostics(records).values() for k, v in rec.summary().items()}
    return report
