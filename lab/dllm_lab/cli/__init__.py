"""The lab's ``dllm`` subcommands (eval, lm-eval-tasks, train, canvas-rows, the probes), registered
with the engine's command through the ``dllm.commands`` entry point (lab/pyproject.toml):
``commands`` is what it loads."""
from __future__ import annotations

from .eval import add_eval, add_lm_eval_tasks, run_eval, run_lm_eval_tasks
from .probes import (add_canvas_probe, add_chain_probe, add_frontier_probe, run_canvas_probe, run_chain_probe,
                     run_frontier_probe)
from .train import add_canvas_rows, add_train, run_canvas_rows, run_train


def commands() -> dict:
    """command -> (adds its subparser, runs it), as ``dllm_engine.cli.COMMANDS``."""
    return {"eval": (add_eval, run_eval), "lm-eval-tasks": (add_lm_eval_tasks, run_lm_eval_tasks),
            "train": (add_train, run_train), "canvas-rows": (add_canvas_rows, run_canvas_rows),
            "chain-probe": (add_chain_probe, run_chain_probe),
            "frontier-probe": (add_frontier_probe, run_frontier_probe),
            "canvas-probe": (add_canvas_probe, run_canvas_probe)}
