"""``dllm lm-eval``: lm-evaluation-harness with the ``dllm`` model (the lab adds ``dllm lm-eval-tasks``)."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..errors import UserError

PACKAGE = Path(__file__).resolve().parents[1]  # dllm_engine/


def run_lm_eval(argv: list[str]) -> int:
    """``dllm lm-eval ARGS``: lm-eval's command line with the ``dllm`` model registered and the
    installed datasets' lm-eval tasks (the lab's task suite: ``dllm_suite``, ...) on its include path
    (unless ARGS sets ``--include_path``)."""
    import tempfile
    try:
        from ..integrations import lm_eval  # noqa: F401  (registers the model "dllm")
    except ImportError as e:
        print(f"error: dllm lm-eval needs the lm-eval extra (pip install -e '.[lm-eval]'): {e}",
              file=sys.stderr)
        return 2
    from lm_eval.__main__ import cli_evaluate
    from .. import datasets
    with tempfile.TemporaryDirectory(prefix="dllm-lm-eval-") as tasks_dir:
        writers = [d.write_lm_eval_tasks for d in datasets.registered().values() if d.write_lm_eval_tasks]
        for write in writers:
            write(tasks_dir)
        given = any(a.startswith("--include_path") for a in argv)
        extra = [] if given or not writers else ["--include_path", tasks_dir]
        sys.argv = ["lm-eval", *argv, *extra]
        try:
            cli_evaluate()
        except (UserError, OSError, NotImplementedError) as e:  # bad model_args of dllm, a request
            # type a model cannot answer, ...: one line, as the other commands
            print(f"error: {e}", file=sys.stderr)
            return 2
        except ValueError as e:
            if raised_in_this_package(e):  # not a UserError: a bug of ours keeps its traceback
                raise
            print(f"error: {e}", file=sys.stderr)  # lm-eval refusing its own arguments (an unknown task)
            return 2
    return 0


def raised_in_this_package(error: BaseException) -> bool:
    """Whether the innermost frame of ``error``'s traceback is dllm_engine code."""
    tb = error.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and Path(tb.tb_frame.f_code.co_filename).resolve().is_relative_to(PACKAGE)
