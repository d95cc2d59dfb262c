"""The ``dllm`` command: generate, bench, profile, serve, lm-eval, download, report, playground, and
the commands other installed packages register (the lab's eval, train and probes: ``dllm_lab.cli``)."""
from __future__ import annotations

import argparse
import sys
from importlib.metadata import version

from .. import plugins
from ..errors import UserError

from .bench import add_bench, run_bench
from .bench_serve import add_bench_serve, run_bench_serve
from .download import add_download, run_download
from .generate import add_generate, run_generate
from .lm_eval import run_lm_eval
from .playground import add_playground, run_playground
from .profile import add_profile, run_profile
from .report import add_report, run_report
from .serve import add_serve, run_serve

DESCRIPTION = ("Fast inference for diffusion LLMs: generate, bench, profile, serve, lm-eval, download, "
               "report, playground (and, with the lab installed, eval on its task suite, train and its "
               "probes). `dllm COMMAND --help` for each command's options.")
# command -> (adds its subparser, runs it); one module per command beside this file
COMMANDS = {"generate": (add_generate, run_generate),
            "bench": (add_bench, run_bench), "profile": (add_profile, run_profile),
            "serve": (add_serve, run_serve), "bench-serve": (add_bench_serve, run_bench_serve),
            "download": (add_download, run_download), "report": (add_report, run_report),
            "playground": (add_playground, run_playground)}
ENTRY_POINTS = "dllm.commands"  # a package's commands(): more {command: (add, run)} (the lab's)


def all_commands() -> dict:
    """The engine's commands, then those the installed packages register under ``ENTRY_POINTS``
    (an engine command's name is never taken over)."""
    found = dict(COMMANDS)
    for _, commands in plugins.load(ENTRY_POINTS):
        for name, pair in commands().items():
            found.setdefault(name, pair)
    return found


def build_parser(commands: dict | None = None) -> argparse.ArgumentParser:
    """``dllm`` and its subcommands (``lm-eval`` only for its help line: main hands it over)."""
    parser = argparse.ArgumentParser(prog="dllm", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"dllm-engine {version('dllm-engine')}")
    sub = parser.add_subparsers(dest="command", required=True)
    for add, _ in (commands or all_commands()).values():
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
        commands = all_commands()
        args = build_parser(commands).parse_args(argv)
        commands[args.command][1](args)
    # bad input, or the environment refusing a path or port the user gave: one line, no traceback
    except (UserError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:  # Ctrl-C: one line (a bench says what it kept), the shell's 130
        print(f"interrupted: {e}" if str(e) else "interrupted", file=sys.stderr)
        return 130
    return 0
