"""Offline benchmark: accuracy, throughput, redundancy and memory of each method spec.

A spec is ``method[:field=value,...]`` setting SamplingParams fields (``parse_spec``), e.g.
``dual-cache:threshold=0.9`` or ``dual-cache+early-skip:keep_fractions=1/0.5/0.25``
(list values are separated by ``/``). Specs run interleaved per batch size on the same prompts,
so drift of a shared machine hits every method alike; with ``repeats`` every spec's timed pass
runs that many rounds (round-robin over the specs) and keeps its fastest, and the table gives the
range of the speed-ups the rounds measured one by one."""
from __future__ import annotations

import dataclasses
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import UserError
from ..engine.host_memory import resident_bytes
from ..engine.llm import LLM
from ..engine.sequence import stop_share
from ..eval import evaluate
from ..eval.evaluate import rounded
from ..models.compiled import compile_model, uncompile_model
from ..models.quantize import QUANTIZATIONS, check_quantization, quantize_reversibly, weight_bytes
from ..models.loader import read_config, read_generation_config
from ..outputs import BenchInterrupted, percent, prepare_out_dir, saved, write_json_atomic
from ..resolve import resolve_params, trained_block_size
from ..sampling_params import SamplingParams
from ..spec import parse_spec
from ..datasets import Prompt
from .report import collect_meta, table as report_table, write_table

