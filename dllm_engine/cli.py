"""The ``dllm`` command: generate, eval, bench, train, serve, lm-eval, download."""
from __future__ import annotations

import argparse
import sys
from importlib.metadata import version
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the command line imports the engine lazily, per command
    from .sampling_params import SamplingParams

CHECKPOINTS = Path(__file__).resolve().parent.parent / "checkpoints"
DEFAULT_MODEL = CHECKPOINTS / "tiny-llada"


def add_model_args(p: argparse.ArgumentParser, model: bool = True) -> None:
    """--model (default: the embedded tiny-llada), --revision, --dtype, --device: shared by every command."""
    if model:
        p.add_argument("--model", default=str(DEFAULT_MODEL),
                       help="checkpoint folder or Hugging Face id, org/name (default: tiny-llada)")
    p.add_argument("--revision", default=None,
                   help="branch, tag or commit of a Hugging Face id (default: main; a local folder ignores it)")
    p.add_argument("--dtype", default="auto",
                   help="auto (default: the checkpoint's own, config.json's torch_dtype, else its "
                        "weights': bfloat16 for the released models, float32 for the embedded ones), "
                        "float32, bfloat16, float16")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--keep-freed-memory", action=argparse.BooleanOptionalAction, default=True,
                   help="CPU: let glibc reuse freed activations instead of returning them to the OS "
                        "(faster; the process keeps its peak heap; see engine/host_memory.py)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (the README's benchmarks use 1; default: torch's choice)")
    p.add_argument("--tensor-parallel-size", type=int, default=1, metavar="N",
                   help="split the model over N processes, one per device (spawned here, or the "
                        "ranks of torchrun); each process uses --threads CPU threads")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile the layers' norms and MLPs (dynamic shapes; not bit-exact: "
                        "last bits of the logits; off by default; dllm bench --compile runs each "
                        "spec eager and compiled)")
    p.add_argument("--fixed-shapes", action="store_true",
                   help="round every step's rows, tokens and keys up to buckets (at most a quarter "
                        "more), with a mask and indexed K/V writes: the shapes a CUDA graph can capture "
                        "(same tokens; off by default: the padding costs compute on a CPU)")
    p.add_argument("--compile-step", action="store_true",
                   help="--fixed-shapes, and each step's whole layer stack torch.compiled without "
                        "dynamic shapes: one graph per shape bucket (CUDA graphs on CUDA); not "
                        "bit-exact; off by default")


def load_llm(args: argparse.Namespace, model: str | None = None, **kw):
    from . import LLM
    kw.setdefault("compile", getattr(args, "compile", False))
    kw.setdefault("fixed_shapes", getattr(args, "fixed_shapes", False))
    kw.setdefault("compile_step", getattr(args, "compile_step", False))
    return LLM(model or args.model, revision=args.revision, dtype=args.dtype, device=args.device,
               keep_freed_memory=args.keep_freed_memory,
               tensor_parallel_size=getattr(args, "tensor_parallel_size", 1), **kw)


def set_threads(threads: int | None) -> None:
    if threads is None:
        return
    if threads < 1:
        raise ValueError(f"--threads must be >= 1, got {threads}")
    import torch
    torch.set_num_threads(threads)


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--method", default=None, help="reference | prefix-cache | dual-cache | block, "
                   "+strategies, optionally :field=value,... as in bench specs, e.g. "
                   "block+focus:focus_alpha=3 (default: the checkpoint's generation_config.json, "
                   "else dual-cache for full attention, block for block diffusion)")
    p.add_argument("--max-new-tokens", type=int, default=None)
    p.add_argument("--block-length", type=int, default=None)
    p.add_argument("--steps", type=int, default=None, help="denoising steps per block")
    p.add_argument("--threshold", type=float, default=None)
    p.add_argument("--factor", type=float, default=None)
    p.add_argument("--temperature", type=float, default=None, help="0 = argmax (default)")
    p.add_argument("--remasking", default="low_confidence")
    p.add_argument("--seed", type=int, default=None,
                   help="sampling seed (default 0; dllm serve: a fresh one per request that sets none)")
    p.add_argument("--cfg-scale", type=float, default=0.0, help="classifier-free guidance (reference)")
    p.add_argument("--stop-at-eos", action=argparse.BooleanOptionalAction, default=None,
                   help="end after a finished block holding EOS (default: yes for block and "
                   "adaptive-length, no for the LLaDA decoders, which fill the whole canvas)")


