"""``dllm train``: train an embedded tiny checkpoint (the trainer lives in ``dllm_lab.train``);
``dllm canvas-rows``: rows from a model's own decoded canvases for it to train on."""
from __future__ import annotations

import argparse
import sys
from dataclasses import MISSING, fields
from typing import TYPE_CHECKING

from dllm_engine.cli import common  # common.load_llm, looked up per call: tests stand in for the model
from dllm_engine.errors import UserError
from dllm_engine.cli.common import add_model_args, add_sampling_args, check_output_path, sampling_params, set_threads

if TYPE_CHECKING:
    from ..train import TrainConfig


class TrainConfigDefaults(argparse.HelpFormatter):
    """``dllm train --help`` shows each option's default as TrainConfig has it (the one place the
    defaults live; the parser leaves an option it was not given unset), importing the trainer only
    when the help is printed."""

    def _get_help_string(self, action: argparse.Action) -> str:
        from ..train import TrainConfig
        default = {f.name: f.default for f in fields(TrainConfig)}.get(action.dest)
        text = action.help or ""
        if default is None or default is MISSING or not action.option_strings:
            return text
        return f"{text} (default: {default})" if text else f"default: {default}"


def add_train(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="train an embedded tiny checkpoint on the task suite (CPU or GPU)",
                       argument_default=argparse.SUPPRESS, formatter_class=TrainConfigDefaults)
    p.add_argument("--family", required=True, choices=["llada", "sdar"])
    p.add_argument("--out", required=True, help="checkpoint folder to write")
    p.add_argument("--work", required=True, help="folder for the resumable state and loss log")
    p.add_argument("--steps", type=int, help="training steps (a resumed run may be given more)")
    p.add_argument("--batch-size", type=int, help="examples per step")
    p.add_argument("--lr", type=float, help="peak learning rate: linear warm-up, then cosine decay to a tenth")
    p.add_argument("--seed", type=int, help="seeds every step's examples and noise (and a new model's weights)")
    p.add_argument("--hidden-size", type=int, help="model width")
    p.add_argument("--num-layers", type=int,
                   help="with --init-from: more layers than the checkpoint's are appended, each starting as "
                        "the identity")
    p.add_argument("--num-heads", type=int, help="attention heads")
    p.add_argument("--num-kv-heads", type=int, help="key / value heads (fewer than --num-heads: grouped-query attention)")
    p.add_argument("--intermediate-size", type=int,
                   help="MLP width; with --init-from a wider one keeps the checkpoint's units and adds "
                        "new ones whose output starts at zero")
    p.add_argument("--block-size", type=int, help="sdar: the trained block; llada: --block-aux's block")
    p.add_argument("--max-new-tokens", type=int, help="written to generation_config.json")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")  # not a TrainConfig field: its default is here
    p.add_argument("--device",
                   help="cpu, cuda or cuda:N (free to change when resuming; batches are drawn on the CPU)")
    p.add_argument("--init-from", help="start from this checkpoint's weights")
    p.add_argument("--save-every", type=int, metavar="N",
                   help="save the resumable state to --work every N steps (and on Ctrl-C / SIGTERM, "
                        "after the current step); rerunning the same command resumes")
    p.add_argument("--export-only", action="store_true", default=False,
                   help="write --work's last saved state to --out as a checkpoint and exit "
                        "(check a run that is still training)")
    p.add_argument("--ar-weight", type=float,
                   help="weight of the auxiliary causal next-token loss (0 = diffusion loss only)")
    p.add_argument("--suffix-mask", type=float, metavar="SHARE",
                   help="share of rows masked as a left-to-right decoder sees them: clean before a "
                        "random cut, fully masked a block after it (0 = uniform masking only)")
    p.add_argument("--block-aux", type=float, metavar="WEIGHT",
                   help="llada: add the block diffusion loss (SDAR's objective, block --block-size) "
                        "on the same examples with this weight: every block learns from a clean left "
                        "context (0 = off)")
    p.add_argument("--long-tails", type=float, metavar="SHARE",
                   help="llada: share of batches whose EOS tail runs on to a canvas of up to 256 "
                        "tokens (the rest: the answer plus 0-32 EOS; sdar's block diffusion uses none)")
    p.add_argument("--task-mix", type=task_mix, metavar="TASK=N,...",
                   help="oversample tasks: N examples of TASK per round of one of each other task "
                        "(e.g. lookup=3,spell=2; N=0 leaves TASK out)")
    p.add_argument("--canvas-rows", nargs="+", metavar="FILE",
                   help="add the loss of rows from a model's own decoded canvases, as `dllm "
                        "canvas-rows` writes them (sdar: written by a block decoder with --block-size); "
                        "several files (rounds' rows) are joined into one set")
    p.add_argument("--new-rows-first", type=int, metavar="STEPS",
                   help="with --init-from a checkpoint whose vocabulary this run grows: train only the new "
                        "words' embedding and head rows for the first STEPS steps (the loaded model stays "
                        "as it was), then everything")
    p.add_argument("--distill-from", metavar="CKPT",
                   help="add the KL from this checkpoint's predictions to the model's at the masked slots "
                        "of the rows it can read (every word in its vocabulary), e.g. the --init-from "
                        "checkpoint: what it could do is kept as it did it")
    p.add_argument("--distill-weight", type=float, help="weight of the --distill-from term")
    p.add_argument("--canvas-batch", type=int, help="canvas rows per step")
    p.add_argument("--canvas-weight", type=float, help="weight of the canvas rows' loss")


