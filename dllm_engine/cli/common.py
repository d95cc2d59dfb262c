"""What every ``dllm`` command shares: the model and sampling options, building the LLM, and the
small argparse types and output checks several commands use."""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import UserError

if TYPE_CHECKING:  # the command line imports the engine lazily, per command
    from ..sampling_params import SamplingParams


def embedded_checkpoints() -> Path:
    """The folder of the embedded tiny checkpoints: ``dllm_engine/checkpoints`` in an installed
    wheel (package data), else the source checkout's ``checkpoints/`` beside the package, which
    the wheel copies (setup.py)."""
    package = Path(__file__).resolve().parent.parent
    installed = package / "checkpoints"
    return installed if installed.is_dir() else package.parent / "checkpoints"


CHECKPOINTS = embedded_checkpoints()
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
    p.add_argument("--quantization", default=None, choices=["int8", "int4"],
                   help="weight-only quantization of the linear layers on load, through torchao: int8 (CPU "
                        "and CUDA) or int4 (CUDA, bfloat16); not bit-exact (docs/quantization.md)")
    p.add_argument("--prefix-cache", action=argparse.BooleanOptionalAction, default=True,
                   help="block-causal models (SDAR, LLaDA2.x): reuse the K/V of final blocks earlier requests "
                        "computed for the same leading tokens; every model: the n copies of a prompt "
                        "compute their first forward once (both exact; default on)")
    p.add_argument("--kv-cache-memory", default=None, metavar="BYTES",
                   help="a memory budget for the KV cache and a step's temporaries, e.g. 2GiB: a request "
                        "joins the running batch when it fits, waits while it does not, and one that never "
                        "could is refused (default: no budget, --max-num-seqs alone)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9, metavar="F",
                   help="on CUDA without --kv-cache-memory: the budget is this share of the device's "
                        "memory less the weights (default 0.9)")
    p.add_argument("--fixed-shapes", action="store_true",
                   help="round every step's rows, tokens and keys up to buckets (at most a quarter "
                        "more), with a mask and indexed K/V writes: the shapes a CUDA graph can capture "
                        "(same tokens; off by default: the padding costs compute on a CPU)")
    p.add_argument("--compile-step", action="store_true",
                   help="--fixed-shapes, and each step's whole layer stack torch.compiled without "
                        "dynamic shapes: one graph per shape bucket (CUDA graphs on CUDA); not "
                        "bit-exact; off by default")


def load_llm(args: argparse.Namespace, model: str | None = None, **kw):
    """The model of a command's ``--model`` (or ``model``) with the command's engine options; a
    canvas checkpoint (DiffusionGemma) only for ``dllm generate``, ``serve``, ``playground``,
    ``bench``, ``profile`` and ``eval`` (the lab's), refused for the other commands (the lab's
    probes and trainer) before any weight loads."""
    from .. import LLM
    if getattr(args, "command", None) not in ("generate", "serve", "playground", "bench", "profile", "eval"):
        from ..engine.canvas_llm import refuse_canvas
        refuse_canvas(model or args.model, args.revision, f"dllm {getattr(args, 'command', None) or 'this command'}")
    kw.setdefault("compile", getattr(args, "compile", False))
    kw.setdefault("fixed_shapes", getattr(args, "fixed_shapes", False))
    kw.setdefault("compile_step", getattr(args, "compile_step", False))
    kw.setdefault("kv_cache_memory", getattr(args, "kv_cache_memory", None))
    kw.setdefault("quantization", getattr(args, "quantization", None))
    kw.setdefault("prefix_cache", getattr(args, "prefix_cache", True))
    kw.setdefault("gpu_memory_utilization", getattr(args, "gpu_memory_utilization", 0.9))
    if getattr(args, "seed", None) is not None:
        kw.setdefault("seed", args.seed)
    return LLM(model or args.model, revision=args.revision, dtype=args.dtype, device=args.device,
               keep_freed_memory=args.keep_freed_memory,
               tensor_parallel_size=getattr(args, "tensor_parallel_size", 1), **kw)


def set_threads(threads: int | None) -> None:
    if threads is None:
        return
    if threads < 1:
        raise UserError(f"--threads must be >= 1, got {threads}")
    import torch
    torch.set_num_threads(threads)


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--method", default=None, help="reference | prefix-cache | dual-cache | block, "
                   "+strategies, optionally :field=value,... as in bench specs, e.g. "
                   "block+focus:focus_alpha=3 (default: the checkpoint's generation_config.json, "
                   "else dual-cache for full attention, block for block diffusion; DiffusionGemma: "
                        "diffusion-gemma[:steps=N,...], its own sampler)")
    p.add_argument("--max-new-tokens", type=int, default=None)
    p.add_argument("--block-length", type=int, default=None)
    p.add_argument("--steps", type=int, default=None, help="denoising steps per block")
    p.add_argument("--threshold", type=float, default=None)
    p.add_argument("--factor", type=float, default=None)
    p.add_argument("--temperature", type=float, default=None, help="0 = argmax (default)")
    p.add_argument("--remasking", default="low_confidence")
    p.add_argument("--seed", type=int, default=None,
                   help="seeds the stream of seeds requests take, so a sampled run repeats (default 0; "
                   "dllm generate: a fresh one when sampling, printed; dllm serve: a fresh seed per "
                   "request that sets none)")
    p.add_argument("--cfg-scale", type=float, default=0.0, help="classifier-free guidance (reference)")
    p.add_argument("--stop-at-eos", action=argparse.BooleanOptionalAction, default=None,
                   help="end after the finished block holding the first stop token (default: yes, "
                   "every decoder; the text is the same either way; --no-stop-at-eos decodes the "
                   "whole canvas, as LLaDA's and Fast-dLLM's reference loops do)")


