"""``dllm profile``: time per step, the model's forward (floor) against everything else."""
from __future__ import annotations

import argparse

from ..errors import UserError
from . import common  # common.load_llm, looked up per call: tests stand in for the model
from .common import add_model_args, add_prompt_source, load_examples, set_threads, split_ints, workload


def add_profile(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("profile", help="time per step: the model's forward alone (floor) against "
                       "everything else, and host synchronisations per step")
    p.add_argument("--methods", nargs="+", required=True, help="specs as in dllm bench")
    p.add_argument("--batch-sizes", type=split_ints, default=[1, 64])
    add_prompt_source(p, "copy", "'copy' (default), 'worked', 'phrased', 'all' or comma-separated task names, "
                                 "as in dllm bench")
    p.add_argument("--limit", type=int, default=None,
                   help="prompts per task (default 2), or the first N of --prompts (default: all)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="for every spec that does not set it")
    p.add_argument("--repeats", type=int, default=1,
                   help="timed and floor passes, alternating; each keeps its fastest (a shared machine)")
    p.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                   help="wall time, or the engine thread's CPU time (barely disturbed by other "
                        "processes; tok/s then counts CPU seconds; use with --threads 1)")
    p.add_argument("--breakdown", action="store_true",
                   help="one more pass under torch's profiler: each row's op time by kind (matmul, attention, "
                        "elementwise, data movement, views and allocation), ms per step")
    add_model_args(p)


def run_profile(args: argparse.Namespace) -> None:
    from ..bench.profile import HEADER, breakdown_table, run_profile as profile, table
    if args.tensor_parallel_size != 1:  # its floor pass calls modules whose collectives need every rank
        raise UserError("dllm profile replays the model's modules in this process; run it with "
                        "--tensor-parallel-size 1")
    if args.compile_step:  # its floor would time the eager modules, not the compiled graph
        raise UserError("dllm profile replays each module eagerly, so it cannot time a compiled "
                        "step; use --fixed-shapes here, and dllm bench --compile-step for its speed")
    if args.repeats < 1:  # before the weights load
        raise UserError(f"--repeats must be >= 1, got {args.repeats}")
    limit = args.limit if args.limit is not None or args.prompts else 2
    examples = load_examples(args, limit)  # a typo or a bad file fails before the model loads
    set_threads(args.threads)
    from ..engine.canvas_llm import is_canvas_checkpoint
    from ..hub import resolve_model
    if is_canvas_checkpoint(resolve_model(args.model, args.revision)):
        return profile_canvas_model(args, examples)
    llm = common.load_llm(args)  # as dllm bench: freed host memory kept unless --no-keep-freed-memory
    defaults = {"max_new_tokens": args.max_new_tokens} if args.max_new_tokens else {}
    print(f"model: {args.model}  prompts: {len(examples)}  {workload(args, examples)}  device: {args.device}  "
          f"compile: {'on' if args.compile else 'off'}  fixed shapes: {'on' if args.fixed_shapes else 'off'}  "
          f"repeats: {args.repeats}  clock: {args.clock}")
    print(HEADER)
    records = profile(llm, args.methods, args.batch_sizes, examples, defaults, repeats=args.repeats,
                      clock=args.clock, breakdown=args.breakdown)
    print()
    print(table(records))
    if args.breakdown:
        print("\nop time by kind, ms per step (share of the step's op time):\n")
        print(breakdown_table(records))


def profile_canvas_model(args: argparse.Namespace, examples) -> None:
    """``dllm profile`` of a DiffusionGemma checkpoint (``bench/canvas_profile.py``): its specs
    and options checked before the weights load."""
    from ..bench.canvas_profile import HEADER, run_canvas_profile, table
    from ..bench.offline import resolve_specs
    from ..engine.canvas_llm import DOCS, MODEL_TYPE, parse_canvas_spec, refuse_options
    refuse_options({"--breakdown": args.breakdown, "--fixed-shapes": args.fixed_shapes, "--repeats": args.repeats != 1},
                   f"{MODEL_TYPE}'s profile", DOCS)
    defaults = {"max_new_tokens": args.max_new_tokens} if args.max_new_tokens else {}
    resolve_specs(args.methods, lambda params: params, defaults, parse_canvas_spec)  # a bad spec fails here
    llm = common.load_llm(args)
    prompts = [llm.check_ids(llm.apply_chat_template(e.chat())) for e in examples]
    print(f"model: {args.model}  prompts: {len(examples)}  {workload(args, examples)}  device: {args.device}  "
          f"clock: {args.clock}")
    print(HEADER)
    records = run_canvas_profile(llm, args.methods, args.batch_sizes, prompts, defaults, clock=args.clock)
    print()
    print(table(records))