class PeakMemory:
    """Peak resident memory (CPU, sampled from /proc) or peak allocated device memory (CUDA)."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.peak, self.running = device, 0, False

    def sample(self) -> None:
        while self.running:
            self.peak = max(self.peak, resident_bytes() or 0)
            time.sleep(0.005)

    def __enter__(self) -> "PeakMemory":
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        elif resident_bytes() is not None:
            self.running = True
            self.thread = threading.Thread(target=self.sample, daemon=True)
            self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            self.peak = torch.cuda.max_memory_allocated(self.device)
        elif self.running:
            self.running = False
            self.thread.join()

    @property
    def mb(self) -> float:
        return round(self.peak / 2**20, 1)


@dataclass
class BenchRecord:
    method: str
    batch_size: int
    num_prompts: int
    accuracy: float | None  # None: the prompts had no answers to grade (a prompts file without them)
    throughput: float
    seconds: float
    nfe: int
    decoded_tokens: int
    output_tokens: int
    processed_tokens: float
    redundancy: float
    prefill_tokens: int
    peak_memory_mb: float
    tasks: list[str]  # the workload: task names of the prompts, in order
    # tensor parallel: each rank's peak resident memory (VmHWM) during the run, rank 0 first
    peak_memory_mb_per_rank: list[float] | None = None
    # every timed pass's seconds, round by round (``repeats``); ``seconds`` is the fastest pass's
    runs_seconds: list[float] = dataclasses.field(default_factory=list)
    edits: int = 0  # committed tokens rewritten (joint-threshold), beside decoded_tokens
    weight_mb: float = 0.0  # the model's weights as stored (quantized ones at their own size); rank 0's under TP
    # a variant's row: the share of the as-loaded row's output tokens it reproduces, position by
    # position (``agreement``); None for a row measured as loaded
    agreement: float | None = None
    # every prompt's output token ids, in order (kept in memory for ``agreement``; not written)
    outputs: list[list[int]] = dataclasses.field(default_factory=list, repr=False)

    def as_row(self) -> dict:
        """The record as results.json stores it (without the outputs)."""
        row = dataclasses.asdict(self)
        del row["outputs"]
        return row

    def add_run(self, other: "BenchRecord") -> None:
        """Fold a later round's pass of the same spec in: its time joins ``runs_seconds``,
        ``seconds`` and ``throughput`` become the fastest pass's (its own throughput, measured
        on its unrounded time and its own output tokens); the counts stay the first pass's
        (the same prompts and seeds decode the same tokens)."""
        self.runs_seconds.append(other.seconds)
        if (other.throughput, -other.seconds) > (self.throughput, -self.seconds):
            self.seconds, self.throughput = other.seconds, other.throughput
        self.peak_memory_mb = max(self.peak_memory_mb, other.peak_memory_mb)
        if self.peak_memory_mb_per_rank and other.peak_memory_mb_per_rank:  # each rank's peak over the passes
            self.peak_memory_mb_per_rank = [max(a, b) for a, b in zip(self.peak_memory_mb_per_rank,
                                                                     other.peak_memory_mb_per_rank)]

    @property
    def stop_share(self) -> float:
        return stop_share(self.output_tokens, self.decoded_tokens)


def bench_one(llm: LLM, spec: str, params: SamplingParams, examples: list[Prompt],
              batch_size: int, warm_all: bool = False, use_tqdm: bool = False, place: str = "") -> BenchRecord:
    """``warm_all``: the warm-up is the whole run, not one prompt (a compiled step compiles
    each shape it meets on first use: the timed run then measures the steady state).
    ``use_tqdm``: a progress bar of the timed pass's prompts (stderr), named by spec and batch
    size after ``place`` (the pass's place in the run, e.g. "[3/12]")."""
    warm = (examples, batch_size) if warm_all else (examples[:1], 1)
    evaluate(llm, params, examples=warm[0], batch_size=warm[1], use_tqdm=False)  # warm-up
    llm.clear_prefix_store()  # every row starts cold: no spec reuses another's blocks
    if llm.parallel is not None:
        llm.parallel.reset_peak()
    with PeakMemory(llm.device) as mem:
        report = evaluate(llm, params, examples=examples, batch_size=batch_size, use_tqdm=use_tqdm,
                          desc=f"{place} {spec} batch {batch_size}".lstrip())
    per_rank = None
    if llm.parallel is not None and llm.device.type == "cpu":
        per_rank = [r["peak_rss_mb"] for r in llm.parallel.report()]
    s = report.stats
    return BenchRecord(method=spec, batch_size=batch_size, num_prompts=len(examples),
                       accuracy=rounded(report.accuracy), throughput=round(report.throughput, 2),
                       seconds=round(s.seconds, 3), nfe=s.nfe, decoded_tokens=s.decoded_tokens,
                       output_tokens=s.output_tokens, processed_tokens=round(s.processed_tokens, 1),
                       redundancy=round(s.redundancy, 3), prefill_tokens=s.prefill_tokens,
                       peak_memory_mb=mem.mb, tasks=list(dict.fromkeys(e.task for e in examples)),
                       peak_memory_mb_per_rank=per_rank, runs_seconds=[round(s.seconds, 3)], edits=s.edits,
                       weight_mb=round(weight_bytes(llm.model) / 2**20, 2), outputs=report.outputs)


def agreement(outputs: list[list[int]], reference: list[list[int]]) -> float:
    """The share of token positions where ``outputs`` equal ``reference``, prompt by prompt,
    over the longer of the two answers (a shorter or longer answer disagrees on the rest)."""
    same = sum(sum(a == b for a, b in zip(x, y)) for x, y in zip(outputs, reference))
    total = sum(max(len(x), len(y)) for x, y in zip(outputs, reference))
    return round(same / total, 4) if total else 1.0


def compiled(llm: LLM):
    compile_model(llm.model)
    return lambda: uncompile_model(llm.model)


def step_shapes(fixed: bool, compiled: bool = False):
    def apply(llm: LLM):
        llm.engine.runner.set_step_shapes(fixed, compiled)
        return lambda: llm.engine.runner.set_step_shapes(False)
    return apply


def per_sequence_step(llm: LLM):
    llm.engine.batch_step = False
    return lambda: setattr(llm.engine, "batch_step", True)


def quantized(method: str):
    def apply(llm: LLM):
        if llm.parallel is not None:
            raise UserError("a quantization variant needs one process: load the model with --quantization "
                            "under tensor parallelism instead")
        check_quantization(method, llm.device, next(llm.model.parameters()).dtype)
        return quantize_reversibly(llm.model, method)
    return apply


# an engine variant a spec also runs under (``SPEC [name]``, its speed-up over ``SPEC``):
# name -> (apply, warm_all); apply(llm) changes the LLM and returns the function that undoes
# it; warm_all: see bench_one
VARIANTS = {
    "compiled": (compiled, False),
    "fixed shapes": (step_shapes(True), False),
    "compiled step": (step_shapes(True, True), True),
    "per-sequence step": (per_sequence_step, False),
    **{method: (quantized(method), False) for method in QUANTIZATIONS},
}


def run_bench(llm: LLM, specs: list[str], batch_sizes: list[int], examples: list[Prompt],
              out_dir: str | Path, defaults: dict | None = None, progress=print,
              compare_compiled: bool = False, variants: list[str] | None = None,
              repeats: int = 1, meta: dict | None = None, use_tqdm: bool = False) -> list[BenchRecord]:
    """Run every spec at every batch size (interleaved); results.json is rewritten after every
    row, throughput.png at the end. Ctrl-C raises ``BenchInterrupted`` and a spec failing
    mid-run a ValueError naming it, both after plotting the rows so far.
    ``variants`` (names of ``VARIANTS``; ``compare_compiled`` adds "compiled"): each spec runs
    as loaded, then under each variant (a record named ``SPEC [variant]``), so they share the
    machine's state. ``repeats``: each batch size runs that many rounds of every spec (and
    variant) in turn; a row keeps its fastest pass and is written when its last round ends.
    ``meta``: the run's provenance for meta.json (``report.collect_meta``; default: this
    process's command line); table.md is rewritten with results.json. ``use_tqdm``: a progress
    bar per spec and batch size (stderr), cleared when its row prints, named by its pass's
    place among all the run's passes ("[3/12]")."""
    if not specs:
        raise UserError("give at least one method spec")
    if any(b < 1 for b in batch_sizes) or not batch_sizes:
        raise UserError(f"batch sizes must be >= 1, got {batch_sizes}")
    if repeats < 1:
        raise UserError(f"repeats must be >= 1, got {repeats}")
    variants = (["compiled"] if compare_compiled else []) + list(variants or [])
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise UserError(f"unknown bench variant {unknown[0]!r}; choose from {', '.join(VARIANTS)}")
    out = prepare_out_dir(out_dir)
    params = resolve_specs(specs, llm.resolve, defaults, llm.parse_spec)  # validate all first
    meta = meta or collect_meta(device=llm.device)
    check_prompts(llm, params, examples)
    results, records, running = out / "results.json", [], ""
    passes, done = len(batch_sizes) * repeats * len(specs) * (1 + len(variants)), 0
    try:
        for bs in batch_sizes:
            # this batch size's rows, measured so far, by (position of the spec, variant): a
            # spec given twice is two rows, as in one round
            rows: dict[tuple[int, str | None], BenchRecord] = {}
            for round_ in range(1, repeats + 1):
                for i, spec in enumerate(specs):
                    for name in [None, *variants]:
                        label = spec if name is None else f"{spec} [{name}]"
                        running = f"spec {label!r} at batch size {bs}" + (
                            f", round {round_} of {repeats}" if repeats > 1 else "")
                        done += 1
                        record = bench_variant(llm, spec, name, params[spec], examples, bs, use_tqdm,
                                               f"[{done}/{passes}]")
                        if name is not None:
                            record.agreement = agreement(record.outputs, rows[i, None].outputs)
                        if (i, name) in rows:
                            rows[i, name].add_run(record)
                        else:
                            rows[i, name] = record
                        if round_ == repeats:
                            save(records, rows[i, name], results, progress, meta)
    except (KeyboardInterrupt, UserError) as e:  # keep what was measured: the plot of the rows so far
        if records:
            plot(records, out / "throughput.png")
        if isinstance(e, KeyboardInterrupt):
            raise BenchInterrupted(saved(len(records), "row", results)) from None
        raise UserError(f"{running}: {e} ({saved(len(records), 'row', results)})") from None
    plot(records, out / "throughput.png")
    return records


def bench_variant(llm: LLM, spec: str, name: str | None, params: SamplingParams,
                  examples: list[Prompt], batch_size: int, use_tqdm: bool = False, place: str = "") -> BenchRecord:
    """One timed pass of ``spec`` as loaded (``name`` None) or under the variant ``name``."""
    if name is None:
        return bench_one(llm, spec, params, examples, batch_size, use_tqdm=use_tqdm, place=place)
    apply, warm_all = VARIANTS[name]
    undo = apply(llm)
    try:
        return bench_one(llm, f"{spec} [{name}]", params, examples, batch_size, warm_all, use_tqdm, place)
    finally:
        undo()


def save(records: list[BenchRecord], record: BenchRecord, path: Path, progress, meta: dict) -> None:
    """Add one measured row and rewrite results.json with every row so far (atomically: Ctrl-C
    or a failing spec later in the run keeps it), and meta.json / table.md beside it."""
    records.append(record)
    rows = [r.as_row() for r in records]
    write_json_atomic(path, rows)
    write_table(path.parent, rows, meta)
    progress(format_row(record))


def check_prompts(llm: LLM, params: dict[str, SamplingParams], examples: list[Prompt]) -> list[list[int]]:
    """Each spec against the longest prompt as ``evaluate`` sends it (chat template applied):
    a canvas that does not fit the model's context fails here, before any run, naming the spec.
    Returns the prompts' token ids, checked, in order."""
    if not examples:
        return []
    prompts, lengths = [], {}
    for e in examples:
        try:
            prompts.append(llm.check_ids(llm.apply_chat_template(e.chat())))
        except UserError as error:
            raise UserError(f"a prompt of {describe(e)}: {error}") from None
        lengths[len(prompts[-1])] = e
    longest = max(lengths)
    for spec, p in params.items():
        try:
            llm.resolve_for_prompt(p, longest)
        except UserError as e:
            raise UserError(f"spec {spec!r} on the longest prompt ({describe(lengths[longest])}, "
                            f"{longest} tokens): {e}") from None
    return prompts


def describe(example: Prompt) -> str:
    """Where a prompt an error names comes from: ``FILE, line N`` (a prompts file's,
    ``bench.prompts.PromptExample.where``) or ``task NAME``."""
    where = getattr(example, "where", None)
    return where if where is not None else f"task {example.task}"


def resolve_specs(specs: list[str], resolve, defaults: dict | None = None,
                  parse=parse_spec) -> dict[str, SamplingParams]:
    """Each spec parsed by ``parse`` (the model's: ``LLM.parse_spec``; ``defaults`` for the
    fields it leaves out) and passed to ``resolve``; a spec that fails names itself."""
    resolved = {}
    for spec in specs:
        try:
            resolved[spec] = resolve(parse(spec, **(defaults or {})))
        except UserError as e:
            raise UserError(f"spec {spec!r}: {e}") from None
    return resolved


def check_specs(model: str | Path, specs: list[str], defaults: dict | None = None) -> dict[str, SamplingParams]:
    """Resolve every spec against the checkpoint's config alone, before any weights load."""
    _, family, cfg = read_config(model)
    gen = read_generation_config(Path(model))
    return resolve_specs(specs, lambda p: resolve_params(p, family.methods, gen, cfg.logit_shift,
                                                         trained_block_size(cfg)), defaults)


HEADER = (f"{'method':<48} {'batch':>5} {'acc':>6} {'tok/s':>8} {'nfe':>6} {'tok/step':>8} "
          f"{'redund':>7} {'stop%':>6} {'prefill':>8} {'mem MB':>7}")


def format_row(r: BenchRecord) -> str:
    return (f"{r.method:<48} {r.batch_size:>5} {percent(r.accuracy):>6} {r.throughput:>8.1f} {r.nfe:>6} "
            f"{r.decoded_tokens / max(1, r.nfe):>8.2f} {r.redundancy:>7.2f} {r.stop_share:>6.1%} {r.prefill_tokens:>8} "
            f"{r.peak_memory_mb:>7.0f}" + per_rank_memory(r) + rounds(r))


def rounds(r: BenchRecord) -> str:
    """More than one round: ``  rounds 1.23/1.31/1.27 s`` (each pass's seconds, in order)."""
    if len(r.runs_seconds) < 2:
        return ""
    return "  rounds " + "/".join(f"{t:.2f}" for t in r.runs_seconds) + " s"


def per_rank_memory(r: BenchRecord) -> str:
    """Tensor parallel: `` ranks MB a/b/...`` (each rank's peak resident memory)."""
    if not r.peak_memory_mb_per_rank:
        return ""
    return "  ranks MB " + "/".join(f"{m:.0f}" for m in r.peak_memory_mb_per_rank)


def table(records: list[BenchRecord]) -> str:
    """Markdown table of ``records`` (``report.table``)."""
    return report_table([r.as_row() for r in records])


def plot(records: list[BenchRecord], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for method in dict.fromkeys(r.method for r in records):
        rows = [r for r in records if r.method == method]
        line, = ax.plot([r.batch_size for r in rows], [r.throughput for r in rows], marker="o", label=method)
        if any(len(r.runs_seconds) > 1 for r in rows):  # rounds: a bar down to the slowest pass
            slowest = [r.output_tokens / max(r.runs_seconds) if max(r.runs_seconds) else 0.0 for r in rows]
            ax.vlines([r.batch_size for r in rows], slowest, [r.throughput for r in rows],
                      color=line.get_color(), alpha=0.5)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size")
    ax.set_ylabel("throughput (output tokens / s)")
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
