"""``dllm report``: a ``dllm bench`` run's table, or that table written into a benchmark page."""
from __future__ import annotations

import argparse

from ..errors import UserError


def add_report(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("report", help="print a dllm bench run's markdown table, or write it (with its "
                       "commit, date, machine, command and plot) into a benchmark page")
    p.add_argument("run", help="a dllm bench output folder (results.json, meta.json)")
    p.add_argument("--page", default=None, help="markdown page to write the section into (e.g. docs/benchmarks/phrased.md)")
    p.add_argument("--section", default=None,
                   help="the section's name in the page (lower-case letters, digits, '-'); a re-run replaces it")
    p.add_argument("--image-dir", default=None,
                   help="folder for the section's plot (default: img/ beside the page)")


def run_report(args: argparse.Namespace) -> None:
    from ..bench.report import load_run, render, update_page
    if (args.page is None) != (args.section is None):
        raise UserError("--page and --section go together")
    if args.page is None:
        rows, meta = load_run(args.run)
        print(f"commit {meta.get('commit')}, {meta['date']}, {meta['machine']}\n{meta['command']}\n")
        print(render(rows))
        return
    print(update_page(args.page, args.section, args.run, args.image_dir))
