"""``dllm chain-probe`` (do worked answers compute each intermediate result, or copy it),
``dllm frontier-probe`` (is the decoding frontier the slot a threshold decoder commits first) and
``dllm canvas-probe`` (which decoding step makes a phrased answer unfinishable, and did it commit
ahead of the frontier)."""
from __future__ import annotations

import argparse

from dllm_engine.cli import common  # common.load_llm, looked up per call: tests stand in for the model
from dllm_engine.cli.common import add_model_args, add_sampling_args, check_output_path, sampling_params, set_threads


def add_chain_probe(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("chain-probe", help="worked tasks: does the model compute each intermediate "
                       "result with the right masked, or only copy it (see probes/chain_probe.py)")
    p.add_argument("--tasks", default="sum,add,story", help="worked tasks whose results follow '='")
    add_probe_args(p)


def add_frontier_probe(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("frontier-probe", help="along the held-out answers, is the first masked slot the "
                       "most confident of its block, as a threshold decoder ranks them "
                       "(see probes/frontier_probe.py)")
    p.add_argument("--tasks", default="phrased", help="tasks, a family or 'all' (as dllm eval)")
    p.add_argument("--block-length", type=int, default=None,
                   help="the decoder's block (default: a block-diffusion model's own, else 32)")
    p.add_argument("--threshold", type=float, default=0.9, help="counted: some slot reaches it")
    p.add_argument("--max-new-tokens", type=int, default=256, help="the canvas's generation slots")
    p.add_argument("--oracle", action="store_true",
                   help="the phrased tasks' own generator in the model's place: what a model that had "
                        "learned them perfectly would see (the model gives the tokenizer and block layout)")
    p.add_argument("--samples", type=int, default=200, help="--oracle: answers drawn per position")
    add_probe_args(p)


def add_canvas_probe(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("canvas-probe", help="phrased tasks: which step of a method's own decoding "
                       "makes the canvas unfinishable, and did it commit ahead of the frontier "
                       "(see probes/canvas_probe.py)")
    p.add_argument("--tasks", default="calc,shop,biggest,tally", help="phrased tasks with a trace")
    p.add_argument("--batch-size", type=int, default=32)
    add_probe_args(p)
    add_sampling_args(p)


def add_probe_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--limit", type=int, default=20, help="prompts per task")
    p.add_argument("--json", default=None, help="write the rows as JSON here")
    add_model_args(p)


def run_probe(args: argparse.Namespace, probe, table) -> None:
    """Load the split and the model, run ``probe(llm, examples)``, print ``table`` of its rows."""
    from dllm_engine.outputs import write_json_atomic
    from ..tasks import load_split, resolve_tasks
    tasks = resolve_tasks(args.tasks)
    check_output_path(args.json)
    set_threads(args.threads)
    rows = probe(common.load_llm(args), load_split(tasks, limit=args.limit))
    print(f"model: {args.model}")
    print(table(rows))
    if args.json:
        write_json_atomic(args.json, [r.as_dict() for r in rows.values()])


def run_chain_probe(args: argparse.Namespace) -> None:
    from ..probes.chain_probe import chain_probe, probe_table
    run_probe(args, chain_probe, probe_table)


def run_frontier_probe(args: argparse.Namespace) -> None:
    from ..probes.frontier_probe import frontier_probe, frontier_table, oracle_frontier_probe
    layout = {"block_length": args.block_length, "threshold": args.threshold,
              "max_new_tokens": args.max_new_tokens}
    if args.oracle:
        run_probe(args, lambda llm, examples: oracle_frontier_probe(llm, examples, samples=args.samples,
                                                                    **layout), frontier_table)
    else:
        run_probe(args, lambda llm, examples: frontier_probe(llm, examples, **layout), frontier_table)


def run_canvas_probe(args: argparse.Namespace) -> None:
    from ..probes.canvas_probe import canvas_probe, canvas_table, refuse_untraced
    from ..tasks import resolve_tasks
    refuse_untraced(resolve_tasks(args.tasks))  # before the model loads
    given = sampling_params(args)  # bad options fail before the model loads
    run_probe(args, lambda llm, examples: canvas_probe(llm, given, examples, batch_size=args.batch_size),
              canvas_table)
