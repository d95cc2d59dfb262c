"""``dllm lm-eval`` (lm-evaluation-harness with the ``dllm`` model) and ``dllm lm-eval-tasks``."""
from __future__ import annotations

import argparse
import sys


def add_lm_eval_tasks(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("lm-eval-tasks", help="write the held-out splits as lm-eval YAML tasks "
                       "(for lm_eval --include_path DIR)")
    p.add_argument("--out", required=True,
                   help="folder for dllm_<task>.yaml, a group per task family and dllm_suite.yaml")


def run_lm_eval_tasks(args: argparse.Namespace) -> None:
    from ..integrations.lm_eval_tasks import groups, write_tasks
    names = write_tasks(args.out)
    print(f"wrote {len(names)} tasks ({', '.join(names)}) and the groups "
          f"{', '.join(groups([n.removeprefix('dllm_') for n in names]))} to {args.out}")


def run_lm_eval(argv: list[str]) -> int:
    """``dllm lm-eval ARGS``: lm-eval's command line with the ``dllm`` model registered and the
    embedded tasks on its include path (unless ARGS sets ``--include_path``)."""
    import tempfile
    try:
        from ..integrations import lm_eval  # noqa: F401  (registers the model "dllm")
    except ImportError as e:
        print(f"error: dllm lm-eval needs the lm-eval extra (pip install -e '.[lm-eval]'): {e}",
              file=sys.stderr)
        return 2
    from lm_eval.__main__ import cli_evaluate
    from ..integrations.lm_eval_tasks import write_tasks
    with tempfile.TemporaryDirectory(prefix="dllm-lm-eval-") as tasks_dir:
        write_tasks(tasks_dir)
        extra = [] if any(a.startswith("--include_path") for a in argv) else ["--include_path", tasks_dir]
        sys.argv = ["lm-eval", *argv, *extra]
        try:
            cli_evaluate()
        except (ValueError, OSError, NotImplementedError) as e:  # bad model_args of dllm, an unknown
            # task, a request type a model cannot answer, ...: one line, as the other commands
            print(f"error: {e}", file=sys.stderr)
            return 2
    return 0
