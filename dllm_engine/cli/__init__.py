"""The ``dllm`` command: generate, eval, bench, train, serve, lm-eval, download, playground."""
from __future__ import annotations

import argparse
import sys
from importlib.metadata import version

from ..errors import UserError

from .bench import add_bench, run_bench
from .bench_serve import add_bench_serve, run_bench_serve
from .chain_probe import (add_canvas_probe, add_chain_probe, add_frontier_probe, run_canvas_probe,
                          run_chain_probe, run_frontier_probe)
from .download import add_download, run_download
from .eval import add_eval, run_eval
from .generate import add_generate, run_generate
from .lm_eval import add_lm_eval_tasks, run_lm_eval, run_lm_eval_tasks
from .playground import add_playground, run_playground
from .profile import add_profile, run_profile
from .report import add_report, run_report
from .serve import add_serve, run_serve
from .train import add_canvas_rows, add_train, run_canvas_rows, run_train

DESCRIPTION = ("Fast inference for diffusion LLMs: generate, eval, bench, profile, serve, lm-eval, download, "
               "report, playground, train. `dllm COMMAND --help` for each command's options.")
# command -> (adds its subparser, runs it); one module per command beside this file
COMMANDS = {"generate": (add_generate, run_generate), "eval": (add_eval, run_eval),
            "chain-probe": (add_chain_probe, run_chain_probe),
            "frontier-probe": (add_frontier_probe, run_frontier_probe),
            "canvas-probe": (add_canvas_probe, run_canvas_probe),
            "canvas-rows": (add_canvas_rows, run_canvas_rows),
            "bench": (add_bench, run_bench), "profile": (add_profile, run_profile), "train": (add_train, run_train),
            "serve": (add_serve, run_serve), "bench-serve": (add_bench_serve, run_bench_serve),
            "lm-eval-tasks": (add_lm_eval_tasks, run_lm_eval_tasks),
            "download": (add_download, run_download), "report": (add_report, run_report),
            "playground": (add_playground, run_playground)}


def build_parser() -> argparse.ArgumentParser:
    """``dllm`` and its subcommands (``lm-eval`` only for its help line: main hands it over)."""
    parser = argparse.ArgumentParser(prog="dllm", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"dllm-engine {version('dllm-engine')}")
    sub = parser.add_subparsers(dest="command", required=True)
    for add, _ in COMMANDS.values():
        add(sub)
    sub.add_parser("lm-eval", help="lm-evaluation-harness with the model 'dllm' and the embedded tasks "
                   "(needs the lm-eval extra; every argument goes to lm-eval: dllm lm-eval --help)")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one ``dllm`` command; the exit code: 0, 2 for bad input (one ``error:`` line), 130
    when interrupted. Any other exception is a bug: it propagates with its traceback (exit 1)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:2] == ["bench", "serve"]:  # the load generator lives beside the offline bench
        argv = ["bench-serve", *argv[2:]]
    try:
        if argv[:1] == ["lm-eval"]:  # every other argument belongs to lm-eval's own parser
            return run_lm_eval(argv[1:])
        args = build_parser().parse_args(argv)
        COMMANDS[args.command][1](args)
    # bad input, or the environment refusing a path or port the user gave: one line, no traceback
    except (UserError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:  # Ctrl-C: one line (a bench says what it kept), the shell's 130
        print(f"interrupted: {e}" if str(e) else "interrupted", file=sys.stderr)
        return 130
    return 0
