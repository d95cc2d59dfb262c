"""Command line for the task suite: ``python -m dllm_engine.tasks.suite --write-split``.

Kept separate from the package ``__init__`` (which never imports it) so running it with
``-m`` does not trigger runpy's "found in sys.modules" warning.
"""
from __future__ import annotations

import argparse
import random
from pathlib import Path

from .registry import TASKS
from .splits import DATA_DIR, write_split


def main(argv: list[str] | None = None) -> None:
    """Regenerate the committed split, or print a sample of every task."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--write-split", action="store_true", help="(re)write the JSONL split")
    parser.add_argument("--dir", type=Path, default=DATA_DIR / "test", help="output directory")
    parser.add_argument("--n", type=int, default=100, help="examples per task")
    args = parser.parse_args(argv)
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
