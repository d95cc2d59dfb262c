"""The task suite as the engine's dataset ``tasks`` (``dllm_engine.datasets``), registered by the
``dllm.datasets`` entry point of the lab's pyproject.toml: ``dllm bench --tasks worked``, the
default prompt of ``dllm generate``, the playground's examples and ``dllm lm-eval``'s tasks."""
from __future__ import annotations

from dllm_engine.datasets import Dataset

from ..lm_eval_tasks import write_tasks
from .registry import TASK_FAMILIES
from .splits import load_split


def demo():
    """``dllm generate``'s prompt: a held-out worked story (a long answer, decoded block by block)."""
    return load_split(["story"], limit=1)[0]


def showcase():
    """The playground's examples: one short copy answer, one long one, one worked answer."""
    return load_split(["sort", "spell", "story"], limit=1)


SUITE = Dataset(
    name="tasks",
    selections=f"'all', a family ({', '.join(TASK_FAMILIES)}) or comma-separated task names",
    load=lambda selection, limit: load_split(selection, limit=limit),
    demo=demo, showcase=showcase, write_lm_eval_tasks=write_tasks)
