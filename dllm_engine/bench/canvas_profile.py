"""``dllm profile`` of a canvas model (DiffusionGemma, ``engine/canvas_llm.py``): what a denoising
step costs outside the model's forwards (sampling, entropy-bound acceptance, renoising, the
self-conditioning hand-over, stops, dropping stopped rows, bookkeeping) against inside them, in
ops (on a GPU each a kernel launch or a host-side op), host reads (each a stall on a GPU) and
time, at each batch size on the same prompts.

Each spec and batch size runs its prompts twice, in chunks of the batch size through
``CanvasLLM.run``: timed (the wall or CPU time of the run and of every encoder and decoder
forward), then counted (every aten op under a ``TorchDispatchMode``, the host reads among them
and ``.tolist()`` / ``.numpy()``, each marked inside or outside a forward). A spec without a
``seed`` samples with seed 0, so both passes make the same steps. Per step means per decoder
forward (a denoising step of a batch); the encoder passes (the prompt, each finished canvas)
count as forwards too."""
from __future__ import annotations

import time
from dataclasses import dataclass

from ..engine.canvas_llm import CanvasLLM, CanvasParams
from .profile import CLOCKS, DispatchSyncs, ListSyncs, SyncCount

FORWARDS = ("encode", "decode")


@dataclass
class CanvasProfile:
    method: str
    batch_size: int
    steps: int  # decoder forwards: the batches' denoising steps
    encodes: int  # encoder forwards
    step_ms: float  # the run's time per step
    forward_ms: float  # of it, in the model's forwards (encoder passes included)
    ops_outside: float  # per step
    ops_inside: float
    syncs_outside: float
    syncs_inside: float
    tokens_per_second: float

    @property
    def overhead(self) -> float:
        """The share of a step's time outside the forwards."""
        return 1 - self.forward_ms / self.step_ms if self.step_ms else 0.0


class Forwards:
    """Wraps the model's ``encode`` and ``decode`` for one pass: counts the calls, times them
    with ``clock`` and marks ``count`` (when given) inside them."""

    def __init__(self, model, clock, count: SyncCount | None = None) -> None:
        self.model, self.clock, self.count = model, clock, count
        self.calls = dict.fromkeys(FORWARDS, 0)
        self.seconds = 0.0

    def __enter__(self) -> Forwards:
        for name in FORWARDS:
            setattr(self.model, name, self.wrap(name, getattr(self.model, name)))
        return self

    def wrap(self, name: str, run):
        def forward(*args, **kwargs):
            if self.count is not None:
                self.count.inside = True
            start = self.clock()
            try:
                return run(*args, **kwargs)
            finally:
                self.seconds += self.clock() - start
                self.calls[name] += 1
                if self.count is not None:
                    self.count.inside = False
        return forward

    def __exit__(self, *exc) -> None:
        for name in FORWARDS:
            delattr(self.model, name)  # the class's method again


def run_chunks(llm: CanvasLLM, params: CanvasParams, prompts: list[list[int]], batch_size: int) -> int:
    """Every prompt, ``batch_size`` at a time; the output tokens."""
    tokens = 0
    for i in range(0, len(prompts), batch_size):
        tokens += llm.run(prompts[i:i + batch_size], params, use_tqdm=False).stats.output_tokens
    return tokens


def profile_canvas(llm: CanvasLLM, spec: str, params: CanvasParams, prompts: list[list[int]], batch_size: int,
                   clock: str = "wall") -> CanvasProfile:
    params = params if params.seed is not None else params.replace(seed=0)
    tick = CLOCKS[clock]
    run_chunks(llm, params, prompts[:1], 1)  # warm-up
    with Forwards(llm.model, tick) as timed:
        start = tick()
        tokens = run_chunks(llm, params, prompts, batch_size)
        seconds = tick() - start
    count = SyncCount()
    with Forwards(llm.model, time.perf_counter, count) as counted, DispatchSyncs(count), ListSyncs(count):
        run_chunks(llm, params, prompts, batch_size)
    steps = max(counted.calls["decode"], 1)
    return CanvasProfile(spec, batch_size, timed.calls["decode"], timed.calls["encode"],
                         round(1000 * seconds / steps, 3), round(1000 * timed.seconds / steps, 3),
                         round((count.ops - count.layer_ops) / steps, 1), round(count.layer_ops / steps, 1),
                         round((count.total - count.in_layers) / steps, 2), round(count.in_layers / steps, 2),
                         round(tokens / seconds, 1) if seconds else 0.0)


HEADER = (f"{'method':<44} {'batch':>5} {'steps':>6} {'step ms':>8} {'fwd ms':>8} {'overhead':>8} "
          f"{'ops out':>8} {'ops in':>8} {'reads out':>9} {'reads in':>8} {'tok/s':>8}")


def format_row(r: CanvasProfile) -> str:
    return (f"{r.method:<44} {r.batch_size:>5} {r.steps:>6} {r.step_ms:>8.2f} {r.forward_ms:>8.2f} "
            f"{r.overhead:>8.1%} {r.ops_outside:>8.1f} {r.ops_inside:>8.1f} {r.syncs_outside:>9.2f} "
            f"{r.syncs_inside:>8.2f} {r.tokens_per_second:>8.1f}")


def table(records: list[CanvasProfile]) -> str:
    """Markdown: per denoising step (decoder forward), outside the forwards and inside them."""
    lines = ["| method | batch | steps | ms per step | in the forwards | outside | ops outside the forwards "
             "| ops inside | host reads outside | host reads inside | tok/s |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        lines.append(f"| `{r.method}` | {r.batch_size} | {r.steps} | {r.step_ms:.2f} | {r.forward_ms:.2f} | "
                     f"{r.overhead:.1%} | {r.ops_outside:.1f} | {r.ops_inside:.1f} | {r.syncs_outside:.2f} | "
                     f"{r.syncs_inside:.2f} | {r.tokens_per_second:.1f} |")
    return "\n".join(lines)


def run_canvas_profile(llm: CanvasLLM, specs: list[str], batch_sizes: list[int], prompts: list[list[int]],
                       defaults: dict, clock: str = "wall", progress=print) -> list[CanvasProfile]:
    """Every spec (``diffusion-gemma[:field=value,...]``) at every batch size."""
    params = {spec: llm.resolve(llm.parse_spec(spec, **defaults)) for spec in specs}  # all checked first
    records = []
    for batch_size in batch_sizes:
        for spec in specs:
            records.append(profile_canvas(llm, spec, params[spec], prompts, batch_size, clock))
            progress(format_row(records[-1]))
    return records
