"""Server metrics in the Prometheus text exposition format (version 0.0.4), for ``/metrics``.

Small enough to write by hand: counters, gauges read at scrape time, and histograms."""
from __future__ import annotations

import threading
from bisect import bisect_left
from collections import Counter

from ..engine.host_memory import resident_bytes
from ..engine.sequence import SequenceStats

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
PREFIX = "dllm_"


class Histogram:
    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)  # the last one is +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1

    def add(self, other: "Histogram") -> None:
        self.counts = [a + b for a, b in zip(self.counts, other.counts)]
        self.sum += other.sum
        self.count += other.count

    def lines(self, name: str) -> list[str]:
        out, running = [], 0
        for bound, n in zip([*map(repr, self.buckets), "+Inf"], self.counts):
            running += n
            out.append(f'{name}_bucket{{le="{bound}"}} {running}')
        return out + [f"{name}_sum {self.sum}", f"{name}_count {self.count}"]


MEMORY_GAUGES = {
    "resident_memory_bytes": "Resident memory of the serving process (host).",
    "device_memory_allocated_bytes": "Device memory the serving process's tensors hold (CUDA).",
    "device_memory_peak_bytes": "The most device memory its tensors held since it started (CUDA).",
}


def process_memory(device) -> dict[str, int]:
    """This process's memory for ``MEMORY_GAUGES``: its resident set (Linux), and on CUDA the
    device memory its tensors hold now and at most."""
    resident = resident_bytes()
    out = {} if resident is None else {"resident_memory_bytes": resident}
    if device.type == "cuda":
        import torch
        out["device_memory_allocated_bytes"] = torch.cuda.memory_allocated(device)
        out["device_memory_peak_bytes"] = torch.cuda.max_memory_allocated(device)
    return out


class Metrics:
    """Thread-safe: the HTTP side and the engine thread both record."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.requests: Counter[str] = Counter()  # by final status: 200, 400, 429, 500, 503, cancelled
        self.totals = SequenceStats()
        self.prompt_tokens = 0
        self.steps = 0
        self.latency = Histogram(LATENCY_BUCKETS)
        self.first_chunk = Histogram(LATENCY_BUCKETS)
        self.step_time = Histogram(STEP_BUCKETS)

    def __getstate__(self) -> dict:  # picklable (a replica sends its metrics to the front)
        return {k: v for k, v in self.__dict__.items() if k != "lock"}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.lock = threading.Lock()

    def merged(self, others: list["Metrics"]) -> "Metrics":
        """A new Metrics holding the sums of this one and ``others`` (e.g. every replica's)."""
        out = Metrics()
        for m in [self, *others]:
            with m.lock:
                out.requests.update(m.requests)
                out.totals = SequenceStats.total([out.totals, m.totals], 0.0)
                out.prompt_tokens += m.prompt_tokens
                out.steps += m.steps
                for name in ("latency", "first_chunk", "step_time"):
                    getattr(out, name).add(getattr(m, name))
        return out

    def count_request(self, status: int | str) -> None:
        with self.lock:
            self.requests[str(status)] += 1

    def observe_latency(self, seconds: float) -> None:
        with self.lock:
            self.latency.observe(seconds)

    def observe_first_chunk(self, seconds: float) -> None:
        with self.lock:
            self.first_chunk.observe(seconds)

    def observe_step(self, seconds: float) -> None:
        with self.lock:
            self.steps += 1
            self.step_time.observe(seconds)

    def observe_sequence(self, stats: SequenceStats, prompt_tokens: int) -> None:
        with self.lock:
            self.totals = SequenceStats.total([self.totals, stats], 0.0)
            self.prompt_tokens += prompt_tokens

    def render(self, queue_depth: int, running: int, memory: tuple[int | None, int, int] | None = None,
               prefix: tuple[int, float] | None = None, process: dict[str, int] | None = None) -> str:
        """Prometheus text; ``memory``: (the engine's memory budget in bytes or None, bytes its KV
        pools hold, sequences waiting for memory); ``prefix``: (bytes the prefix store holds, its
        hit rate), when it is on; ``process``: the serving process's memory (``process_memory``)."""
        with self.lock:
            t = self.totals
            lines = self.family("requests_total", "counter", "Finished requests by final status.",
                                [f'{PREFIX}requests_total{{status="{s}"}} {n}'
                                 for s, n in sorted(self.requests.items())])
            for name, value, doc in [
                    ("prompt_tokens_total", self.prompt_tokens, "Prompt tokens of finished sequences."),
                    ("output_tokens_total", t.output_tokens, "Tokens returned to users."),
                    ("decoded_tokens_total", t.decoded_tokens, "Slots committed."),
                    ("nfe_total", t.nfe, "Forward passes of finished sequences."),
                    ("processed_tokens_total", t.processed_tokens, "Layer-averaged query tokens."),
                    ("prefill_tokens_total", t.prefill_tokens, "Prompt tokens of first passes."),
                    ("cached_tokens_total", t.cached_tokens,
                     "Prompt tokens whose K/V came from the prefix store or another copy's first forward."),
                    ("engine_steps_total", self.steps, "Engine steps (one batched forward per method)."),
            ]:
                lines += self.family(name, "counter", doc, [f"{PREFIX}{name} {value}"])
            for name, value, doc in [
                    ("redundancy", round(t.redundancy, 6), "processed_tokens / decoded_tokens so far."),
                    ("queue_depth", queue_depth, "Sequences waiting for a slot."),
                    ("running_sequences", running, "Sequences in the running batch."),
            ] + ([] if memory is None else [
                    ("kv_cache_memory_budget_bytes", -1 if memory[0] is None else memory[0],
                     "The memory budget for KV pools and step temporaries (-1: none)."),
                    ("kv_cache_bytes", memory[1], "Bytes the KV pools hold."),
                    ("waiting_for_memory", memory[2], "Sequences waiting because the budget is full."),
            ]) + ([] if prefix is None else [
                    ("prefix_cache_bytes", prefix[0], "Bytes the prefix store holds."),
                    ("prefix_cache_hit_rate", round(prefix[1], 6),
                     "Share of the whole prompt blocks looked up that were stored (block-causal models)."),
            ]) + [(name, value, MEMORY_GAUGES[name]) for name, value in (process or {}).items()]:
                lines += self.family(name, "gauge", doc, [f"{PREFIX}{name} {value}"])
            for name, hist, doc in [
                    ("request_latency_seconds", self.latency, "Time from request to its last byte."),
                    ("time_to_first_chunk_seconds", self.first_chunk, "Streaming: time to first text."),
                    ("step_seconds", self.step_time, "Wall time of one engine step."),
            ]:
                lines += self.family(name, "histogram", doc, hist.lines(PREFIX + name))
        return "\n".join(lines) + "\n"

    @staticmethod
    def family(name: str, kind: str, doc: str, samples: list[str]) -> list[str]:
        return [f"# HELP {PREFIX}{name} {doc}", f"# TYPE {PREFIX}{name} {kind}", *samples]
