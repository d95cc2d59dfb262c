"""Command line for the task suite: ``python -m dllm_lab.tasks.suite --write-split``.

Kept separate from the package ``__init__`` (which never imports it) so running it with
``-m`` does not trigger runpy's "found in sys.modules" warning.
"""
from __future__ import annotations

import argparse
import random
import statistics
from pathlib import Path

from .registry import TASK_NAMES, TASKS
from .splits import DATA_DIR, load_split, write_split
from .generators import Example
from .phrased import PhrasedTask


def result_count(example: Example) -> int:
    """The intermediate results ``example``'s answer writes: a worked answer's clauses
    (``WorkedTask.results``), a phrased problem's steps before its final line, a description's
    items; 0 for the ``copy`` tasks."""
    gen = TASKS[example.task]
    if isinstance(gen, PhrasedTask):
        return len(gen.steps_of(example)) - 1
    return gen.results(example.answer) if hasattr(gen, "results") else 0


def answer_stats(task: str, examples: list[Example]) -> dict[str, float]:
    """Length and result figures of ``task``'s answers (word tokens, as the tokenizer counts them).

    ``results`` counts an answer's intermediate results (``result_count``), each written from the
    one before it: a decoder that commits one of them per step, with the copies and
    template words around it, commits ``tokens_per_result`` tokens per step. The ``copy`` tasks
    have none (0).
    """
    lengths = [len(ex.answer.split()) for ex in examples]
    results = sum(result_count(ex) for ex in examples)
    return {"answers": len(examples), "median_tokens": statistics.median(lengths),
            "mean_tokens": statistics.fmean(lengths), "max_tokens": max(lengths),
            "mean_results": results / len(examples),
            "tokens_per_result": sum(lengths) / results if results else 0.0}


def main(argv: list[str] | None = None) -> None:
    """Regenerate the committed split, print its answer statistics, or print a sample of every task."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--write-split", action="store_true", help="(re)write the JSONL split")
    parser.add_argument("--dir", type=Path, default=DATA_DIR / "test", help="output directory")
    parser.add_argument("--n", type=int, default=100, help="examples per task")
    parser.add_argument("--stats", action="store_true",
                        help="answer lengths of the committed split; for worked tasks also the "
                             "intermediate results per answer and answer tokens per result")
    args = parser.parse_args(argv)
    if args.stats:
        print("task     answers  median  mean   max  results  tokens/result")
        for name in TASK_NAMES:
            st = answer_stats(name, load_split([name]))
            per = f"{st['tokens_per_result']:.2f}" if st["mean_results"] else "-"
            print(f"{name:<8} {st['answers']:>7}  {st['median_tokens']:>6g}  {st['mean_tokens']:>5.1f}"
                  f"  {st['max_tokens']:>4}  {st['mean_results']:>7.2f}  {per:>13}")
        return
    if args.write_split:
        for path in write_split(args.dir, n=args.n):
            print(path)
        return
    rng = random.Random(0)
    for task in TASKS.values():
        ex = task.generate(rng)
        print(f"{ex.prompt!r} -> {ex.answer!r}")


if __name__ == "__main__":
    main()
