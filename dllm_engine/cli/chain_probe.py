"""``dllm chain-probe``: do worked answers compute each intermediate result, or copy it."""
from __future__ import annotations

import argparse

from . import common  # common.load_llm, looked up per call: tests stand in for the model
from .common import add_model_args, check_json_path, set_threads


def add_chain_probe(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("chain-probe", help="worked tasks: does the model compute each intermediate "
                       "result with the right masked, or only copy it (see eval/chain_probe.py)")
    p.add_argument("--tasks", default="sum,add,story", help="worked tasks whose results follow '='")
    p.add_argument("--limit", type=int, default=20, help="prompts per task")
    p.add_argument("--json", default=None, help="write the rows as JSON here")
    add_model_args(p)


def run_chain_probe(args: argparse.Namespace) -> None:
    from ..eval.chain_probe import chain_probe, probe_table
    from ..outputs import write_json_atomic
    from ..tasks import load_split, resolve_tasks
    tasks = resolve_tasks(args.tasks)
    check_json_path(args.json)
    set_threads(args.threads)
    rows = chain_probe(common.load_llm(args), load_split(tasks, limit=args.limit))
    print(f"model: {args.model}")
    print(probe_table(rows))
    if args.json:
        write_json_atomic(args.json, [r.as_dict() for r in rows.values()])
