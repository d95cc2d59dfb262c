"""``dllm bench-serve`` (also ``dllm bench serve``): load-test a running ``dllm serve``."""
from __future__ import annotations

import argparse

from ..errors import UserError
from .common import add_prompt_source, load_examples, prepare_out, split_ints


def add_bench_serve(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench-serve", help="load-test a running `dllm serve` (also: dllm bench serve)")
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--baseline-url", default=None,
                   help="a second server of the same model (e.g. started with --no-prefix-cache): each level "
                        "runs on it just before --url, and the table gives the speed-up over it")
    p.add_argument("--concurrency", type=split_ints, default=[1, 8, 32, 64])
    p.add_argument("--num-requests", type=int, default=64, help="requests per concurrency level")
    add_prompt_source(p, "all", "'all', a family ('copy', 'worked', 'phrased') or task names")
    p.add_argument("--limit", type=int, default=None,
                   help="prompts per task, or the first N of --prompts (default: every prompt; the requests "
                        "cycle through them)")
    p.add_argument("--max-tokens", type=int, default=None)
    p.add_argument("--length-mix", default=None,
                   help="per-request max_tokens, e.g. 64x200,960x10 (sets the number of requests; "
                        "each length spread evenly over the run)")
    p.add_argument("--method", default=None)
    p.add_argument("--threshold", type=float, default=None)
    p.add_argument("--block-length", type=int, default=None)
    p.add_argument("--options", default=None, help='other request fields as JSON, e.g. \'{"focus_alpha": 2}\'')
    p.add_argument("--shared-prefix", type=int, default=0, metavar="WORDS",
                   help="every request's message starts with the same header of WORDS words (a system "
                        "prompt, few-shot examples): what a server's prefix store reuses")
    p.add_argument("--turns", type=int, default=1, metavar="N",
                   help="send the requests as chats of N turns: each turn carries the chat so far, the "
                        "server's answers included, and the next question (default 1)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--out", default=None, help="folder for serve_bench.json and serve_bench.png")


def run_bench_serve(args: argparse.Namespace) -> None:
    import json
    from ..bench.serve import HEADER, parse_length_mix, run_serve_bench
    extra = {k: v for k, v in (("max_tokens", args.max_tokens), ("method", args.method),
                               ("threshold", args.threshold), ("block_length", args.block_length))
             if v is not None}
    if args.options:
        try:
            extra.update(json.loads(args.options))
        except (json.JSONDecodeError, TypeError, ValueError) as e:
            raise UserError(f"--options must be a JSON object: {e}") from None
    lengths = parse_length_mix(args.length_mix) if args.length_mix else None
    prepare_out(args.out, "serve_bench.json")
    examples = load_examples(args, args.limit)  # a typo or a bad file fails before the server is asked
    print(f"server: {args.url}  requests per level: {len(lengths) if lengths else args.num_requests}  "
          f"options: {extra}" + (f"  length mix: {args.length_mix}" if lengths else "")
          + (f"  chats of {args.turns} turns" if args.turns > 1 else "")
          + (f"  prompts file: {args.prompts} ({len(examples)} prompts)" if args.prompts else ""))
    print(HEADER)
    if args.shared_prefix < 0:
        raise UserError(f"--shared-prefix must be >= 0 words, got {args.shared_prefix}")
    run_serve_bench(args.url, args.concurrency, args.num_requests, args.out, extra, args.tasks, args.timeout,
                    lengths=lengths, shared_prefix=args.shared_prefix, baseline_url=args.baseline_url,
                    turns=args.turns, examples=examples)
    if args.out:
        print(f"\nwrote {args.out}/serve_bench.json and {args.out}/serve_bench.png")
