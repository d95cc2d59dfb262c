"""``dllm bench serve``: a load generator for a running ``dllm serve``.

At each concurrency level, that many clients send streamed chat completions of held-out task
prompts (or a prompts file's, ``bench.prompts``) back to back until ``num_requests`` have been
sent (with ``turns`` > 1, as chats: each request after a chat's first carries the chat so far,
the server's answers included). Reported per level: throughput (output tokens / s over the
level's wall time), requests / s, latency and time-to-first-chunk percentiles (p50/p95/p99),
failures, accuracy (the task graders, or a prompts file's exact match, over every choice; None
when no choice had an answer to grade), the server's stats (``SequenceStats``: nfe, redundancy,
prompt tokens computed and reused) summed from each response's usage, and the server's peak
memory (its ``/metrics`` sampled through the level)."""
from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from ..errors import UserError
from ..outputs import BenchInterrupted, percent, prepare_out_dir, saved, write_json_atomic
from ..server.metrics import PREFIX
from .report import collect_meta
from .. import datasets
from ..datasets import Prompt


@dataclass
class RequestRecord:
    ok: bool
    latency: float
    first_chunk: float | None = None  # seconds to the first non-empty text chunk
    output_tokens: int = 0
    correct: int = 0  # choices graded right
    choices: int = 1  # choices graded (0: the prompt has no answer to grade)
    usage: dict = field(default_factory=dict)
    error: str = ""
    text: str = ""  # the first choice's answer (a chat's next turn follows it)


@dataclass
class LevelResult:
    concurrency: int
    num_requests: int
    failures: int
    wall_seconds: float
    output_tokens: int
    throughput: float  # output tokens / s
    requests_per_s: float
    latency_p50: float | None
    latency_p95: float | None
    latency_p99: float | None
    first_chunk_p50: float | None
    first_chunk_p95: float | None
    first_chunk_p99: float | None
    accuracy: float | None  # None: no choice had an answer to grade
    nfe: int
    redundancy: float
    errors: list[str] = field(default_factory=list)  # the first few failure messages
    prefill_tokens: int = 0  # prompt tokens the server computed ...
    cached_tokens: int = 0  # ... and those it reused from its prefix store (usage.prompt_tokens_details)
    processed_tokens: float = 0.0  # query tokens of the answers' steps (layer-averaged), beside prefill_tokens
    peak_memory_mb: float | None = None  # the server's, sampled (device peak on CUDA, else resident)


