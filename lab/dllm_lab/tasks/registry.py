"""Every task by name, the task families, and the vocabulary they share.

Three families: ``copy`` (``generators``: short answers a model can write nearly at once, the quick
demo), ``worked`` (``worked``: long step-by-step answers in one fixed template) and ``phrased``
(``phrased``: worked solutions and descriptions in free phrasing, the workload that decodes like a
real dLLM's). ``--tasks`` of ``dllm eval`` / ``dllm bench`` takes a family, ``all`` or task names.
"""
from __future__ import annotations

from dllm_engine.errors import UserError
from .generators import COPY_TASKS, COPY_VOCAB, Task
from .phrased import PHRASED_TASKS, PHRASED_WORDS
from .worked import WORKED_TASKS, WORKED_WORDS

# Tokenizer ids follow this order: each family's new words come after the families before it, so
# a checkpoint trained on the earlier families keeps its ids when the vocabulary grows.
VOCAB: tuple[str, ...] = tuple(dict.fromkeys(COPY_VOCAB + WORKED_WORDS + PHRASED_WORDS))

TASKS: dict[str, Task] = {t.name: t for t in (*COPY_TASKS, *WORKED_TASKS, *PHRASED_TASKS)}
TASK_NAMES: list[str] = list(TASKS)
TASK_FAMILIES: dict[str, list[str]] = {
    "copy": [t.name for t in COPY_TASKS],
    "worked": [t.name for t in WORKED_TASKS],
    "phrased": [t.name for t in PHRASED_TASKS],
}


def resolve_tasks(spec: str | list[str] | None) -> list[str]:
    """Task names for ``spec``: ``None`` / ``all`` = every task, a family name, task names, or a
    comma-separated mix of those (``worked,sort``); unknown names raise ValueError listing the
    valid ones."""
    if spec is None:
        return list(TASK_NAMES)
    words = [w.strip() for w in (spec.split(",") if isinstance(spec, str) else spec) if w.strip()]
    if not words:
        raise UserError("no tasks given; use 'all', a family (copy, worked, phrased) or task names")
    names: list[str] = []
    for word in words:
        group = TASK_NAMES if word == "all" else TASK_FAMILIES.get(word, [word])
        unknown = [t for t in group if t not in TASKS]
        if unknown:
            raise UserError(f"unknown task {word!r}; use 'all', a family ({', '.join(TASK_FAMILIES)}) "
                            f"or task names: {', '.join(TASK_NAMES)}")
        names += [t for t in group if t not in names]
    return names


def task_family(name: str) -> str:
    """The family a task belongs to."""
    return next(f for f, names in TASK_FAMILIES.items() if name in names)