def sampling_params(args: argparse.Namespace) -> "SamplingParams":
    """The options the command line gave; ``LLM.resolve`` fills the rest (one resolution)."""
    fields = dict(max_new_tokens=args.max_new_tokens, block_length=args.block_length, steps=args.steps,
                  threshold=args.threshold, factor=args.factor, temperature=args.temperature,
                  remasking=args.remasking, seed=args.seed, cfg_scale=args.cfg_scale,
                  stop_at_eos=args.stop_at_eos)
    from .sampling_params import parse_spec
    return parse_spec(args.method or "", **fields)  # a spec's own fields (method:field=value) win


def add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate from one prompt and print the text and stats")
    p.add_argument("--prompt", default=None, help="default: a held-out prompt of the task suite")
    p.add_argument("--chat", action="store_true", help="apply the chat template (default prompt: on)")
    add_model_args(p)
    add_sampling_args(p)


def run_generate(args: argparse.Namespace) -> None:
    set_threads(args.threads)
    given = sampling_params(args)  # bad options fail before the model loads
    llm = load_llm(args)
    params = llm.resolve(given)
    expected = None
    if args.prompt is None:
        from .tasks import load_split
        example = load_split(["story"], limit=1)[0]
        args.prompt, args.chat, expected = example.prompt, True, example.answer
    if args.chat:
        out = llm.chat([[{"role": "user", "content": args.prompt}]], params, use_tqdm=True)
    else:
        out = llm.generate([args.prompt], params, use_tqdm=True)
    print(f"model: {args.model}")
    print(f"method: {params.describe()}")
    print(f"prompt: {args.prompt}")
    print(f"output: {out[0].text}")
    if expected is not None:
        print(f"expected: {expected}  ({'correct' if out[0].text.strip() == expected else 'wrong'})")
    s = out.stats
    print(f"stats: nfe={s.nfe} decoded_tokens={s.decoded_tokens} output_tokens={s.output_tokens} "
          f"processed_tokens={s.processed_tokens:.1f} prefill_tokens={s.prefill_tokens} "
          f"redundancy={s.redundancy:.2f} tokens_per_step={s.tokens_per_step:.2f} "
          f"seconds={s.seconds:.3f} throughput={s.output_tokens / max(s.seconds, 1e-9):.1f} tok/s")


def split_ints(text: str) -> list[int]:
    """Comma-separated positive integers (batch sizes, concurrencies)."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers >= 1, got {text!r}")
    return values


def non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}")
    return value


def check_json_path(path: str | None) -> None:
    """Refuse a ``--json`` path that cannot be written before a run's work, not after it."""
    if path is None:
        return
    target = Path(path)
    if target.is_dir():
        raise ValueError(f"--json {path}: is a folder; give a file name")
    if not target.parent.is_dir():
        raise ValueError(f"--json {path}: folder {target.parent} does not exist")