def add_canvas_rows(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("canvas-rows", help="phrased tasks: training rows from a model's own decoded "
                       "canvases, each finished into a phrasing that fits it, for `dllm train "
                       "--canvas-rows` (see train/canvases.py)")
    p.add_argument("--out", required=True, help="file to write the rows to")
    p.add_argument("--tasks", default="calc,shop,biggest,tally", help="phrased tasks with a trace")
    p.add_argument("--count", type=int, default=1000, help="training prompts to decode")
    p.add_argument("--per-answer", type=int, default=4, help="canvases kept per answer, at most")
    p.add_argument("--stream-seed", type=int, default=0,
                   help="the training stream's seed (its prompts are never held-out ones) and the rows' draws'")
    p.add_argument("--batch-size", type=int, default=32)
    add_model_args(p)
    add_sampling_args(p)


def task_mix(text: str) -> dict[str, int]:
    """``lookup=3,spell=2,calc=0`` -> {"lookup": 3, "spell": 2, "calc": 0} (argparse type for
    --task-mix; 0 leaves a task out)."""
    mix = {}
    for item in filter(None, text.split(",")):
        name, sep, weight = item.partition("=")
        if not sep or not weight.strip().isdigit():
            raise argparse.ArgumentTypeError(f"expected TASK=N with N >= 0, got {item!r}")
        mix[name.strip()] = int(weight)
    return mix


def train_config(args: argparse.Namespace) -> "TrainConfig":
    """The options given on the command line, by their TrainConfig names; the rest are TrainConfig's
    defaults (the parser sets only what it was given)."""
    from ..train import TrainConfig
    return TrainConfig(**{f.name: getattr(args, f.name) for f in fields(TrainConfig) if hasattr(args, f.name)})


def run_train(args: argparse.Namespace) -> None:
    import torch
    from ..train import Trainer
    from ..train.trainer import Interrupted
    if args.threads:
        torch.set_num_threads(args.threads)
    trainer = Trainer(train_config(args))
    try:
        out = trainer.export_saved() if args.export_only else trainer.train()
    except Interrupted as e:  # the state is saved: one line, no traceback, the shell's exit code
        print(e, file=sys.stderr)
        raise SystemExit(e.exit_code) from None
    print(f"checkpoint written to {out}")


def run_canvas_rows(args: argparse.Namespace) -> None:
    import itertools

    from ..probes.canvas_probe import refuse_untraced
    from ..tasks import resolve_tasks, train_examples
    from ..train.canvases import canvas_rows
    tasks = resolve_tasks(args.tasks)
    refuse_untraced(tasks)  # before the model loads
    if args.count < 1:
        raise UserError(f"--count must be >= 1, got {args.count}")
    check_output_path(args.out)
    given = sampling_params(args)
    set_threads(args.threads)
    examples = list(itertools.islice(train_examples(args.stream_seed, tasks=tasks), args.count))
    rows = canvas_rows(common.load_llm(args), given, examples, args.per_answer, args.stream_seed,
                       batch_size=args.batch_size, use_tqdm=True)
    rows.save(args.out)
    meta = rows.meta
    print(f"model: {args.model}\nmethod: {meta['params']}")
    for task in meta["answers"]:
        print(f"{task:<10} answers {meta['answers'][task]:>5}  lost {meta['lost'][task]:>5}  "
              f"rows {meta['kept'].get(task, 0):>6}")
    print(f"{len(rows.inputs)} rows written to {args.out}")
