"""Named prompt sets that installed packages register, beside ``--prompts FILE.jsonl``
(``bench.prompts``): what ``--dataset`` / ``--tasks`` of ``dllm bench``, ``bench serve`` and
``profile`` read, where ``dllm generate`` finds its default prompt, the playground its examples and
``dllm lm-eval`` its extra tasks.

A package registers a ``Dataset`` object under the entry-point group ``dllm.datasets``; the lab
registers its task suite, the one the embedded checkpoints were trained on, as ``tasks``
(``dllm_lab.tasks.dataset``). The engine knows nothing of a dataset's contents: it asks a
``Dataset`` for examples by a selection string and reads each example through ``Prompt``, its
conversation and its grades.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Protocol, Sequence

from . import plugins
from .errors import UserError

GROUP = "dllm.datasets"
DEFAULT = "tasks"  # the lab's task suite: the default of every command that takes --dataset


class Prompt(Protocol):
    """One example as the engine reads it (a dataset's, or a prompts file's line)."""

    task: str  # the subset it belongs to: a bench row's workload, a report's row
    prompt: str  # the user message (what records and tables show)
    answer: str | None  # the expected answer (None: accuracy not measured)
    id: str | None

    def chat(self) -> list[dict]:
        """The conversation it is asked as (the chat template applies to it)."""

    def grades(self, output_text: str) -> tuple[bool | None, bool | None, bool | None]:
        """(whole answer, final answer, form) grades of ``output_text``, None for one not measured."""


@dataclass(frozen=True)
class Dataset:
    """A named source of prompts.

    ``load(selection, limit)``: the held-out examples of ``selection`` (a string the dataset
    documents in ``selections``, or a list of its subset names; None: all), at most ``limit``
    per subset; a selection it does not know raises ``UserError`` naming the valid ones.
    ``demo``: ``dllm generate``'s prompt when none is given; ``showcase``: the playground's
    examples; ``write_lm_eval_tasks(folder)``: lm-eval task YAMLs of the dataset, put on
    ``dllm lm-eval``'s include path. Each is optional."""

    name: str
    selections: str  # what --tasks takes, for --help and errors
    load: Callable[[str | Sequence[str] | None, int | None], list[Prompt]]
    demo: Callable[[], Prompt] | None = None
    showcase: Callable[[], list[Prompt]] | None = None
    write_lm_eval_tasks: Callable[[str | Path], list[str]] | None = None


@functools.cache
def registered() -> dict[str, Dataset]:
    """Every installed package's datasets by name (``GROUP`` entry points), read once."""
    found: dict[str, Dataset] = {}
    for point, value in plugins.load(GROUP):
        if not isinstance(value, Dataset):
            raise TypeError(f"the {GROUP} entry point {point} is a {type(value).__name__}, "
                            f"not a dllm_engine.datasets.Dataset")
        found.setdefault(value.name, value)
    return found


def get(name: str = DEFAULT) -> Dataset:
    """The dataset registered as ``name``; a ``UserError`` that says what to do when none is."""
    datasets = registered()
    if name in datasets:
        return datasets[name]
    installed = f"installed: {', '.join(sorted(datasets))}" if datasets else "none is installed"
    lab = (" The task suite 'tasks' comes with the lab: pip install dllm-lab (a checkout's `make venv` "
           "installs it)." if name == DEFAULT else "")
    raise UserError(f"no dataset named {name!r} ({installed}).{lab} Or give the prompts as a file: "
                    f"--prompts FILE.jsonl")


def load(selection: str | Sequence[str] | None = None, limit: int | None = None,
         name: str = DEFAULT) -> list[Prompt]:
    """``get(name).load(selection, limit)``: the examples of ``selection`` in dataset ``name``."""
    if limit is not None and limit < 1:
        raise UserError(f"limit must be >= 1 or None, got {limit}")
    return get(name).load(selection, limit)