def add_eval(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("eval", help="accuracy and speed of one method on the held-out task split")
    p.add_argument("--tasks", default="all",
                   help="'all', a family ('copy': short answers, 'worked': step-by-step answers in "
                        "one template, 'phrased': in free phrasing) or comma-separated task names")
    p.add_argument("--limit", type=int, default=None, help="prompts per task")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--json", default=None, help="write the report as JSON here")
    add_model_args(p)
    add_sampling_args(p)


def run_eval(args: argparse.Namespace) -> None:
    from .eval import evaluate
    from .outputs import write_json_atomic
    from .tasks import resolve_tasks
    args.tasks = resolve_tasks(args.tasks)  # a typo fails before the model loads
    check_json_path(args.json)
    set_threads(args.threads)
    given = sampling_params(args)  # bad options fail before the model loads
    llm = load_llm(args)
    params = llm.resolve(given)
    report = evaluate(llm, params, tasks=args.tasks, limit=args.limit, batch_size=args.batch_size)
    print(f"model: {args.model}")
    print(f"method: {params.describe()}")
    print(report.table())
    if args.json:
        write_json_atomic(args.json, report.as_dict())


def add_chain_probe(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("chain-probe", help="worked tasks: does the model compute each intermediate "
                       "result with the right masked, or only copy it (see eval/chain_probe.py)")
    p.add_argument("--tasks", default="sum,add,story", help="worked tasks whose results follow '='")
    p.add_argument("--limit", type=int, default=20, help="prompts per task")
    p.add_argument("--json", default=None, help="write the rows as JSON here")
    add_model_args(p)


def run_chain_probe(args: argparse.Namespace) -> None:
    from .eval.chain_probe import chain_probe, probe_table
    from .outputs import write_json_atomic
    from .tasks import load_split, resolve_tasks
    tasks = resolve_tasks(args.tasks)
    check_json_path(args.json)
    set_threads(args.threads)
    rows = chain_probe(load_llm(args), load_split(tasks, limit=args.limit))
    print(f"model: {args.model}")
    print(probe_table(rows))
    if args.json:
        write_json_atomic(args.json, [r.as_dict() for r in rows.values()])


def add_bench(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="compare method specs on the same prompts; JSON + plot")
    p.add_argument("--methods", nargs="+", required=True,
                   help="specs method[:field=value,...], e.g. dual-cache:threshold=0.9")
    p.add_argument("--batch-sizes", type=split_ints, default=[1, 8, 32])
    p.add_argument("--tasks", default="all",
                   help="'all', a family ('copy', 'worked', 'phrased') or comma-separated task names")
    p.add_argument("--limit", type=int, default=None, help="prompts per task")
    p.add_argument("--max-new-tokens", type=int, default=None, help="for every spec that does not set it")
    p.add_argument("--block-length", type=int, default=None, help="for every spec that does not set it")
    p.add_argument("--out", required=True, help="folder for results.json and throughput.png")
    p.add_argument("--repeats", type=int, default=1, metavar="N",
                   help="timed rounds of every spec, in turn, per batch size; each row keeps its "
                        "fastest pass and the table the range of the rounds' speed-ups (a shared machine)")
    add_model_args(p)


def run_bench(args: argparse.Namespace) -> None:
    from .bench.offline import HEADER, check_prompts, check_specs, run_bench as bench, table
    from .hub import resolve_model
    from .models.compiled import check_compile
    from .tasks import load_split
    if args.repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {args.repeats}")
    set_threads(args.threads)
    examples = load_split(args.tasks, limit=args.limit)  # a typo fails before the model loads
    args.tasks = list(dict.fromkeys(e.task for e in examples))
    defaults = {k: v for k, v in (("max_new_tokens", args.max_new_tokens),
                                  ("block_length", args.block_length)) if v is not None}
    check_compile(args.compile, args.tensor_parallel_size, args.compile_step)  # bench compiles after loading
    folder = str(resolve_model(args.model, args.revision))  # an id: fetched once, here
    resolved = check_specs(folder, args.methods, defaults)  # before the weights load
    prepare_out(args.out, "results.json")
    # --compile, --fixed-shapes, --compile-step: each spec runs as usual, then under each
    llm = load_llm(args, folder, compile=False, fixed_shapes=False, compile_step=False)
    variants = [name for name, on in (("fixed shapes", args.fixed_shapes), ("compiled step", args.compile_step)) if on]
    check_prompts(llm, {spec: llm.resolve(p) for spec, p in resolved.items()}, examples)  # before the header
    for spec, params in resolved.items():
        print(f"method: {spec} = {params.describe()}")
    from .engine.host_memory import is_kept
    print(f"model: {args.model}  prompts: {len(examples)}  tasks: {','.join(args.tasks)}  device: {args.device}  "
          f"keep_freed_memory: {'on' if is_kept() else 'off'}  repeats: {args.repeats}")
    print(HEADER)
    records = bench(llm, args.methods, args.batch_sizes, examples, args.out, defaults,
                    compare_compiled=args.compile, variants=variants, repeats=args.repeats)
    print()
    print(table(records))
    print(f"\nwrote {args.out}/results.json and {args.out}/throughput.png")


def prepare_out(out: str | None, name: str) -> None:
    """A bench's ``--out``: created and checked before anything runs; one line when the ``name``
    file of an earlier run there is about to be replaced (re-running into a folder is normal)."""
    if out is None:
        return
    from .outputs import prepare_out_dir
    target = prepare_out_dir(out) / name
    if target.exists():
        print(f"replacing {target} (from an earlier run)")


def add_profile(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("profile", help="time per step: the model's forward alone (floor) against "
                       "everything else, and host synchronisations per step")
    p.add_argument("--methods", nargs="+", required=True, help="specs as in dllm bench")
    p.add_argument("--batch-sizes", type=split_ints, default=[1, 64])
    p.add_argument("--tasks", default="copy",
                   help="'copy' (default), 'worked', 'phrased', 'all' or comma-separated task names, "
                        "as in dllm bench")
    p.add_argument("--limit", type=int, default=2, help="prompts per task")
    p.add_argument("--max-new-tokens", type=int, default=None, help="for every spec that does not set it")
    p.add_argument("--repeats", type=int, default=1,
                   help="timed and floor passes, alternating; each keeps its fastest (a shared machine)")
    p.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                   help="wall time, or the engine thread's CPU time (barely disturbed by other "
                        "processes; tok/s then counts CPU seconds; use with --threads 1)")
    add_model_args(p)


def run_profile(args: argparse.Namespace) -> None:
    from .bench.profile import HEADER, run_profile as profile, table
    from .tasks import load_split
    if args.tensor_parallel_size != 1:  # its floor pass calls modules whose collectives need every rank
        raise ValueError("dllm profile replays the model's modules in this process; run it with "
                         "--tensor-parallel-size 1")
    if args.compile_step:  # its floor would time the eager modules, not the compiled graph
        raise ValueError("dllm profile replays each module eagerly, so it cannot time a compiled "
                         "step; use --fixed-shapes here, and dllm bench --compile-step for its speed")
    if args.repeats < 1:  # before the weights load
        raise ValueError(f"--repeats must be >= 1, got {args.repeats}")
    examples = load_split(args.tasks, limit=args.limit)  # a typo fails before the model loads
    set_threads(args.threads)
    llm = load_llm(args)  # as dllm bench: freed host memory kept unless --no-keep-freed-memory
    defaults = {"max_new_tokens": args.max_new_tokens} if args.max_new_tokens else {}
    tasks = ",".join(dict.fromkeys(e.task for e in examples))
    print(f"model: {args.model}  prompts: {len(examples)}  tasks: {tasks}  device: {args.device}  "
          f"compile: {'on' if args.compile else 'off'}  fixed shapes: {'on' if args.fixed_shapes else 'off'}  "
          f"repeats: {args.repeats}  clock: {args.clock}")
    print(HEADER)
    records = profile(llm, args.methods, args.batch_sizes, examples, defaults, repeats=args.repeats,
                      clock=args.clock)
    print()
    print(table(records))


def add_train(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="train an embedded tiny checkpoint on the task suite (CPU)")
    p.add_argument("--family", required=True, choices=["llada", "sdar"])
    p.add_argument("--out", required=True, help="checkpoint folder to write")
    p.add_argument("--work", required=True, help="folder for the resumable state and loss log")
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-kv-heads", type=int, default=4)
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--max-new-tokens", type=int, default=256, help="written to generation_config.json")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--init-from", default=None, help="start from this checkpoint's weights")
    p.add_argument("--save-every", type=int, default=50, metavar="N",
                   help="save the resumable state to --work every N steps (and on Ctrl-C / SIGTERM, "
                        "after the current step); rerunning the same command resumes")
    p.add_argument("--export-only", action="store_true",
                   help="write --work's last saved state to --out as a checkpoint and exit "
                        "(check a run that is still training)")
    p.add_argument("--ar-weight", type=float, default=1.0,
                   help="weight of the auxiliary causal next-token loss (0 = diffusion loss only)")
    p.add_argument("--suffix-mask", type=float, default=0.0, metavar="SHARE",
                   help="share of rows masked as a left-to-right decoder sees them: clean before a "
                        "random cut, fully masked a block after it (0 = uniform masking only)")
    p.add_argument("--block-aux", type=float, default=0.0, metavar="WEIGHT",
                   help="llada: add the block diffusion loss (SDAR's objective, block --block-size) "
                        "on the same examples with this weight: every block learns from a clean left "
                        "context (0 = off)")
    p.add_argument("--long-tails", type=float, default=0.05, metavar="SHARE",
                   help="llada: share of batches whose EOS tail runs on to a canvas of up to 256 "
                        "tokens (the rest: the answer plus 0-32 EOS; sdar's block diffusion uses none)")
    p.add_argument("--task-mix", type=task_mix, default=None, metavar="TASK=N,...",
                   help="oversample tasks: N examples of TASK per round of one of each other task "
                        "(e.g. lookup=3,spell=2)")


def task_mix(text: str) -> dict[str, int]:
    """``lookup=3,spell=2`` -> {"lookup": 3, "spell": 2} (argparse type for --task-mix)."""
    mix = {}
    for item in filter(None, text.split(",")):
        name, sep, weight = item.partition("=")
        if not sep or not weight.strip().isdigit() or int(weight) < 1:
            raise argparse.ArgumentTypeError(f"expected TASK=N with N >= 1, got {item!r}")
        mix[name.strip()] = int(weight)
    return mix


def run_train(args: argparse.Namespace) -> None:
    import torch
    from .train import TrainConfig, Trainer
    from .train.trainer import Interrupted
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = TrainConfig(family=args.family, out=args.out, work=args.work, steps=args.steps,
                      batch_size=args.batch_size, lr=args.lr, seed=args.seed,
                      num_kv_heads=args.num_kv_heads, block_size=args.block_size,
                      max_new_tokens=args.max_new_tokens, save_every=args.save_every,
                      init_from=args.init_from, ar_weight=args.ar_weight, task_mix=args.task_mix,
                      suffix_mask=args.suffix_mask, block_aux=args.block_aux,
                      long_tails=args.long_tails)
    trainer = Trainer(cfg)
    try:
        out = trainer.export_saved() if args.export_only else trainer.train()
    except Interrupted as e:  # the state is saved: one line, no traceback, the shell's exit code
        print(e, file=sys.stderr)
        raise SystemExit(e.exit_code) from None
    print(f"checkpoint written to {out}")


def add_serve(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server with continuous batching")
    p.add_argument("model", nargs="?", default=None,
                   help="checkpoint folder or Hugging Face id (default: tiny-llada)")
    p.add_argument("--model", dest="model_option", default=None, help="the same as the positional MODEL")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--max-num-seqs", type=int, default=256, help="sequences in the running batch")
    p.add_argument("--max-queue", type=non_negative_int, default=256, help="waiting sequences before 429")
    p.add_argument("--served-model-name", default=None, help="the model id clients use (default: folder name)")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds in-flight requests may finish after SIGINT/SIGTERM")
    p.add_argument("--log-level", default="info")
    p.add_argument("--api-key", default=None,
                   help="require `Authorization: Bearer KEY` on /v1/* (default: open)")
    add_model_args(p, model=False)
    add_sampling_args(p)  # the defaults of requests that leave an option out
    add_replica_args(p)


def replicas(text: str) -> int | str:
    """``--replicas``: a count, or ``auto`` (Ray Serve autoscaling)."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--replicas must be a number or 'auto', got {text!r}") from None


def add_replica_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("data-parallel replicas on Ray Serve (pip install -e '.[distributed]')")
    g.add_argument("--replicas", type=replicas, default=None, metavar="N|auto",
                   help="serve N copies of the model, each in its own process, behind one endpoint "
                   "(default: one engine in this process, no Ray)")
    g.add_argument("--min-replicas", type=int, default=1, help="--replicas auto: fewest replicas")
    g.add_argument("--max-replicas", type=int, default=4, help="--replicas auto: most replicas")
    g.add_argument("--target-ongoing-requests", type=float, default=16.0,
                   help="--replicas auto: ongoing requests per replica that autoscaling aims at")
    g.add_argument("--threads-per-replica", type=int, default=None,
                   help="torch CPU threads of each replica (default: CPU cores / replicas)")
    g.add_argument("--ray-address", default=None,
                   help="join this Ray cluster (e.g. auto, ray://head:10001); default: start a "
                   "local Ray instance for the server's lifetime")


def serve_model(args: argparse.Namespace) -> str:
    """``dllm serve MODEL`` or ``dllm serve --model MODEL`` (vLLM accepts both)."""
    if args.model and args.model_option and args.model != args.model_option:
        raise ValueError(f"two models given: {args.model!r} and --model {args.model_option!r}; give one")
    return args.model or args.model_option or str(DEFAULT_MODEL)


def check_listen(host: str, port: int) -> None:
    """Fail before loading anything if the server could not listen on host:port."""
    import socket
    if not 1 <= port <= 65535:
        raise ValueError(f"--port {port} is not a TCP port; use 1..65535")
    try:
        socket.create_server((host, port)).close()
    except OSError as e:
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None


def run_serve(args: argparse.Namespace) -> None:
    if args.replicas is not None:
        return run_serve_replicated(args)
    if args.ray_address is not None:
        raise ValueError("--ray-address needs --replicas N or --replicas auto: the single-process "
                         "server runs no Ray")
    from .server import run_server
    model = serve_model(args)
    check_listen(args.host, args.port)
    set_threads(args.threads)
    defaults = sampling_params(args)
    llm = load_llm(args, model, max_num_seqs=args.max_num_seqs)
    resolved = llm.resolve(defaults)  # a default the model cannot run: refuse to start
    print(f"serving {model} at http://{args.host}:{args.port}/v1")
    print(f"default method: {resolved.describe()}")
    run_server(llm, args.host, args.port, defaults, args.served_model_name, args.max_queue,
               args.shutdown_timeout, args.log_level, args.api_key)


def run_serve_replicated(args: argparse.Namespace) -> None:
    import os
    if args.tensor_parallel_size != 1:
        raise ValueError("--tensor-parallel-size with --replicas is not supported yet: a replica "
                         "runs in one process; use one or the other")
    try:
        from .server.replicated import ReplicaOptions, Scaling, run_replicated
    except ImportError as e:
        raise ValueError(f"--replicas needs Ray Serve ({e}): pip install -e '.[distributed]'") from None
    from . import LLM
    model = serve_model(args)
    scaling = Scaling(None if args.replicas == "auto" else args.replicas, args.min_replicas,
                      args.max_replicas, args.target_ongoing_requests)
    threads = args.threads_per_replica
    if threads is None:
        threads = max(1, (os.cpu_count() or 1) // scaling.most)
    replica = ReplicaOptions(model, args.dtype, args.device, args.max_num_seqs, args.max_queue,
                             threads, args.shutdown_timeout, args.keep_freed_memory, args.compile,
                             args.fixed_shapes, args.compile_step, revision=args.revision)
    defaults = sampling_params(args)
    # reads no weights (an id is fetched here once); refuses a bad default
    LLM(model, dtype=args.dtype, device="meta", revision=args.revision).resolve(defaults)
    run_replicated(replica, scaling, defaults, args.served_model_name, args.host, args.port, args.ray_address)


def add_bench_serve(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench-serve", help="load-test a running `dllm serve` (also: dllm bench serve)")
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--concurrency", type=split_ints, default=[1, 8, 32, 64])
    p.add_argument("--num-requests", type=int, default=64, help="requests per concurrency level")
    p.add_argument("--tasks", default="all", help="'all', a family ('copy', 'worked', 'phrased') or task names")
    p.add_argument("--max-tokens", type=int, default=None)
    p.add_argument("--length-mix", default=None,
                   help="per-request max_tokens, e.g. 64x200,960x10 (sets the number of requests; "
                        "each length spread evenly over the run)")
    p.add_argument("--method", default=None)
    p.add_argument("--threshold", type=float, default=None)
    p.add_argument("--block-length", type=int, default=None)
    p.add_argument("--options", default=None, help='other request fields as JSON, e.g. \'{"focus_alpha": 2}\'')
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--out", default=None, help="folder for serve_bench.json and serve_bench.png")


def run_bench_serve(args: argparse.Namespace) -> None:
    import json
    from .bench.serve import HEADER, parse_length_mix, run_serve_bench
    extra = {k: v for k, v in (("max_tokens", args.max_tokens), ("method", args.method),
                               ("threshold", args.threshold), ("block_length", args.block_length))
             if v is not None}
    if args.options:
        try:
            extra.update(json.loads(args.options))
        except (json.JSONDecodeError, TypeError, ValueError) as e:
            raise ValueError(f"--options must be a JSON object: {e}") from None
    lengths = parse_length_mix(args.length_mix) if args.length_mix else None
    prepare_out(args.out, "serve_bench.json")
    print(f"server: {args.url}  requests per level: {len(lengths) if lengths else args.num_requests}  "
          f"options: {extra}" + (f"  length mix: {args.length_mix}" if lengths else ""))
    print(HEADER)
    run_serve_bench(args.url, args.concurrency, args.num_requests, args.out, extra, args.tasks, args.timeout,
                    lengths=lengths)
    if args.out:
        print(f"\nwrote {args.out}/serve_bench.json and {args.out}/serve_bench.png")


def add_download(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("download", help="fetch a Hugging Face model id's files the engine reads into "
                       "the cache and print the folder (last line of stdout)")
    p.add_argument("model", help="Hugging Face id, org/name")
    p.add_argument("--revision", default=None, help="branch, tag or commit hash (default: main)")
    p.add_argument("--cache-dir", default=None,
                   help="cache folder (default: huggingface_hub's: HF_HUB_CACHE, else HF_HOME/hub)")


def run_download(args: argparse.Namespace) -> None:
    from .hub import download_model
    print(download_model(args.model, args.revision, args.cache_dir))  # progress bars go to stderr


def add_lm_eval_tasks(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("lm-eval-tasks", help="write the held-out splits as lm-eval YAML tasks "
                       "(for lm_eval --include_path DIR)")
    p.add_argument("--out", required=True,
                   help="folder for dllm_<task>.yaml, a group per task family and dllm_suite.yaml")


def run_lm_eval_tasks(args: argparse.Namespace) -> None:
    from .integrations.lm_eval_tasks import groups, write_tasks
    names = write_tasks(args.out)
    print(f"wrote {len(names)} tasks ({', '.join(names)}) and the groups "
          f"{', '.join(groups([n.removeprefix('dllm_') for n in names]))} to {args.out}")


def run_lm_eval(argv: list[str]) -> int:
    """``dllm lm-eval ARGS``: lm-eval's command line with the ``dllm`` model registered and the
    embedded tasks on its include path (unless ARGS sets ``--include_path``)."""
    import tempfile
    try:
        from .integrations import lm_eval  # noqa: F401  (registers the model "dllm")
    except ImportError as e:
        print(f"error: dllm lm-eval needs the lm-eval extra (pip install -e '.[lm-eval]'): {e}",
              file=sys.stderr)
        return 2
    from lm_eval.__main__ import cli_evaluate
    from .integrations.lm_eval_tasks import write_tasks
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


COMMANDS = {"generate": (add_generate, run_generate), "eval": (add_eval, run_eval),
            "chain-probe": (add_chain_probe, run_chain_probe),
            "bench": (add_bench, run_bench), "profile": (add_profile, run_profile), "train": (add_train, run_train),
            "serve": (add_serve, run_serve), "bench-serve": (add_bench_serve, run_bench_serve),
            "lm-eval-tasks": (add_lm_eval_tasks, run_lm_eval_tasks),
            "download": (add_download, run_download)}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:2] == ["bench", "serve"]:  # the load generator lives beside the offline bench
        argv = ["bench-serve", *argv[2:]]
    if argv[:1] == ["lm-eval"]:  # every other argument belongs to lm-eval's own parser
        try:
            return run_lm_eval(argv[1:])
        except KeyboardInterrupt:
            print("interrupted", file=sys.stderr)
            return 130
    parser = argparse.ArgumentParser(prog="dllm", description=__doc__)
    parser.add_argument("--version", action="version", version=f"dllm-engine {version('dllm-engine')}")
    sub = parser.add_subparsers(dest="command", required=True)
    for add, _ in COMMANDS.values():
        add(sub)
    sub.add_parser("lm-eval", help="lm-evaluation-harness with the model 'dllm' and the embedded tasks "
                   "(needs the lm-eval extra; every argument goes to lm-eval: dllm lm-eval --help)")
    args = parser.parse_args(argv)
    try:
        COMMANDS[args.command][1](args)
    except (ValueError, OSError) as e:  # bad input: one line, no traceback
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:  # Ctrl-C: one line (a bench says what it kept), the shell's 130
        print(f"interrupted: {e}" if str(e) else "interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
