"""``dllm eval``: accuracy and speed of one method on the held-out task split."""
from __future__ import annotations

import argparse

from . import common  # common.load_llm, looked up per call: tests stand in for the model
from .common import add_model_args, add_sampling_args, check_output_path, sampling_params, set_threads


def add_eval(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("eval", help="accuracy and speed of one method on the held-out task split")
    p.add_argument("--tasks", default="all",
                   help="'all', a family ('copy': short answers, 'worked': step-by-step answers in "
                        "one template, 'phrased': in free phrasing) or comma-separated task names")
    p.add_argument("--limit", type=int, default=None, help="prompts per task")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--json", default=None, help="write the report as JSON here")
    p.add_argument("--samples", default=None, metavar="FILE",
                   help="write every prompt, its target, the model's output and its grades here, one "
                        "JSON line each, a batch at a time as it finishes")
    add_model_args(p)
    add_sampling_args(p)


def run_eval(args: argparse.Namespace) -> None:
    from ..eval import evaluate
    from ..outputs import write_json_atomic
    from ..tasks import resolve_tasks
    args.tasks = resolve_tasks(args.tasks)  # a typo fails before the model loads
    check_output_path(args.json)
    check_output_path(args.samples, "--samples")
    set_threads(args.threads)
    given = sampling_params(args)  # bad options fail before the model loads
    llm = common.load_llm(args)
    params = llm.resolve(given)
    report = evaluate(llm, params, tasks=args.tasks, limit=args.limit, batch_size=args.batch_size,
                      samples=args.samples)
    print(f"model: {args.model}")
    print(f"method: {params.describe()}")
    print(report.table())
    if args.json:
        write_json_atomic(args.json, report.as_dict())
