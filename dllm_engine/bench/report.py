"""Benchmark pages generated from what ``dllm bench`` measured, never typed by hand.

``dllm bench`` writes, beside ``results.json`` and ``throughput.png``, a ``meta.json`` (commit,
date, machine, command) and ``table.md`` (the markdown table). ``dllm report OUT --page PAGE
--section NAME`` puts that table, its provenance line and its plot into a benchmark page between
``<!-- bench:NAME -->`` and ``<!-- /bench:NAME -->``: a re-run replaces the section, so a page
holds the current tables only.

Beside each measured speed-up the table gives the run's exact work counts against the baseline
(the first spec at the same batch size): ``forwards`` (baseline nfe / nfe) and ``query tokens``
(baseline query tokens / query tokens, the prompts' first pass included). They are
deterministic, so they do not drift with the machine; a speed-up lies between the two where a
step's time is mostly per forward or mostly per token.
"""
from __future__ import annotations

import datetime as dt
import json
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import torch

from ..errors import UserError
from ..outputs import percent, write_json_atomic

PACKAGE_ROOT = Path(__file__).resolve().parents[2]


def git_commit(root: Path = PACKAGE_ROOT) -> str | None:
    """The checkout's commit (``abc1234``, ``abc1234-dirty`` with uncommitted changes to tracked
    files), or None outside a git checkout (an installed wheel)."""
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return head + ("-dirty" if dirty else "")


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``; ``platform.processor()`` elsewhere)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine(device: torch.device | str = "cpu", threads: int | None = None) -> str:
    """One line naming what ran the benchmark."""
    device = torch.device(device)
    if device.type == "cuda":
        where = torch.cuda.get_device_name(device)
    else:
        where = f"{cpu_name()}, {threads or torch.get_num_threads()} thread(s) of {os.cpu_count()} cores"
    return f"{where}; torch {torch.__version__}, Python {platform.python_version()}"


