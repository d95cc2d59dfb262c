"""``dllm bench``: method specs compared on the same prompts (JSON + plot)."""
from __future__ import annotations

import argparse

from ..errors import UserError
from . import common  # common.load_llm, looked up per call: tests stand in for the model
from .common import (add_model_args, add_prompt_source, load_examples, prepare_out, set_threads, split_ints,
                     split_quantizations, workload)


def add_bench(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="compare method specs on the same prompts; JSON + plot")
    p.add_argument("--methods", nargs="+", required=True,
                   help="specs method[:field=value,...], e.g. dual-cache:threshold=0.9")
    p.add_argument("--batch-sizes", type=split_ints, default=[1, 8, 32], help="comma-separated (default 1,8,32)")
    add_prompt_source(p, "all", "'all' (default), a family ('copy', 'worked', 'phrased') or comma-separated "
                                "task names")
    p.add_argument("--limit", type=int, default=None,
                   help="prompts per task, or the first N of --prompts (default: every prompt: 100 per task, "
                        "1,500 for 'all'; each spec at each batch size)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="for every spec that does not set it")
    p.add_argument("--block-length", type=int, default=None, help="for every spec that does not set it")
    p.add_argument("--out", default=None,
                   help="folder for results.json (rewritten after every row), table.md and "
                        "throughput.png (default: a new folder bench-out/YYYYMMDD-HHMMSS)")
    p.add_argument("--repeats", type=int, default=1, metavar="N",
                   help="timed rounds of every spec, in turn, per batch size; each row keeps its "
                        "fastest pass and the table the range of the rounds' speed-ups (a shared machine)")
    p.add_argument("--per-sequence-step", action="store_true",
                   help="each spec also runs with the per-sequence step (the path strategies take) in place "
                        "of the batch-shaped one, as a row 'SPEC [per-sequence step]'")
    p.add_argument("--compare-quantization", type=split_quantizations, default=[], metavar="METHODS",
                   help="each spec also runs with its linear layers quantized, e.g. int8 or int8,int4, as "
                        "rows 'SPEC [int8]' with their token agreement with the spec's row and their "
                        "weights' size (one model, quantized and put back in turn)")
    add_model_args(p)


def default_out() -> str:
    """A new folder for this run: bench-out/YYYYMMDD-HHMMSS (a suffix if that one exists)."""
    import time
    from pathlib import Path
    base = Path("bench-out") / time.strftime("%Y%m%d-%H%M%S")
    out, n = base, 1
    while out.exists():
        n += 1
        out = base.with_name(f"{base.name}-{n}")
    return str(out)


def run_bench(args: argparse.Namespace) -> None:
    from ..bench.offline import HEADER, check_prompts, check_specs, run_bench as bench, table
    from ..hub import resolve_model
    from ..engine.canvas_llm import is_canvas_checkpoint
    from ..models.compiled import check_compile
    if args.repeats < 1:
        raise UserError(f"--repeats must be >= 1, got {args.repeats}")
    set_threads(args.threads)
    examples = load_examples(args, args.limit)  # a typo or a bad file fails before the model loads
    args.tasks = list(dict.fromkeys(e.task for e in examples))
    defaults = {k: v for k, v in (("max_new_tokens", args.max_new_tokens),
                                  ("block_length", args.block_length)) if v is not None}
    check_compile(args.compile, args.tensor_parallel_size, args.compile_step)  # bench compiles after loading
    folder = str(resolve_model(args.model, args.revision))  # an id: fetched once, here
    if is_canvas_checkpoint(folder):
        resolved = check_canvas_bench(args, defaults)
    else:
        resolved = check_specs(folder, args.methods, defaults)  # before the weights load
    args.out = args.out or default_out()
    prepare_out(args.out, "results.json")
    print(f"writing to {args.out}")
    # --compile, --fixed-shapes, --compile-step: each spec runs as usual, then under each
    llm = common.load_llm(args, folder, compile=False, fixed_shapes=False, compile_step=False)
    variants = [name for name, on in (("fixed shapes", args.fixed_shapes), ("compiled step", args.compile_step),
                                      ("per-sequence step", args.per_sequence_step)) if on]
    variants += args.compare_quantization
    resolved = {spec: llm.resolve(p) for spec, p in resolved.items()}
    check_prompts(llm, resolved, examples)  # before the header
    for spec, params in resolved.items():
        print(f"method: {spec} = {params.describe()}")
    from ..engine.host_memory import is_kept
    print(f"model: {args.model}  prompts: {len(examples)}  {workload(args, examples)}  device: {args.device}  "
          f"keep_freed_memory: {'on' if is_kept() else 'off'}  repeats: {args.repeats}")
    print(HEADER)
    records = bench(llm, args.methods, args.batch_sizes, examples, args.out, defaults,
                    compare_compiled=args.compile, variants=variants, repeats=args.repeats, use_tqdm=True)
    print()
    print(table(records))
    print(f"\nwrote {args.out}/results.json and {args.out}/throughput.png")


def check_canvas_bench(args: argparse.Namespace, defaults: dict) -> dict:
    """A DiffusionGemma checkpoint's specs (``diffusion-gemma[:field=value,...]``) parsed before
    any weight loads (``CanvasLLM.resolve`` checks their values against the checkpoint once it
    has); the engine variants, which its sampler does not run, refused naming them."""
    from ..bench.offline import resolve_specs
    from ..engine.canvas_llm import parse_canvas_spec, refuse_options
    refuse_options({"--fixed-shapes": args.fixed_shapes, "--compile-step": args.compile_step,
                    "--per-sequence-step": args.per_sequence_step})
    return resolve_specs(args.methods, lambda params: params, defaults, parse_canvas_spec)
