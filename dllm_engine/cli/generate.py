"""``dllm generate``: one prompt, its text and stats."""
from __future__ import annotations

import argparse
import secrets
import sys

from . import common  # common.load_llm, looked up per call: tests stand in for the model
from .common import add_model_args, add_sampling_args, sampling_params, set_threads
from ..errors import UserError
from ..sampling_params import MAX_SEED
from ..seeds import SeedStream


def add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate from one prompt and print the text and stats")
    p.add_argument("--prompt", default=None, help="default: a held-out prompt of the task suite the "
                   "embedded checkpoints were trained on (the lab's dataset 'tasks')")
    form = p.add_mutually_exclusive_group()
    form.add_argument("--raw", action="store_true",
                      help="a plain completion of the prompt (default: the checkpoint's chat template "
                           "when it has one)")
    form.add_argument("--chat", action="store_true",
                      help="apply the chat template, and fail if the checkpoint has none")
    p.add_argument("--show-steps", action="store_true",
                   help="print the decoding trace: one line per forward, the slots it committed "
                        "and what each strategy did (docs/traces.md)")
    add_model_args(p)
    add_sampling_args(p)


def use_chat(args: argparse.Namespace, llm) -> bool:
    """Chat unless ``--raw`` or the checkpoint has no chat template; says which on stderr."""
    has_template = bool(getattr(llm.tokenizer, "chat_template", None))
    if args.chat and not has_template:
        raise UserError(f"{args.model} has no chat template in its tokenizer_config.json; drop --chat")
    if args.raw:
        print("prompt format: a plain completion (--raw)", file=sys.stderr)
    elif has_template:
        print("prompt format: the checkpoint's chat template applied (--raw for a plain completion)",
              file=sys.stderr)
    else:
        print("prompt format: a plain completion (the checkpoint has no chat template)", file=sys.stderr)
    return has_template and not args.raw


def run_generate(args: argparse.Namespace) -> None:
    set_threads(args.threads)
    given = sampling_params(args)  # bad options fail before the model loads
    expected = None
    if args.prompt is None:  # the default dataset's, or a clear error, before the model loads
        example = default_prompt()
        args.prompt, expected = example.prompt, example.answer
    llm = common.load_llm(args)
    common.check_method_family(args, llm)
    params = llm.resolve(given.replace(record_steps=True) if args.show_steps else given)
    if params.temperature > 0 and args.seed is None:  # sampled: a fresh stream each run, said below
        llm.seeds = SeedStream(secrets.randbelow(MAX_SEED))
    if use_chat(args, llm):
        out = llm.chat([[{"role": "user", "content": args.prompt}]], params, use_tqdm=True)
    else:
        out = llm.generate([args.prompt], params, use_tqdm=True)
    print(f"model: {args.model}")
    print(f"method: {params.describe()}")
    if params.temperature > 0:
        print(f"seed: {llm.seeds.seed} (--seed {llm.seeds.seed} samples the same answer again)")
    print(f"prompt: {args.prompt}")
    print(f"output: {out[0].text}")
    if expected is not None:
        print(f"expected: {expected}  ({'correct' if out[0].text.strip() == expected else 'wrong'})")
    s = out.stats
    print(f"stats: nfe={s.nfe} decoded_tokens={s.decoded_tokens} output_tokens={s.output_tokens} "
          f"processed_tokens={s.processed_tokens:.1f} prefill_tokens={s.prefill_tokens} "
          f"redundancy={s.redundancy:.2f} tokens_per_step={s.tokens_per_step:.2f} "
          f"seconds={s.seconds:.3f} throughput={s.output_tokens / max(s.seconds, 1e-9):.1f} tok/s")
    if args.show_steps:
        if out[0].canvas_steps is not None:  # a canvas family (DiffusionGemma): its denoising steps
            from ..engine.canvas_llm import format_canvas_steps
            print(format_canvas_steps(out[0].steps))
        else:
            from ..engine.trace import format_steps
            print(format_steps(out[0].steps, len(out[0].prompt_token_ids)))


def default_prompt():
    """The default dataset's demo prompt; a ``UserError`` asking for ``--prompt`` without one."""
    from .. import datasets
    try:
        demo = datasets.get().demo
    except UserError as e:
        raise UserError(f"give a prompt: --prompt TEXT ({e})") from None
    if demo is None:
        raise UserError(f"give a prompt: --prompt TEXT (the dataset {datasets.DEFAULT!r} has no default one)")
    return demo()
