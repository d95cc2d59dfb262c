"""``dllm eval``: accuracy and speed of one method on the held-out task split; ``dllm lm-eval-tasks``:
the splits as lm-eval tasks."""
from __future__ import annotations

import argparse

from dllm_engine.cli import common  # common.load_llm, looked up per call: tests stand in for the model
from dllm_engine.cli.common import add_model_args, add_sampling_args, check_output_path, sampling_params, set_threads


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
    from dllm_engine.eval import evaluate
    from dllm_engine.outputs import write_json_atomic
    from ..tasks import load_split, resolve_tasks
    args.tasks = resolve_tasks(args.tasks)  # a typo fails before the model loads
    check_output_path(args.json)
    check_output_path(args.samples, "--samples")
    set_threads(args.threads)
    given = sampling_params(args)  # bad options fail before the model loads
    llm = common.load_llm(args)
    common.check_method_family(args, llm)
    params = llm.resolve(given)
    report = evaluate(llm, params, examples=load_split(args.tasks, limit=args.limit),
                      batch_size=args.batch_size, samples=args.samples)
    print(f"model: {args.model}")
    print(f"method: {params.describe()}")
    print(report.table())
    if args.json:
        write_json_atomic(args.json, report.as_dict())


def add_lm_eval_tasks(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("lm-eval-tasks", help="write the held-out splits as lm-eval YAML tasks "
                       "(for lm_eval --include_path DIR)")
    p.add_argument("--out", required=True,
                   help="folder for dllm_<task>.yaml, a group per task family and dllm_suite.yaml")


def run_lm_eval_tasks(args: argparse.Namespace) -> None:
    from ..lm_eval_tasks import groups, write_tasks
    names = write_tasks(args.out)
    print(f"wrote {len(names)} tasks ({', '.join(names)}) and the groups "
          f"{', '.join(groups([n.removeprefix('dllm_') for n in names]))} to {args.out}")