def collect_meta(argv: list[str] | None = None, device: torch.device | str = "cpu",
                 threads: int | None = None) -> dict:
    """Provenance of a run: commit, UTC date, machine and the command as typed."""
    argv = sys.argv if argv is None else argv
    command = shlex.join(["dllm", *argv[1:]] if argv and Path(argv[0]).name in ("dllm", "__main__.py")
                         else argv)
    return {"commit": git_commit(), "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "machine": machine(device, threads), "command": command}


def query_tokens(row: dict) -> float:
    """Tokens put through the layers: the steps' (layer-averaged) plus the prompts' first pass."""
    return row["processed_tokens"] + row["prefill_tokens"]


VARIANT = re.compile(r"^(?P<spec>.*) \[(?P<variant>[^\]]+)\]$")  # "SPEC [compiled]"


def table(rows: list[dict]) -> str:
    """The markdown table of ``results.json``'s rows: each row's speed-up (fastest passes) over
    its reference — the first spec at the same batch size, or for a variant's row
    (``SPEC [compiled]``) the same spec as loaded — with, over several rounds, the range of the
    rounds' speed-ups, and the exact work ratios against the same reference."""
    base: dict[int, dict] = {}  # the first spec's row at each batch size (the first, if given twice)
    for r in rows:
        if r["method"] == rows[0]["method"]:
            base.setdefault(r["batch_size"], r)
    loaded: dict[tuple[str, int], dict] = {}  # a spec's as-loaded row, before its variants'
    repeated = any(len(r.get("runs_seconds", [])) > 1 for r in rows)
    # a run whose variants change the tokens (quantized, compiled) or the weights' size: their columns
    agreed = any(r.get("agreement") is not None for r in rows)
    weights = len({r.get("weight_mb") for r in rows}) > 1
    lines = ["| method | batch | accuracy | throughput (tok/s) | speed-up |" + (" rounds |" if repeated else "")
             + " forwards | query tokens | nfe | tokens/step | answer tokens / forward | redundancy"
               " | stop share | prefill tokens | peak MB |" + (" weights MB |" if weights else "")
             + (" token agreement |" if agreed else ""),
             "|---|---|---|---|---|" + ("---|" if repeated else "") + "---|---|---|---|---|---|---|---|---|"
             + ("---|" if weights else "") + ("---|" if agreed else "")]
    for r in rows:
        ref = base.get(r["batch_size"])
        variant = VARIANT.match(r["method"])
        if variant is None:
            loaded[r["method"], r["batch_size"]] = r
        else:
            ref = loaded.get((variant["spec"], r["batch_size"]), ref)
        speedup = r["throughput"] / ref["throughput"] if ref and ref["throughput"] else float("nan")
        spread = f" {round_range(r, ref)} |" if repeated else ""
        lines.append(
            f"| `{r['method']}` | {r['batch_size']} | {percent(r['accuracy'])} | {r['throughput']:.1f} | "
            f"{speedup:.2f}× |{spread} {ratio(ref, r, 'nfe')} | {ratio(ref, r, query_tokens)} | {r['nfe']} | "
            f"{r['decoded_tokens'] / max(1, r['nfe']):.2f} | {r['output_tokens'] / max(1, r['nfe']):.2f} | "
            f"{r['redundancy']:.2f} | {stop_share(r):.1%} | {r['prefill_tokens']} | {r['peak_memory_mb']:.0f} |"
            + (f" {r.get('weight_mb', 0):.2f} |" if weights else "")
            + (f" {agreement(r)} |" if agreed else ""))
    return "\n".join(lines)


def ratio(ref: dict | None, row: dict, key) -> str:
    """``ref``'s count over ``row``'s (``key``: a field name or a function of a row)."""
    get = key if callable(key) else (lambda r: r[key])
    if ref is None or not get(row):
        return "–"
    return f"{get(ref) / get(row):.2f}×"


def agreement(row: dict) -> str:
    """A variant row's share of its as-loaded row's output tokens; – for an as-loaded row."""
    share = row.get("agreement")
    return "–" if share is None else f"{share:.1%}"


def stop_share(row: dict) -> float:
    decoded = row["decoded_tokens"]
    return (decoded - row["output_tokens"]) / decoded if decoded else 0.0


def round_range(row: dict, ref: dict | None) -> str:
    """``low–high×``: each round's speed-up over the same round of ``ref``."""
    mine, theirs = row.get("runs_seconds", []), (ref or {}).get("runs_seconds", [])
    if not ref or len(mine) != len(theirs) or not all(mine):
        return "–"
    ratios = [(row["output_tokens"] / t) / (ref["output_tokens"] / u) for t, u in zip(mine, theirs)]
    return f"{min(ratios):.2f}–{max(ratios):.2f}×"


def write_table(out_dir: str | Path, rows: list[dict], meta: dict) -> Path:
    """``meta.json`` and ``table.md`` of a run in ``out_dir``."""
    out = Path(out_dir)
    write_json_atomic(out / "meta.json", meta)
    path = out / "table.md"
    path.write_text(table(rows) + "\n", encoding="utf-8")
    return path


def load_run(out_dir: str | Path) -> tuple[list[dict] | dict, dict]:
    """(rows, meta) of a finished ``dllm bench`` folder, or (its report, meta) of a ``dllm bench
    serve`` one; a clear error when it is neither."""
    out = Path(out_dir)
    if (out / "serve_bench.json").is_file():
        try:
            return (json.loads((out / "serve_bench.json").read_text(encoding="utf-8")),
                    json.loads((out / "meta.json").read_text(encoding="utf-8")))
        except FileNotFoundError:
            raise UserError(f"{out}: a dllm bench serve folder without meta.json (written from this "
                            f"version on: run it again)") from None
        except json.JSONDecodeError as e:
            raise UserError(f"{out}: unreadable results ({e})") from None
    try:
        rows = json.loads((out / "results.json").read_text(encoding="utf-8"))
        meta = json.loads((out / "meta.json").read_text(encoding="utf-8"))
    except FileNotFoundError as e:
        raise UserError(f"{out} is not a dllm bench output folder: {Path(e.filename).name} is missing") from None
    except json.JSONDecodeError as e:
        raise UserError(f"{out}: unreadable results ({e})") from None
    if not isinstance(rows, list) or not rows:
        raise UserError(f"{out}/results.json holds no rows")
    return rows, meta


def render(rows: list[dict] | dict) -> str:
    """The table of a run: ``dllm bench``'s rows, or a ``dllm bench serve`` report."""
    if isinstance(rows, dict):
        from .serve import serve_table
        return serve_table(rows)
    return table(rows)


def section(name: str, rows: list[dict] | dict, meta: dict, image: str | None) -> str:
    """A page section: the provenance line, the table and the plot."""
    commit = meta.get("commit") or "an installed package"
    kind = "`dllm bench serve`" if isinstance(rows, dict) else "`dllm bench`"
    lines = [f"<!-- bench:{name} -->",
             f"*Generated by `dllm report` from a {kind} run on commit `{commit}`, {meta['date']}, "
             f"{meta['machine']}:* `{meta['command']}`", "", render(rows)]
    if image:
        lines += ["", f"![{name}]({image})"]
    return "\n".join([*lines, f"<!-- /bench:{name} -->"])


SECTION_NAME = re.compile(r"^[a-z0-9][a-z0-9-]*$")


def update_page(page: str | Path, name: str, out_dir: str | Path, image_dir: str | Path | None = None) -> Path:
    """Write the run in ``out_dir`` into ``page`` as section ``name`` (replacing the section if
    the page has it, appending it otherwise); its plot is copied to ``image_dir/NAME.png``
    (default: ``img/`` beside the page) and linked relative to the page."""
    if not SECTION_NAME.match(name):
        raise UserError(f"section name {name!r}: use lower-case letters, digits and '-'")
    rows, meta = load_run(out_dir)
    page = Path(page)
    image = None
    plot = Path(out_dir) / ("serve_bench.png" if isinstance(rows, dict) else "throughput.png")
    if plot.is_file():
        target = Path(image_dir) if image_dir is not None else page.parent / "img"
        target.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(plot, target / f"{name}.png")
        image = Path(os.path.relpath(target / f"{name}.png", page.parent)).as_posix()
    text = page.read_text(encoding="utf-8") if page.exists() else f"# {page.stem}\n"
    new = section(name, rows, meta, image)
    pattern = re.compile(rf"<!-- bench:{re.escape(name)} -->.*?<!-- /bench:{re.escape(name)} -->", re.S)
    text = pattern.sub(lambda _: new, text, count=1) if pattern.search(text) else text.rstrip("\n") + "\n\n" + new + "\n"
    page.parent.mkdir(parents=True, exist_ok=True)
    page.write_text(text, encoding="utf-8")
    return page
