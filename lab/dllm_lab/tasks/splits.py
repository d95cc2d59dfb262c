"""Held-out split I/O, the training stream and grading helpers.

The test split is committed as JSONL so evaluation numbers never depend on generator
code drifting; ``write_split`` regenerates it bit-for-bit and a test checks that. Test
rows are seeded from the ``test-`` namespace and training from ``train-``, and training
additionally skips any prompt that appears in the committed test files.
"""
from __future__ import annotations

import functools
import json
import random
from collections.abc import Iterator
from pathlib import Path

from dllm_engine.errors import UserError
from .generators import Example
from .registry import TASK_NAMES, TASKS, resolve_tasks

DATA_DIR = Path(__file__).resolve().parent / "data"


def generate_split(task: str, n: int, split: str = "test") -> list[Example]:
    """Generate ``n`` distinct-prompt rows for ``task`` from the ``{split}-`` seed namespace."""
    gen = TASKS[resolve_tasks([task])[0]]
    rows: list[Example] = []
    seen: set[str] = set()
    i = 0
    while len(rows) < n:  # skip repeats so the split measures n different prompts
        ex = gen.generate(random.Random(f"{split}-{task}-{i}"))
        i += 1
        if ex.prompt not in seen:
            seen.add(ex.prompt)
            rows.append(Example(ex.task, ex.prompt, ex.answer, id=f"{task}-{len(rows):03d}"))
    return rows


def write_split(dir: str | Path, n: int = 100, split: str = "test") -> list[Path]:
    """Write ``<dir>/<task>.jsonl`` for every task; returns the written paths."""
    if n < 1:
        raise UserError(f"n must be >= 1, got {n}")
    out = Path(dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for task in TASK_NAMES:
        path = out / f"{task}.jsonl"
        lines = [json.dumps({"id": e.id, "task": e.task, "prompt": e.prompt, "answer": e.answer})
                 for e in generate_split(task, n, split)]
        path.write_text("\n".join(lines) + "\n", encoding="utf-8")
        paths.append(path)
    return paths


def _parse_row(path: Path, lineno: int, line: str, task: str) -> Example:
    """Turn one JSONL line into an Example, naming file and line on any defect."""
    where = f"{path}:{lineno}"
    try:
        row = json.loads(line)
    except json.JSONDecodeError as err:
        raise UserError(f"invalid JSON at {where}: {err}") from None
    keys = ("id", "task", "prompt", "answer")
    if not isinstance(row, dict) or not all(isinstance(row.get(k), str) for k in keys):
        raise UserError(f"invalid row at {where}: need string fields {list(keys)}")
    if row["task"] != task:
        raise UserError(f"invalid row at {where}: task {row['task']!r} in file for {task!r}")
    return Example(row["task"], row["prompt"], row["answer"], id=row["id"])


def _read_task_file(path: Path, task: str, limit: int | None) -> list[Example]:
    """Read up to ``limit`` rows of one task file (blank lines are ignored)."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise UserError(f"cannot read split file {path}: {err}") from None
    rows: list[Example] = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        if limit is not None and len(rows) >= limit:
            break
        if line.strip():
            rows.append(_parse_row(path, lineno, line, task))
    return rows


def load_split(tasks: str | list[str] | None = None, split: str = "test",
               limit: int | None = None, data_dir: str | Path | None = None) -> list[Example]:
    """Load committed rows, task by task in ``TASK_NAMES``/given order (``tasks``: names, a
    family such as ``worked``, or ``all``; see ``registry.resolve_tasks``).

    ``limit`` caps rows *per task* so quick evals stay balanced across tasks.
    ``data_dir`` overrides the packaged data directory (used by tests).
    """
    names = resolve_tasks(tasks)
    if limit is not None and limit < 1:
        raise UserError(f"limit must be >= 1 or None, got {limit}")
    root = Path(data_dir) if data_dir is not None else DATA_DIR
    return [ex for t in names for ex in _read_task_file(root / split / f"{t}.jsonl", t, limit)]


@functools.lru_cache(maxsize=1)
def _test_prompts() -> frozenset[str]:
    """Prompts of the committed test split, which training must never show."""
    return frozenset(ex.prompt for ex in load_split(split="test"))


def train_examples(seed: int, tasks: list[str] | None = None,
                   mix: dict[str, int] | None = None) -> Iterator[Example]:
    """Infinite, seed-deterministic stream mixing ``tasks`` (default all).

    Tasks come in shuffled rounds, each task ``mix[task]`` times per round (default once), so
    every batch is close to its intended mix instead of merely on average. ``mix`` oversamples the
    tasks a model finds hard (a weight of 0 leaves a task out); leaving it out (or all ones) gives
    the uniform stream.
    """
    names = resolve_tasks(tasks)  # validated here, not lazily at the first next()
    mix = check_mix(mix, names)
    rounds = [t for t in names for _ in range(mix.get(t, 1))]
    return _train_stream(random.Random(f"train-{seed}"), rounds, _test_prompts())


def check_mix(mix: dict[str, int] | None, tasks: list[str] | None = None) -> dict[str, int]:
    """``mix`` (None = uniform) if every name is one of ``tasks`` (default all), every weight an
    integer >= 0 (0 leaves the task out) and some task is left in; a clear ValueError otherwise."""
    mix, names = mix or {}, resolve_tasks(tasks)
    unknown = sorted(set(mix) - set(names))
    if unknown:
        raise UserError(f"mix names tasks not in the stream: {', '.join(unknown)}")
    bad = {t: w for t, w in mix.items() if not isinstance(w, int) or isinstance(w, bool) or w < 0}
    if bad:
        raise UserError(f"mix weights must be integers >= 0, got {bad}")
    if all(mix.get(t, 1) == 0 for t in names):
        raise UserError("mix leaves every task out of the stream")
    return mix


def _train_stream(rng: random.Random, rounds: list[str], blocked: frozenset[str]) -> Iterator[Example]:
    """The generator behind ``train_examples``."""
    while True:
        for task in rng.sample(rounds, len(rounds)):
            ex = TASKS[task].generate(rng)
            while ex.prompt in blocked:
                ex = TASKS[task].generate(rng)
            yield ex


def grade(example: Example, output_text: str) -> bool:
    """Grade ``output_text`` with the grader of ``example.task``."""
    return TASKS[resolve_tasks([example.task])[0]].grade(output_text, example)


def grade_final(example: Example, output_text: str) -> bool | None:
    """The final-answer-only grade of ``example.task`` (None for a task without a final result)."""
    return TASKS[resolve_tasks([example.task])[0]].grade_final(output_text, example)


def grade_form(example: Example, output_text: str) -> bool | None:
    """The form-only grade of ``example.task`` (None for a task whose answers have one form)."""
    return TASKS[resolve_tasks([example.task])[0]].grade_form(output_text, example)
