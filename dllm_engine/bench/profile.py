"""``dllm profile``: where a step's time goes, and how often it waits for the device.

For each method spec and batch size the same prompts run three times; greedy outputs are
deterministic, so every pass makes the same steps:

1. timed: the wall time of every ``Engine.step`` (tokens/s as ``dllm bench`` counts them);
2. floor: the same steps again and, right after each, every module of the model's forward
   (embedding, each layer, final norm, LM head) replayed on the tensors it was given, its
   context frozen and made ready beforehand (masks, key lengths, packing indices and row
   groups computed, no hooks, no cache writes, no stats). The floor is the model's forward on
   the step's tensors alone; everything else (planning, building the step's tensors, masks,
   packing, hooks, K/V writes, logits selection, commit, bookkeeping) is the overhead.
   Recording a call costs a pre-hook and a hook-free twin of its context (``dataclasses.replace``
   of a frozen context, a few percent of a tiny model's step), which is why the timed pass runs
   without it;
3. syncs: a ``TorchDispatchMode`` counts the aten ops (``pad_sequence`` as one per sequence
   and one more: on a GPU it launches a copy per sequence) and host synchronisations (ops whose result the host
   reads, or whose output shape depends on data: ``aten._local_scalar_dense`` / ``aten.item`` /
   ``aten.is_nonzero`` behind ``.item()``, ``int()``, ``bool()``, ``nonzero``, boolean indexing, ``equal``, ...), a
   ``TorchFunctionMode`` adds ``.tolist()`` and ``.numpy()``; the ones inside the layer loop (between the
   embedding and the final norm) are counted apart. On a GPU each one stalls the stream and
   stops a CUDA graph from capturing the step. The same pass counts the **forward shapes**:
   the distinct signatures of a forward (per layer: rows, tokens, keys, masked or not) over the
   run. A captured step (a CUDA graph, ``torch.compile`` without dynamic shapes) needs one
   capture per signature;
4. with ``--breakdown``, the op time by kind (matmul, attention, elementwise, data movement,
   views and allocation, other) under torch's profiler (``op_breakdown``): what a method that computes fewer tokens
   saves where, e.g. FOCUS's attention still reading every cached key for the queries it keeps.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from ..errors import UserError
from ..engine.llm import LLM
from ..sampling_params import SamplingParams
from ..datasets import Prompt

aten = torch.ops.aten
# wall: what a user waits; cpu: this thread's CPU time, which other processes on a shared
# machine barely disturb (the engine steps on one thread: torch and OMP threads set to 1)
CLOCKS = {"wall": time.perf_counter, "cpu": time.thread_time}
# ops that read a device value on the host, or size their output from data
SYNC_OPS = frozenset({aten._local_scalar_dense, aten.item, aten.is_nonzero, aten.nonzero, aten.masked_select, aten.equal,
                      aten.repeat_interleave, aten.bincount, aten._unique2, aten.unique_dim,
                      aten.unique_consecutive, aten.allclose})
INDEX_OPS = frozenset({aten.index, aten.index_put, aten.index_put_})  # boolean masks: nonzero


def is_sync(func, args: tuple) -> bool:
    packet = func.overloadpacket
    if packet in SYNC_OPS:
        return packet is not aten.repeat_interleave or isinstance(args[0], Tensor) and len(args) > 1 \
            and isinstance(args[1], Tensor)
    if packet in INDEX_OPS and len(args) > 1:
        return any(isinstance(i, Tensor) and i.dtype == torch.bool for i in args[1] if i is not None)
    return False


@dataclass
class SyncCount:
    total: int = 0
    in_layers: int = 0  # inside the layer loop
    ops: int = 0  # every aten op (on a GPU, a kernel launch or a host-side op each)
    layer_ops: int = 0  # of them, inside the layer loop
    steps: int = 0  # engine steps counted
    inside: bool = field(default=False, repr=False)

    def add(self) -> None:
        self.total += 1
        self.in_layers += self.inside

    def add_op(self) -> None:
        self.ops += 1
        self.layer_ops += self.inside


class DispatchSyncs(TorchDispatchMode):
    """Counts the aten ops that reach the dispatcher, and the host synchronisations among them."""

    def __init__(self, count: SyncCount) -> None:
        super().__init__()
        self.count = count

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count.add_op()
        if func.overloadpacket is aten.pad_sequence:  # one op here, a copy per sequence on a GPU
            for _ in args[0]:
                self.count.add_op()
        if is_sync(func, args):
            self.count.add()
        return func(*args, **(kwargs or {}))


class ListSyncs(TorchFunctionMode):
    """``.tolist()`` and ``.numpy()`` read a tensor on the host without an aten op the dispatch
    mode would see (a CPU tensor's ``.numpy()`` is a view; on a GPU it follows a copy, a read)."""

    def __init__(self, count: SyncCount) -> None:
        super().__init__()
        self.count = count

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is Tensor.tolist or func is Tensor.numpy:
            self.count.add()
        return func(*args, **(kwargs or {}))


class LayerLoopFlag:
    """Marks the layer loop (after the embedding, before the final norm) for ``SyncCount``."""

    def __init__(self, model, count: SyncCount) -> None:
        self.handles = [model.embed_tokens.register_forward_hook(lambda *a: self.set(count, True)),
                        model.norm.register_forward_pre_hook(lambda *a: self.set(count, False))]

    @staticmethod
    def set(count: SyncCount, inside: bool) -> None:
        count.inside = inside

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


class ShapeLog:
    """The distinct forward signatures of a run: per layer (rows, tokens, keys, whether a mask
    is applied), from the context each layer is called with. A strategy that
    shrinks the token set (FOCUS, early skip) changes the signature inside the forward. A
    context manager: the hooks come off on exit."""

    def __init__(self, model) -> None:
        self.signatures: set[tuple] = set()
        self.current: list[tuple] = []
        self.handles = [model.embed_tokens.register_forward_hook(lambda *a: self.current.clear()),
                        model.norm.register_forward_pre_hook(lambda *a: self.close())]
        self.handles += [layer.register_forward_pre_hook(self.record) for layer in model.layers]

    def record(self, module, args) -> None:
        ctx = args[1]  # the hidden state may be packed: the context has the [B, T] layout
        self.current.append((*ctx.token_valid.shape, ctx.key_length, ctx.attn_mask is not None))

    def close(self) -> None:
        self.signatures.add(tuple(self.current))

    def __enter__(self) -> "ShapeLog":
        return self

    def __exit__(self, *exc) -> None:
        for h in self.handles:
            h.remove()


# -- the floor: replay each module of the forward on its own inputs ---------------------------
class ReadOnlyCache:
    """One layer's K/V rows as the step saw them (views, so rows the engine releases after the
    step stay readable): reads as the step read, writes nothing."""

    ALL = 1 << 40  # read every position; a replay asks for the step's own length

    def __init__(self, cache, layer: int) -> None:
        self.k, self.v = cache.read(layer, self.ALL)

    def write(self, *args, **kwargs) -> None:
        pass

    def write_index(self, *args) -> None:
        return None

    def read(self, layer: int, length: int) -> tuple[Tensor, Tensor]:
        return self.k[:, :, :length], self.v[:, :, :length]


def replay_context(ctx, layer: int):
    """``ctx`` (frozen: what ``layer`` saw) without hooks, and with the layer's K/V as the
    step read them and no cache writes: a replay runs the layer alone."""
    cache = ReadOnlyCache(ctx.cache, layer) if ctx.cache is not None else None
    return dataclasses.replace(ctx, hooks=None, cache=cache)


def ready(snap, num_keys: int):
    """``snap`` with what the layer would derive computed beforehand (masks, packing, row
    groups), so the replay times the layer's own work."""
    return dataclasses.replace(snap, attn_mask=snap.attention_mask(num_keys)).prepare()


def prepared(args: tuple) -> tuple:
    """A recorded call's arguments, a decoder layer's context ``ready``."""
    if len(args) == 1:
        return args
    h, snap = args
    return h, ready(snap, snap.num_keys() if snap.cache is not None else h.shape[1])


class FloorRecorder:
    """Records each module call of the forward (pre-hooks), then replays them timed."""

    def __init__(self, model, clock=time.perf_counter) -> None:
        self.model = model
        self.clock = clock
        self.calls: list[tuple] = []
        self.recording = True
        self.seconds = 0.0  # replayed so far
        mods = [model.embed_tokens, *model.layers, model.norm, model.lm_head]
        self.handles = [m.register_forward_pre_hook(self.record) for m in mods]

    def record(self, module, args) -> None:
        if not self.recording:
            return
        if len(args) > 1:  # a decoder layer: (hidden, ctx)
            args = (args[0], replay_context(args[1], module.self_attn.layer_idx))
        self.calls.append((module, args))

    @torch.inference_mode()
    def replay(self) -> None:
        """Run the recorded calls on their own, adding their time to ``seconds``; clears them."""
        calls, self.calls = [(module, prepared(args)) for module, args in self.calls], []
        self.recording = False
        cuda = next(self.model.parameters()).device.type == "cuda"
        if cuda:  # kernels run asynchronously: time them from an idle device to a drained one
            torch.cuda.synchronize()
        start = self.clock()
        for module, args in calls:
            module(*args)
        if cuda:
            torch.cuda.synchronize()
        self.seconds += self.clock() - start
        self.recording = True

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


# -- the passes ----------------------------------------------------------------------------------
@dataclass
class ProfileRecord:
    method: str
    batch_size: int
    steps: int  # engine steps (one forward per method group each)
    step_ms: float  # mean wall time per step
    floor_ms: float  # mean time of the step's modules replayed alone
    overhead: float  # 1 - floor / step
    syncs_per_step: float
    layer_syncs_per_step: float  # inside the layer loop
    throughput: float  # output tokens / s in the timed pass
    forward_shapes: int = 0  # distinct forward signatures (ShapeLog) over the run
    ops_per_step: float = 0.0  # aten ops outside the layer loop (the engine's own work)
    layer_ops_per_step: float = 0.0  # aten ops inside the layer loop
    breakdown: dict[str, float] | None = None  # ms per step by op kind (``op_breakdown``), when asked


def run_batches(llm: LLM, params: SamplingParams, prompts: list[list[int]], batch_size: int,
                after_step=None, clock=time.perf_counter) -> tuple[int, float, int]:
    """Generate ``prompts`` in batches; returns (steps, seconds in steps, output tokens)."""
    engine, steps, seconds, tokens = llm.engine, 0, 0.0, 0
    for i in range(0, len(prompts), batch_size):
        for ids in prompts[i: i + batch_size]:
            engine.add(llm.make_sequence(ids, params))
        while engine.has_work():
            start = clock()
            done = engine.step()
            seconds += clock() - start
            steps += 1
            tokens += sum(s.stats.output_tokens for s in done)
            if after_step is not None:
                after_step()
    return steps, seconds, tokens


def profile_one(llm: LLM, spec: str, params: SamplingParams, prompts: list[list[int]],
                batch_size: int, repeats: int = 1, clock: str = "wall", breakdown: bool = False) -> ProfileRecord:
    """Profile one spec at one batch size; prompts repeat to fill a batch larger than them.
    ``repeats``: timed and floor passes alternate that many times and each keeps its fastest
    (on a shared machine the minimum is the least disturbed). ``clock``: ``wall`` or ``cpu``
    (``CLOCKS``). ``breakdown``: a last pass under torch's profiler (``op_breakdown``)."""
    tick = CLOCKS[clock]
    prompts = [prompts[i % len(prompts)] for i in range(max(len(prompts), batch_size))]
    run_batches(llm, params, prompts[:1], 1)  # warm-up
    seconds = floor = float("inf")
    for _ in range(repeats):
        steps, timed, tokens = run_batches(llm, params, prompts, batch_size, clock=tick)
        seconds = min(seconds, timed)
        floor = min(floor, floor_seconds(llm, params, prompts, batch_size, steps, tick))
    with ShapeLog(llm.model) as shapes:
        count = count_syncs(llm, params, prompts, batch_size)
    return ProfileRecord(method=spec, batch_size=batch_size, steps=steps,
                         step_ms=round(1e3 * seconds / steps, 3), floor_ms=round(1e3 * floor / steps, 3),
                         overhead=round(1 - floor / seconds, 4),
                         syncs_per_step=round(count.total / steps, 2),
                         layer_syncs_per_step=round(count.in_layers / steps, 2),
                         throughput=round(tokens / seconds, 2), forward_shapes=len(shapes.signatures),
                         ops_per_step=round((count.ops - count.layer_ops) / steps, 1),
                         layer_ops_per_step=round(count.layer_ops / steps, 1),
                         breakdown=op_breakdown(llm, params, prompts, batch_size) if breakdown else None)


def floor_seconds(llm: LLM, params: SamplingParams, prompts: list[list[int]], batch_size: int,
                  steps: int, clock=time.perf_counter) -> float:
    """The floor of the same ``steps`` (greedy steps repeat), in a pass of its own: recording
    a module call (a pre-hook, a hook-free twin of its context) costs a few percent of a tiny
    model's step, so the timed pass runs without the recorder."""
    recorder = FloorRecorder(llm.model, clock)
    try:
        again = run_batches(llm, params, prompts, batch_size, recorder.replay, clock)[0]
    finally:
        recorder.remove()
    if again != steps:
        raise RuntimeError(f"{params.method}: the floor pass made {again} steps, the timed pass "
                           f"{steps}: the passes must make the same steps (a fixed seed)")
    return recorder.seconds


def count_syncs(llm: LLM, params: SamplingParams, prompts: list[list[int]], batch_size: int) -> SyncCount:
    count = SyncCount()
    flag = LayerLoopFlag(llm.model, count)
    try:
        with ListSyncs(count), DispatchSyncs(count):
            count.steps = run_batches(llm, params, prompts, batch_size)[0]
    finally:
        flag.remove()
    return count


def run_profile(llm: LLM, specs: list[str], batch_sizes: list[int], examples: list[Prompt],
                defaults: dict | None = None, progress=print, repeats: int = 1,
                clock: str = "wall", breakdown: bool = False) -> list[ProfileRecord]:
    """Profile every spec at every batch size (interleaved, as ``dllm bench`` does);
    ``breakdown``: each row's op time by kind too (``op_breakdown``)."""
    if not specs or not batch_sizes or any(b < 1 for b in batch_sizes):
        raise UserError(f"give at least one method spec and batch sizes >= 1, got {specs} / {batch_sizes}")
    if repeats < 1:
        raise UserError(f"--repeats must be >= 1, got {repeats}")
    if clock not in CLOCKS:
        raise UserError(f"--clock must be one of {', '.join(CLOCKS)}, got {clock!r}")
    if not examples:
        raise UserError("no prompts to profile")
    from .offline import check_prompts, resolve_specs
    params = resolve_specs(specs, llm.resolve, defaults)  # validate all first, and every prompt
    prompts = check_prompts(llm, params, examples)  # against each, as dllm bench does
    records = []
    # every pass the same steps (the timed, the floor's replay, the counted one): no prefix reuse
    store, llm.engine.prefix_store = llm.engine.prefix_store, None
    try:
        for bs in batch_sizes:
            for spec in specs:
                records.append(profile_one(llm, spec, params[spec], prompts, bs, repeats, clock, breakdown))
                progress(format_row(records[-1]))
    finally:
        llm.engine.prefix_store = store
    return records


HEADER = (f"{'method':<44} {'batch':>5} {'steps':>6} {'step ms':>8} {'floor ms':>8} {'overhead':>8} "
          f"{'syncs':>7} {'in layers':>9} {'ops':>8} {'in layers':>9} {'tok/s':>8} {'shapes':>6}")


def format_row(r: ProfileRecord) -> str:
    return (f"{r.method:<44} {r.batch_size:>5} {r.steps:>6} {r.step_ms:>8.2f} {r.floor_ms:>8.2f} "
            f"{r.overhead:>8.1%} {r.syncs_per_step:>7.1f} {r.layer_syncs_per_step:>9.1f} {r.ops_per_step:>8.1f} "
            f"{r.layer_ops_per_step:>9.1f} {r.throughput:>8.1f} {r.forward_shapes:>6}")


def table(records: list[ProfileRecord]) -> str:
    lines = ["| method | batch | steps | step ms | floor ms | overhead | host syncs / step | in the layer loop "
             "| ops / step | in the layer loop | tok/s | forward shapes |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        lines.append(f"| `{r.method}` | {r.batch_size} | {r.steps} | {r.step_ms:.2f} | {r.floor_ms:.2f} | "
                     f"{r.overhead:.1%} | {r.syncs_per_step:.1f} | {r.layer_syncs_per_step:.1f} | "
                     f"{r.ops_per_step:.1f} | {r.layer_ops_per_step:.1f} | {r.throughput:.1f} | {r.forward_shapes} |")
    return "\n".join(lines)


# -- where the op time goes ----------------------------------------------------------------------
# The kinds of aten op ``op_breakdown`` sums self time by; an op no set names is "other".
MATMUL = frozenset({"mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "_weight_int8pack_mm",
                    "_weight_int4pack_mm", "_int_mm"})
ELEMENTWISE = frozenset({"mul", "add", "sub", "div", "pow", "rsqrt", "sqrt", "exp", "log", "tanh", "neg", "silu",
                         "gelu", "sigmoid", "_softmax", "softmax", "_log_softmax", "log_softmax", "mean", "sum",
                         "max", "amax", "min", "amin", "argmax", "topk", "sort", "clamp", "clamp_min", "reciprocal",
                         "abs", "eq", "ne", "lt", "le", "gt", "ge", "logical_and", "logical_or", "logical_not",
                         "bitwise_and", "bitwise_or", "bitwise_xor", "bitwise_not", "cumsum", "remainder",
                         "floor_divide", "maximum", "minimum", "sin", "cos", "erf", "mul_", "add_", "div_",
                         "sub_", "exponential_", "uniform_", "log1p", "expm1", "any", "all"})
MOVEMENT = frozenset({"copy_", "_to_copy", "to", "clone", "contiguous", "index", "index_put_", "_index_put_impl_",
                      "index_copy", "index_copy_", "index_select", "gather", "scatter", "scatter_", "scatter_add_",
                      "cat", "stack", "fill_", "zero_", "masked_fill", "masked_fill_", "masked_select", "where",
                      "nonzero", "nonzero_static", "embedding", "repeat", "expand_as", "narrow_copy",
                      "constant_pad_nd", "pad", "flip", "roll", "_unsafe_view", "take_along_dim"})
# no data touched: a view's or a new tensor's bookkeeping, the per-op host cost a fused or
# captured step removes
VIEWS = frozenset({"as_strided", "transpose", "slice", "reshape", "view", "t", "narrow", "unsqueeze", "squeeze",
                   "expand", "select", "alias", "permute", "split", "split_with_sizes", "chunk", "unbind",
                   "unflatten", "flatten", "detach", "resolve_conj", "resolve_neg", "lift_fresh", "empty",
                   "empty_strided", "empty_like", "new_empty", "new_empty_strided", "zeros", "zeros_like",
                   "new_zeros", "ones", "ones_like", "full", "new_full", "arange", "scalar_tensor"})
KINDS = ("matmul", "attention", "elementwise", "data movement", "views and allocation", "other")


def op_kind(name: str) -> str:
    """The kind of a profiler event named ``aten::NAME``: matmul, attention (every SDPA kernel),
    elementwise (and reductions), data movement (copies, gathers, scatters, concatenation,
    fills), views and allocation (no data touched), or other."""
    op = name.removeprefix("aten::")
    if "scaled_dot_product" in op or "attention" in op:
        return "attention"
    if op in MATMUL:
        return "matmul"
    if op in ELEMENTWISE:
        return "elementwise"
    if op in MOVEMENT:
        return "data movement"
    if op in VIEWS:
        return "views and allocation"
    return "other"


def op_breakdown(llm: LLM, params: SamplingParams, prompts: list[list[int]], batch_size: int
                 ) -> dict[str, float]:
    """The same steps once more under ``torch.profiler``: each kind's self time (``op_kind``;
    device time on CUDA, else CPU time) in ms per step. Self time: a composite op (``linear``)
    counts only what it does itself, the kernels it calls count as theirs."""
    from torch.profiler import ProfilerActivity, profile
    cuda = llm.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        steps = run_batches(llm, params, prompts, batch_size)[0]
    return kind_totals(prof.key_averages(), steps, cuda)


def kind_totals(events, steps: int, cuda: bool = False) -> dict[str, float]:
    """The profiler's ``events`` (``key_averages()``) as each kind's aten self time in ms per
    step of ``steps``: device time on CUDA, else CPU time."""
    totals = dict.fromkeys(KINDS, 0.0)
    for event in events:
        if event.key.startswith("aten::"):
            totals[op_kind(event.key)] += event.self_device_time_total if cuda else event.self_cpu_time_total
    return {kind: round(us / 1e3 / steps, 3) for kind, us in totals.items()}


def breakdown_table(records: list[ProfileRecord]) -> str:
    """Each profiled row's op time by kind: ms per step and its share of the step's op time."""
    lines = ["| method | batch | " + " | ".join(KINDS) + " |", "|---|---|" + "---|" * len(KINDS)]
    for r in records:
        if r.breakdown:
            total = sum(r.breakdown.values()) or 1.0
            cells = [f"{r.breakdown[k]:.2f} ({r.breakdown[k] / total:.0%})" for k in KINDS]
            lines.append(f"| `{r.method}` | {r.batch_size} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