def add_prompt_source(p: argparse.ArgumentParser, tasks_default: str, tasks_help: str) -> None:
    """``--dataset`` and its ``--tasks`` (a registered dataset's held-out prompts: ``datasets``), or
    ``--prompts FILE.jsonl`` (``bench.prompts``), not both."""
    from ..datasets import DEFAULT
    p.add_argument("--dataset", default=DEFAULT,
                   help=f"a dataset an installed package registers (default: {DEFAULT!r}, the task suite "
                        "the embedded checkpoints were trained on, registered by the lab, dllm-lab)")
    source = p.add_mutually_exclusive_group()
    source.add_argument("--tasks", default=tasks_default,
                        help=f"which of the dataset's prompts; of the task suite 'tasks': {tasks_help}")
    source.add_argument("--prompts", default=None, metavar="FILE.jsonl",
                        help='prompts from a JSON-lines file instead of a dataset: one object a line, '
                             '"prompt" (a user message, through the chat template) or "messages" (a list of '
                             '{role, content}), and optionally "answer": when every line has one, accuracy is '
                             'exact match of the stripped output against it; when none has, accuracy is n/a '
                             '("-"); not with --tasks')


def load_examples(args: argparse.Namespace, limit: int | None):
    """The prompts a bench or profile runs: ``--prompts``' lines (the first ``limit``), else the
    held-out prompts of ``--tasks`` in ``--dataset`` (``limit`` per task); a bad file, dataset or
    task name fails here, before any model loads or server is asked."""
    if args.prompts is not None:
        from ..bench.prompts import load_prompts
        return load_prompts(args.prompts, limit)
    from .. import datasets
    return datasets.load(args.tasks, limit, name=args.dataset)


def workload(args: argparse.Namespace, examples) -> str:
    """What a bench or profile runs, for its header line: the prompts file, or the tasks."""
    if args.prompts is not None:
        return f"prompts file: {args.prompts}"
    tasks = ",".join(dict.fromkeys(e.task for e in examples))
    from ..datasets import DEFAULT
    return f"tasks: {tasks}" if args.dataset == DEFAULT else f"dataset: {args.dataset}, tasks: {tasks}"


def sampling_params(args: argparse.Namespace) -> "SamplingParams":
    """The options the command line gave; ``LLM.resolve`` fills the rest (one resolution)."""
    fields = dict(max_new_tokens=args.max_new_tokens, block_length=args.block_length, steps=args.steps,
                  threshold=args.threshold, factor=args.factor, temperature=args.temperature,
                  remasking=args.remasking, cfg_scale=args.cfg_scale,
                  stop_at_eos=args.stop_at_eos)
    from ..engine.canvas_llm import parse_any_spec  # DiffusionGemma's sampler: its own fields
    return parse_any_spec(args.method or "", **fields)  # a spec's own fields (method:field=value) win


def check_method_family(args: argparse.Namespace, llm) -> None:
    """``--method diffusion-gemma`` on a masked-diffusion checkpoint (or a masked-diffusion
    method on DiffusionGemma's, which ``CanvasLLM.resolve`` refuses): a ``UserError`` naming both."""
    from ..engine.canvas_llm import METHOD, CanvasLLM, is_canvas_spec
    if is_canvas_spec(args.method) and not isinstance(llm, CanvasLLM):
        raise UserError(f"--method {METHOD} is DiffusionGemma's sampler; {args.model} is a {llm.model_type} "
                        f"checkpoint: its methods are {', '.join(llm.methods)}")


def split_ints(text: str) -> list[int]:
    """Comma-separated positive integers (batch sizes, concurrencies)."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers >= 1, got {text!r}")
    return values


def split_quantizations(text: str) -> list[str]:
    """Comma-separated quantization methods (int8, int4)."""
    from ..models.quantize import QUANTIZATIONS
    names = [x.strip() for x in text.split(",") if x.strip()]
    unknown = [n for n in names if n not in QUANTIZATIONS]
    if not names or unknown:
        raise argparse.ArgumentTypeError(f"expected comma-separated quantization methods "
                                         f"({', '.join(QUANTIZATIONS)}), got {text!r}")
    return list(dict.fromkeys(names))


def non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}")
    return value


def check_output_path(path: str | None, flag: str = "--json") -> None:
    """Refuse an output file (``flag``'s) that cannot be written before a run's work, not after it."""
    if path is None:
        return
    target = Path(path)
    if target.is_dir():
        raise UserError(f"{flag} {path}: is a folder; give a file name")
    if not target.parent.is_dir():
        raise UserError(f"{flag} {path}: folder {target.parent} does not exist")


def prepare_out(out: str | None, name: str) -> None:
    """A bench's ``--out``: created and checked before anything runs; one line when the ``name``
    file of an earlier run there is about to be replaced (re-running into a folder is normal)."""
    if out is None:
        return
    from ..outputs import prepare_out_dir
    target = prepare_out_dir(out) / name
    if target.exists():
        print(f"replacing {target} (from an earlier run)")
