"""The ``dllm`` command: generate, eval, bench, train, serve."""
from __future__ import annotations

import argparse
import sys


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
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")


def run_train(args: argparse.Namespace) -> None:
    import torch
    from .train import TrainConfig, Trainer
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = TrainConfig(family=args.family, out=args.out, work=args.work, steps=args.steps,
                      batch_size=args.batch_size, lr=args.lr, seed=args.seed,
                      num_kv_heads=args.num_kv_heads, block_size=args.block_size)
    print(f"checkpoint written to {Trainer(cfg).train()}")


COMMANDS = {"train": (add_train, run_train)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dllm", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for add, _ in COMMANDS.values():
        add(sub)
    args = parser.parse_args(argv)
    try:
        COMMANDS[args.command][1](args)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