def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated percentile (numpy's default), None when there is nothing to rank."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return round(xs[lo] + (xs[hi] - xs[lo]) * (pos - lo), 6)


def parse_sse(line: str) -> dict | None:
    """One ``data:`` line of the stream -> its JSON, None for [DONE] and non-data lines."""
    if not line.startswith("data:"):
        return None
    data = line[5:].strip()
    return None if data == "[DONE]" else json.loads(data)


def shared_header(words: int, examples: list[Prompt]) -> str:
    """``words`` words of the held-out prompts in turn (the model's own vocabulary): the header
    every request of a shared-prefix load test starts with (a system prompt, few-shot examples)."""
    vocabulary = [w for e in examples for w in e.prompt.split()]
    return " ".join(vocabulary[i % len(vocabulary)] for i in range(words))


async def send(client: httpx.AsyncClient, model: str, messages: list[dict], example: Prompt,
               extra: dict) -> RequestRecord:
    """One streamed chat completion of ``messages``, its choices graded against ``example``;
    never raises (a failure is a record)."""
    body = {"model": model, "messages": messages, "stream": True,
            "stream_options": {"include_usage": True}, **extra}
    start = time.perf_counter()
    text: dict[int, list[str]] = {}
    first, usage = None, {}
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                await r.aread()
                return RequestRecord(False, time.perf_counter() - start, error=f"{r.status_code}: {r.text[:200]}")
            async for line in r.aiter_lines():
                chunk = parse_sse(line)
                if chunk is None:
                    continue
                if "error" in chunk:
                    return RequestRecord(False, time.perf_counter() - start, error=chunk["error"]["message"])
                usage = chunk.get("usage") or usage
                for choice in chunk.get("choices", []):
                    if choice["delta"].get("content"):
                        first = first if first is not None else time.perf_counter() - start
                        text.setdefault(choice["index"], []).append(choice["delta"]["content"])
    except (httpx.HTTPError, json.JSONDecodeError, KeyError) as e:
        return RequestRecord(False, time.perf_counter() - start, error=f"{type(e).__name__}: {e}")
    answers = ["".join(text.get(i, [])) for i in range(extra.get("n", 1))]
    marks = [ok for ok in (example.grades(a)[0] for a in answers) if ok is not None]
    return RequestRecord(True, time.perf_counter() - start, first, usage.get("completion_tokens", 0),
                         sum(marks), len(marks), usage, text=answers[0])


def turn_messages(example: Prompt, header: str = "") -> list[dict]:
    """The messages ``example`` adds to a chat (its ``chat()``: its prompt as a user message, or a
    prompts file's conversation); ``header`` starts the first of them."""
    messages = example.chat()
    if header:
        messages[0] = {**messages[0], "content": f"{header}\n{messages[0]['content']}"}
    return messages


async def run_level(url: str, model: str, examples: list[Prompt], concurrency: int,
                    num_requests: int, extra: dict, timeout: float,
                    lengths: list[int] | None = None, header: str = "", turns: int = 1) -> LevelResult:
    """``concurrency`` clients share ``num_requests`` requests, each sending its next as soon as
    the previous one finished (request i asks for ``lengths[i]`` tokens when given; every
    chat's first message starts with ``header``). ``turns``: the requests form chats of that
    many turns, each turn the chat so far (the server's first answers) and the next question;
    a chat whose turn failed ends there."""
    chats = iter(range(-(-num_requests // turns)))
    records: list[RequestRecord] = []
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)

    async def client_loop(client: httpx.AsyncClient) -> None:
        for chat in chats:
            messages: list[dict] = []
            for i in range(chat * turns, min((chat + 1) * turns, num_requests)):
                example = examples[i % len(examples)]
                fields = extra if lengths is None else {**extra, "max_tokens": lengths[i]}
                messages += turn_messages(example, "" if messages else header)
                record = await send(client, model, messages, example, fields)
                records.append(record)
                if not record.ok:
                    break
                messages.append({"role": "assistant", "content": record.text})

    stop = asyncio.Event()
    async with httpx.AsyncClient(base_url=url, timeout=timeout, limits=limits) as client:
        watch = asyncio.create_task(peak_memory(url, stop))
        start = time.perf_counter()
        try:
            await asyncio.gather(*(client_loop(client) for _ in range(concurrency)))
        finally:
            wall = time.perf_counter() - start
            stop.set()
            peak = await watch
    return summarize(records, concurrency, wall, peak)


MEMORY_SAMPLE_S = 0.2


async def peak_memory(url: str, stop: asyncio.Event) -> float | None:
    """The largest memory reading of the server's ``/metrics`` until ``stop`` (MB): its device
    peak where it reports one (CUDA), else its resident memory, sampled every
    ``MEMORY_SAMPLE_S``; None when it reports neither."""
    peak = None
    async with httpx.AsyncClient(base_url=url, timeout=5.0) as client:
        while True:
            try:
                reading = memory_reading((await client.get("/metrics")).text)
            except httpx.HTTPError:
                reading = None
            if reading is not None:
                peak = max(peak or 0.0, reading)
            if stop.is_set():
                return None if peak is None else round(peak / 2**20, 1)
            try:
                await asyncio.wait_for(stop.wait(), MEMORY_SAMPLE_S)
            except asyncio.TimeoutError:
                pass


# the gauges of ``server.metrics.process_memory`` a level's peak reads, the first found
PEAK_GAUGES = tuple(PREFIX + name for name in ("device_memory_peak_bytes", "resident_memory_bytes"))


def memory_reading(metrics: str) -> float | None:
    """The first of ``PEAK_GAUGES`` in Prometheus text: the device peak (CUDA), else the resident memory."""
    values = {}
    for line in metrics.splitlines():
        name, _, value = line.partition(" ")
        if name in PEAK_GAUGES:
            values[name] = float(value)
    return next((values[name] for name in PEAK_GAUGES if name in values), None)


def summarize(records: list[RequestRecord], concurrency: int, wall: float,
              peak_memory_mb: float | None = None) -> LevelResult:
    ok = [r for r in records if r.ok]
    tokens = sum(r.output_tokens for r in ok)
    latency = [r.latency for r in ok]
    first = [r.first_chunk for r in ok if r.first_chunk is not None]
    decoded = sum(r.usage.get("decoded_tokens", 0) for r in ok)
    processed = sum(r.usage.get("processed_tokens", 0.0) for r in ok)
    graded = sum(r.choices for r in ok)
    return LevelResult(
        concurrency=concurrency, num_requests=len(records), failures=len(records) - len(ok),
        wall_seconds=round(wall, 4), output_tokens=tokens, throughput=round(tokens / wall, 3),
        requests_per_s=round(len(ok) / wall, 3),
        latency_p50=percentile(latency, 50), latency_p95=percentile(latency, 95),
        latency_p99=percentile(latency, 99), first_chunk_p50=percentile(first, 50),
        first_chunk_p95=percentile(first, 95), first_chunk_p99=percentile(first, 99),
        accuracy=round(sum(r.correct for r in ok) / graded, 4) if graded else None,
        nfe=sum(r.usage.get("nfe", 0) for r in ok),
        redundancy=round(processed / decoded, 4) if decoded else 0.0,
        errors=[r.error for r in records if not r.ok][:5],
        prefill_tokens=sum(r.usage.get("prefill_tokens", 0) for r in ok),
        cached_tokens=sum(r.usage.get("prompt_tokens_details", {}).get("cached_tokens", 0) for r in ok),
        processed_tokens=round(processed, 1), peak_memory_mb=peak_memory_mb)


def interleave(examples: list[Prompt]) -> list[Prompt]:
    """Round-robin over tasks, so any number of requests mixes every task (and answer length)."""
    by_task: dict[str, list[Prompt]] = {}
    for e in examples:
        by_task.setdefault(e.task, []).append(e)
    rounds = itertools.zip_longest(*by_task.values())
    return [e for row in rounds for e in row if e is not None]


def parse_length_mix(text: str) -> list[int]:
    """``"64x200,960x10"`` -> 210 max_tokens values, each length's requests spread evenly
    over the run (so the long ones join and leave among the short ones)."""
    slots = []
    for item in filter(None, text.split(",")):
        tokens, _, count = item.partition("x")
        try:
            n, c = int(tokens), int(count)
        except ValueError:
            raise UserError(f"bad length mix item {item!r}; expected TOKENSxCOUNT, e.g. 64x200") from None
        if n < 1 or c < 1:
            raise UserError(f"length mix item {item!r} needs positive tokens and count")
        slots += [((k + 0.5) / c, n) for k in range(c)]
    if not slots:
        raise UserError("the length mix is empty; expected e.g. 64x200,960x10")
    return [n for _, n in sorted(slots)]


def served_model(url: str, timeout: float) -> str:
    try:
        models = httpx.get(url.rstrip("/") + "/v1/models", timeout=timeout).json()["data"]
    except (httpx.HTTPError, ValueError, KeyError) as e:
        raise UserError(f"no dllm server answering at {url} ({type(e).__name__}: {e}); "
                        f"start one with `dllm serve`") from None
    return models[0]["id"]


def run_serve_bench(url: str, concurrency: list[int], num_requests: int, out: str | Path | None,
                    extra: dict | None = None, tasks: list[str] | None = None,
                    timeout: float = 600.0, progress=print,
                    lengths: list[int] | None = None, shared_prefix: int = 0,
                    baseline_url: str | None = None, meta: dict | None = None, turns: int = 1,
                    examples: list[Prompt] | None = None) -> list[LevelResult]:
    """Every concurrency level in turn; writes ``serve_bench.json`` (after every level) and
    ``serve_bench.png`` (at the end, or on Ctrl-C: ``BenchInterrupted``) to ``out`` (when
    given, checked before the run) and returns the per-level results. ``lengths`` (``parse_length_mix``)
    gives each request its own max_tokens and sets the number of requests; ``shared_prefix``: every
    request starts with the same header of that many words (``shared_header``); ``turns``: the
    requests form chats of that many turns (``run_level``). ``baseline_url``:
    a second server (the same model, another setting) that runs each level just before ``url``,
    so both share the machine's state; its levels go to the JSON's ``baseline``. ``meta``: the
    run's provenance (``report.collect_meta``; default: this command line), written beside the
    JSON with ``table.md`` for ``dllm report``. ``examples``: the prompts to send (a prompts
    file's, ``bench.prompts.load_prompts``) in place of the held-out split of ``tasks``."""
    if not concurrency or min(concurrency) < 1:
        raise UserError(f"concurrency levels must be >= 1, got {concurrency}")
    num_requests = len(lengths) if lengths else num_requests
    if num_requests < 1:
        raise UserError(f"num_requests must be >= 1, got {num_requests}")
    if turns < 1:
        raise UserError(f"a chat has at least one turn, got {turns}")
    folder = None
    if out is not None:  # a bad --out fails now, not after the whole load test
        folder = prepare_out_dir(out)
    model = served_model(url, timeout)
    if baseline_url is not None and served_model(baseline_url, timeout) != model:
        raise UserError(f"{baseline_url} serves {served_model(baseline_url, timeout)!r}, {url} {model!r}: "
                        f"a baseline serves the same model")
    examples = interleave(examples if examples is not None else datasets.load(tasks))
    if not examples:
        raise UserError("no prompts to send")
    header = shared_header(shared_prefix, examples) if shared_prefix else ""
    results: list[LevelResult] = []
    baseline: list[LevelResult] = []
    meta = meta or collect_meta()
    try:
        for level in concurrency:
            args = (examples, level, num_requests, extra or {}, timeout, lengths, header, turns)
            if baseline_url is not None:
                baseline.append(asyncio.run(run_level(baseline_url, model, *args)))
                progress(format_row(baseline[-1]) + "  (baseline)")
            results.append(asyncio.run(run_level(url, model, *args)))
            if folder is not None:  # after every level, all at once: Ctrl-C keeps the levels done
                report = {"url": url, "model": model, "options": extra or {}, "shared_prefix": shared_prefix,
                          "turns": turns,
                          "levels": [dataclasses.asdict(r) for r in results]}
                if baseline_url is not None:
                    report["baseline"] = {"url": baseline_url, "levels": [dataclasses.asdict(r) for r in baseline]}
                write_json_atomic(folder / "serve_bench.json", report)
                write_json_atomic(folder / "meta.json", meta)
                (folder / "table.md").write_text(serve_table(report) + "\n", encoding="utf-8")
            progress(format_row(results[-1]))
    except KeyboardInterrupt:
        if folder is None:
            raise BenchInterrupted(f"{len(results)} of {len(concurrency)} levels done (no --out)") from None
        if results:
            plot(results, folder / "serve_bench.png", model)
        raise BenchInterrupted(saved(len(results), "level", folder / "serve_bench.json")) from None
    if folder is not None:
        plot(results, folder / "serve_bench.png", model)
    return results


HEADER = (f"{'conc':>5} {'reqs':>5} {'fail':>5} {'tok/s':>8} {'req/s':>7} {'p50 s':>7} {'p95 s':>7} "
          f"{'p99 s':>7} {'ttfc50':>7} {'ttfc95':>7} {'acc':>6} {'redund':>7} {'prefill':>8} {'cached':>8} "
          f"{'peak MB':>8}")


def serve_table(report: dict) -> str:
    """The markdown table of a ``serve_bench.json``: a row per level (and per server, with a
    baseline: its row first, then the server's with its speed-up and prefill ratio over it)."""
    base = {r["concurrency"]: r for r in report.get("baseline", {}).get("levels", [])}
    lines = ["| server | concurrency | requests | failures | throughput (tok/s) | speed-up | time to first chunk p50 (s) "
             "| latency p50 (s) | prompt tokens computed | reused | prefix hit rate | computed, baseline over this "
             "| prompts' share of the query tokens | accuracy | peak memory (MB) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]

    def row(r: dict, name: str, ref: dict | None) -> str:
        speedup = f"{r['throughput'] / ref['throughput']:.2f}×" if ref and ref["throughput"] else "–"
        fewer = (f"{ref.get('prefill_tokens', 0) / r['prefill_tokens']:.1f}×"
                 if ref and r.get("prefill_tokens") else "–")
        ttfc, latency = r["first_chunk_p50"], r["latency_p50"]
        query = r.get("prefill_tokens", 0) + r.get("processed_tokens", 0)
        share = f"{r.get('prefill_tokens', 0) / query:.1%}" if query else "–"
        memory = "–" if r.get("peak_memory_mb") is None else f"{r['peak_memory_mb']:,.0f}"
        prompts = r.get("prefill_tokens", 0) + r.get("cached_tokens", 0)
        hits = f"{r.get('cached_tokens', 0) / prompts:.1%}" if prompts else "–"
        return (f"| {name} | {r['concurrency']} | {r['num_requests']} | {r['failures']} | {r['throughput']:.1f} | "
                f"{speedup} | {'–' if ttfc is None else f'{ttfc:.3f}'} | {'–' if latency is None else f'{latency:.3f}'} | "
                f"{r.get('prefill_tokens', 0)} | {r.get('cached_tokens', 0)} | {hits} | {fewer} | {share} | {percent(r['accuracy'])} | "
                f"{memory} |")
    for r in report["levels"]:
        ref = base.get(r["concurrency"])
        if ref is not None:
            lines.append(row(ref, f"baseline `{report['baseline']['url']}`", None))
        lines.append(row(r, f"`{report['url']}`", ref))
    return "\n".join(lines)


def format_row(r: LevelResult) -> str:
    def s(x: float | None) -> str:
        return f"{x:>7.3f}" if x is not None else f"{'-':>7}"
    return (f"{r.concurrency:>5} {r.num_requests:>5} {r.failures:>5} {r.throughput:>8.1f} "
            f"{r.requests_per_s:>7.2f} {s(r.latency_p50)} {s(r.latency_p95)} {s(r.latency_p99)} "
            f"{s(r.first_chunk_p50)} {s(r.first_chunk_p95)} {percent(r.accuracy):>6} {r.redundancy:>7.2f} "
            f"{r.prefill_tokens:>8} {r.cached_tokens:>8} "
            f"{'-' if r.peak_memory_mb is None else f'{r.peak_memory_mb:.0f}':>8}")


def plot(results: list[LevelResult], path: Path, title: str) -> None:
    import matplotlib.pyplot as plt
    fig = figure(results, title)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def figure(results: list[LevelResult], title: str):
    """Throughput and latency percentiles against concurrency, side by side, both from 0."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    conc = [r.concurrency for r in results]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    left.plot(conc, [r.throughput for r in results], marker="o")
    left.set_ylabel("throughput (output tokens / s)")
    for name, style in (("latency_p50", "-o"), ("latency_p95", "--o"), ("latency_p99", ":o"),
                        ("first_chunk_p50", "-s")):
        ys = [getattr(r, name) for r in results]
        if any(y is not None for y in ys):
            right.plot(conc, [float("nan") if y is None else y for y in ys], style, label=name)
    right.set_ylabel("seconds")
    right.legend(fontsize=8)
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent clients")
        ax.grid(True, alpha=0.3)
        ax.set_ylim(bottom=0)  # a zoomed axis makes small differences look large
    fig.suptitle(f"dllm serve: {title}")
    fig.tight_layout()
    return fig
