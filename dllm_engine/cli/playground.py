"""``dllm playground``: two methods decode one message side by side in the browser (Gradio, the
``ui`` extra; docs/playground.md)."""
from __future__ import annotations

import argparse
import os

from . import common
from .common import add_model_args, set_threads
from ..errors import UserError

UI_MISSING = "dllm playground needs Gradio: pip install 'dllm-engine[ui]'"


def add_playground(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("playground", help="watch two methods decode a message side by side (Gradio)")
    p.add_argument("--methods", nargs=2, default=None, metavar=("A", "B"),
                   help="the two panes' method specs (default: the family's baseline and its "
                        "accelerated composition, e.g. dual-cache and dual-cache+adaptive-length+jump-share; "
                        "DiffusionGemma: diffusion-gemma and diffusion-gemma:steps=HALF)")
    p.add_argument("--host", default="127.0.0.1", help="address to serve on (0.0.0.0: every interface)")
    p.add_argument("--port", type=int, default=7860)
    p.add_argument("--share", choices=("yes", "no"), default="no",
                   help="yes: also a public Gradio share link (needs internet)")
    p.add_argument("--prompts", default=None, metavar="FILE.jsonl",
                   help="the page's example messages from a prompts file (as dllm bench --prompts; default: "
                        "held-out prompts of the task suite)")
    add_model_args(p)


def import_gradio() -> None:
    """Gradio, or a ValueError naming the extra that installs it."""
    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")  # no calls home
    try:
        import gradio  # noqa: F401
    except ImportError:
        raise UserError(UI_MISSING) from None


def run_playground(args: argparse.Namespace) -> None:
    import_gradio()  # before the model loads
    set_threads(args.threads)
    if args.methods:
        from ..engine.canvas_llm import parse_any_spec
        for spec in args.methods:  # a typo fails here, not in the page
            parse_any_spec(spec)
    from ..playground.app import build_app, example_prompts, launch
    examples = example_prompts(args.prompts) if args.prompts else None  # a bad file fails before the model loads
    llm = common.load_llm(args)
    demo = build_app(llm, tuple(args.methods) if args.methods else None, warm_up=True, examples=examples)
    print(f"dllm playground: model {args.model}; Ctrl-C stops it")
    url = launch(demo, args.host, args.port, share=args.share == "yes", block=False)
    print(f"open {url}")
    demo.block_thread()
