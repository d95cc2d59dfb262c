"""``dllm download``: fetch a Hugging Face id's engine files into the cache, print the folder."""
from __future__ import annotations

import argparse


def add_download(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("download", help="fetch a Hugging Face model id's files the engine reads into "
                       "the cache and print the folder (last line of stdout)")
    p.add_argument("model", help="Hugging Face id, org/name")
    p.add_argument("--revision", default=None, help="branch, tag or commit hash (default: main)")
    p.add_argument("--cache-dir", default=None,
                   help="cache folder (default: huggingface_hub's: HF_HUB_CACHE, else HF_HOME/hub)")


def run_download(args: argparse.Namespace) -> None:
    from ..hub import download_model
    print(download_model(args.model, args.revision, args.cache_dir))  # progress bars go to stderr
