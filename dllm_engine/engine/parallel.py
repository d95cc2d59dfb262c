"""Tensor parallelism over torch.distributed: ``tensor_parallel_size`` processes, one per device.

Rank 0 is the engine: it schedules, plans, runs the strategies and commits, exactly as in one
process. Every step it sends the other ranks a plain step message (``step_message``: the step's
tensors, the pool changes since the last step, which KV pool rows to use, and the data the
step's layer hooks decide from; ints, lists and tensors only, never a sequence or a strategy
object). They rebuild the hooks from it and run the same forward on their slice of the model
(``models/parallel.py``); the collectives inside the model (all-reduce after row-parallel
layers, the logits gathered to rank 0) keep every rank's hidden states identical, so a hook
decides the same on every rank.

Two ways to start:
- spawned: ``LLM(path, tensor_parallel_size=N)`` in a plain process starts N - 1 daemon worker
  processes that join a process group through a TCP store on 127.0.0.1;
- torchrun: every rank runs the same program; ``LLM`` joins the existing group (RANK,
  WORLD_SIZE, LOCAL_RANK, MASTER_ADDR from the environment; multi-node through torchrun's
  rendezvous). Ranks other than 0 serve steps inside ``LLM()`` and exit when rank 0 closes.

Failure: every wait is bounded (``DLLM_TP_TIMEOUT`` seconds, default 300, for collectives; a
worker waits for rank 0's next step for as long as rank 0 lives). A worker that dies is reported
by rank 0 (``WorkerDied``) and the group is shut down; a worker whose rank 0 dies exits.
"""
from __future__ import annotations

import dataclasses
import importlib
import io
import logging
import os
import resource
import sys
import time
import weakref
from datetime import timedelta
from pathlib import Path
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ..errors import UserError
from ..models import load_model
from ..models.layers import DiffusionLM
from ..models.loader import parse_device, read_config
from ..models.parallel import Shard, check_shardable
from .kv_cache import KVCache
from .runner import Runner, StepInputs

log = logging.getLogger(__name__)

TIMEOUT_S = float(os.environ.get("DLLM_TP_TIMEOUT", "300"))  # bound on every collective
IDLE_TIMEOUT = timedelta(days=7)  # a worker waiting for rank 0's next step (rank 0 death ends it sooner)
JOIN_POLL_S = 0.05


class Weights(NamedTuple):
    """What every rank loads: the checkpoint folder, the dtype (a name or "auto") and the
    quantization (None or a name); plain values, so a spawned worker gets them pickled."""
    path: str
    dtype: str
    quantization: str | None = None


class WorkerDied(RuntimeError):
    """A tensor-parallel rank exited or stopped answering; the engine cannot step any more."""


class Channel:
    """Rank 0 -> every other rank: one pickled message per call, broadcast over a gloo group
    (CPU), whatever the compute backend. Tensors travel through ``torch.save`` and land on the
    receiver's device."""

    def __init__(self, group, device: torch.device) -> None:
        self.group, self.device = group, device

    def send(self, message: tuple) -> None:
        buf = io.BytesIO()
        torch.save(message, buf)
        data = torch.frombuffer(bytearray(buf.getbuffer()), dtype=torch.uint8)
        dist.broadcast(torch.tensor([data.numel()]), group=self.group, group_src=0)
        dist.broadcast(data, group=self.group, group_src=0)

    def receive(self) -> tuple:
        size = torch.zeros(1, dtype=torch.long)
        dist.broadcast(size, group=self.group, group_src=0)
        data = torch.empty(int(size), dtype=torch.uint8)
        dist.broadcast(data, group=self.group, group_src=0)
        return torch.load(io.BytesIO(data.numpy().tobytes()), map_location=self.device, weights_only=False)


class LoggedKVCache(KVCache):
    """Rank 0's KV pool: records how its rows move so the other ranks' pools (their KV heads of
    the same rows) move the same way."""

    def __init__(self, log: list, cache_id: int, *args) -> None:
        super().__init__(*args)
        self.log, self.cache_id = log, cache_id

    def arrange(self, ids: list[int], length: int, rows: int = 0) -> list[int]:
        self.log.append(("arrange", self.cache_id, list(ids), length, rows))
        return super().arrange(ids, length, rows)


class ParallelRunner(Runner):
    """Rank 0's runner: before each forward, sends the step to the other ranks."""

    def __init__(self, model: DiffusionLM, parallel: "TensorParallel") -> None:
        super().__init__(model)
        self.parallel = parallel
        self.share_forwards = False  # the other ranks take a row range and replay no row copy
        self.cache_log: list = []  # pool changes not yet sent (a pool's finalizer may add one any time)
        self.num_caches = 0

    def new_cache(self) -> KVCache:
        p = next(self.model.parameters())
        cache_id, self.num_caches = self.num_caches, self.num_caches + 1
        cache = LoggedKVCache(self.cache_log, cache_id, self.num_layers, self.model.num_kv_heads,
                              self.model.config.head_dim, p.dtype, p.device)
        self.cache_log.append(("new", cache_id))
        weakref.finalize(cache, self.cache_log.append, ("drop", cache_id))
        return cache

    def run(self, step: StepInputs, ctx) -> tuple:
        view = ctx.cache
        if hasattr(view, "cache"):  # a view of a pool's rows
            where = (view.cache.cache_id, view.rows.start, view.rows.stop)
        else:
            where = (view.cache_id, None, None)
        n = len(self.cache_log)
        ops = self.cache_log[:n]
        del self.cache_log[:n]
        self.parallel.send(step_message(ops, step, where, ctx.hooks))
        return self.parallel.guard(super().run, step, ctx)


# Bytes per step, mean over a run (torch.save of the message, as ``Channel.send`` sends it; 24
# held-out prompts, load_split(["sort", "copy"], limit=4), in one batch, max_new_tokens 64):
# tiny-llada dual-cache+early-skip 1,659,682 when the hooks object was pickled (it carried the
# group's Sequences: canvases, every strategy state) -> 867,292 now (what is left is tensors the
# forward reads: at a skipping step ~810,000 for the hidden-state windows the skip scores compare
# with, ~260,000 for the step's [B, 1, T, S] mask);
# tiny-sdar block+focus 64,527 -> 56,371 (EvictionHooks carried each sequence's FocusState).
def step_message(ops: list, step: StepInputs, where: tuple, hooks) -> tuple:
    """What rank 0 sends the other ranks for one step, plain data only (ints, bools, strings,
    lists, tuples, dicts, tensors, NumPy arrays of numbers: the plans' host slots): the pool changes ``ops``, the step's tensors, the pool rows
    ``where`` (cache id, first row, end row; None, None: the whole pool) and the layer hooks'
    ``rank_message`` with the class that rebuilds them (``rank_hooks``)."""
    fields = {f.name: getattr(step, f.name) for f in dataclasses.fields(step)}
    return ("step", ops, fields, where, None if hooks is None else hooks_message(hooks))


def hooks_message(hooks) -> dict:
    """A hooks object as plain data: its class ("module:Class") and its ``rank_message``."""
    return {"class": f"{type(hooks).__module__}:{type(hooks).__qualname__}", **hooks.rank_message()}


def rank_hooks(message: dict | None):
    """The hooks a worker runs, rebuilt by their class's ``from_rank_message``."""
    if message is None:
        return None
    fields = dict(message)
    module, name = fields.pop("class").split(":")
    return getattr(importlib.import_module(module), name).from_rank_message(fields)


class TensorParallel:
    """Rank 0's handle on a tensor-parallel group: its model slice, runner, workers, shutdown."""

    def __init__(self, model: DiffusionLM, channel: Channel, procs: list, owns_group: bool) -> None:
        self.model, self.channel, self.procs = model, channel, procs
        self.owns_group = owns_group
        self.size = model.shard.size
        # the masked families' steps go through a runner; a canvas model's sampler mirrors its
        # batches instead (engine/canvas_parallel.py)
        self.runner = ParallelRunner(model, self) if isinstance(model, DiffusionLM) else None
        self.error: str | None = None
        self.closed = False
        self.released: list[int] = []  # ids of mirrored objects rank 0 let go (engine/canvas_parallel.py)

    # -- starting ----------------------------------------------------------------------------
    @classmethod
    def of_llm(cls, owner, path, dtype, quantization, device: torch.device, size: int,
               keep_freed_memory: bool) -> "TensorParallel | None":
        """An ``LLM``'s (or ``CanvasLLM``'s) group of ``size`` ranks, closed when ``owner`` is
        collected; None for one process, and on the meta device (a weights-free front, as
        ``dllm serve --replicas`` has), where only the check that the shapes split runs."""
        if size == 1:
            return None
        if device.type == "meta":
            check_weights_shardable(str(path), size)
            return None
        parallel = cls.start(Weights(str(path), dtype, quantization), device, size, keep_freed_memory)
        weakref.finalize(owner, parallel.close)
        return parallel

    @classmethod
    def start(cls, weights: Weights, device: str | torch.device, size: int,
              keep_freed_memory: bool = False) -> "TensorParallel":
        """Rank 0 of ``size`` ranks: spawn the workers, or join torchrun's group."""
        check_weights_shardable(weights.path, size)  # before any process starts
        device = parse_device(device)
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            return cls.join_torchrun(weights, device, size)
        if dist.is_initialized():
            raise RuntimeError("this process already belongs to a torch.distributed group; one "
                               "tensor-parallel LLM per process (close the other one first)")
        store = dist.TCPStore("127.0.0.1", 0, size, is_master=True, timeout=timedelta(seconds=TIMEOUT_S),
                              wait_for_workers=False)
        spawn = mp.get_context("spawn")
        procs = [spawn.Process(target=worker_main, daemon=True, name=f"dllm-tp-rank{r}",
                               args=(weights, str(device), r, size, store.port,
                                     torch.get_num_threads(), keep_freed_memory))
                 for r in range(1, size)]
        for p in procs:
            p.start()
        try:
            wait_for_workers(store, procs)
            dist.init_process_group(backend_of(device), store=store, rank=0, world_size=size,
                                    timeout=timedelta(seconds=TIMEOUT_S))
            return cls.load(weights, rank_device(device, 0), size, procs, owns_group=True)
        except BaseException:
            stop(procs)
            if dist.is_initialized():
                dist.destroy_process_group()
            raise

    @classmethod
    def join_torchrun(cls, weights: Weights, device: torch.device, size: int) -> "TensorParallel":
        world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
        if world != size:
            raise UserError(f"tensor_parallel_size {size} but torchrun started WORLD_SIZE {world} "
                            f"processes; pass --nproc-per-node (x nodes) = {size}")
        device = rank_device(device, int(os.environ.get("LOCAL_RANK", rank)))
        if not dist.is_initialized():
            dist.init_process_group(backend_of(device), timeout=timedelta(seconds=TIMEOUT_S))
        if rank == 0:
            return cls.load(weights, device, size, [], owns_group=True)
        serve_rank(weights, device, rank, size)
        raise SystemExit(0)  # a torchrun worker's program ends when rank 0 closes the engine

    @classmethod
    def load(cls, weights: Weights, device, size, procs, owns_group) -> "TensorParallel":
        channel = Channel(dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT), device)
        model, error = load_shard(weights, device, 0, size)
        errors = gather_errors(channel.group, error)
        if errors:  # every rank saw them: the workers return, rank 0 raises
            stop(procs)
            if owns_group:
                dist.destroy_process_group()
            raise UserError("tensor-parallel ranks failed to load the model: " + "; ".join(errors))
        return cls(model, channel, procs, owns_group)

    # -- running -----------------------------------------------------------------------------
    def send(self, message: tuple) -> None:
        self.check_alive()
        self.guard(self.channel.send, message)

    def guard(self, fn, *args):
        """``fn(*args)``, turning a failed collective (a rank died or timed out) into
        ``WorkerDied`` after shutting the group down."""
        try:
            return fn(*args)
        except WorkerDied:
            raise
        except Exception as e:  # the other ranks may be inside a collective: stop them all
            first = str(e).splitlines()[0] if str(e) else ""
            self.fail(f"a step failed on rank 0 or a collective failed ({type(e).__name__}: {first})")

    def check_alive(self) -> None:
        if self.closed:
            raise WorkerDied(self.error or "the tensor-parallel group is closed")
        dead = [(r + 1, p) for r, p in enumerate(self.procs) if not p.is_alive()]
        if dead:
            rank, p = dead[0]
            self.fail(f"rank {rank} (pid {p.pid}) exited with code {p.exitcode}")

    def fail(self, why: str) -> None:
        self.error = f"tensor-parallel worker failure: {why}; the engine is shut down"
        self.close(send=False)
        raise WorkerDied(self.error)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Plain logits [B, T, V] (``DiffusionLM.forward``) computed by every rank."""
        self.send(("forward", input_ids, attention_mask))
        with torch.inference_mode():
            return self.guard(self.model, input_ids, attention_mask)

    def report(self) -> list[dict]:
        """Per rank: weight bytes it read, its parameter count and its peak resident memory
        (since start, or since ``reset_peak``)."""
        self.send(("report",))
        return self.guard(gather_reports, self.channel.group, rank_report(self.model))

    def reset_peak(self) -> None:
        """Start every rank's peak resident memory afresh (Linux; a no-op elsewhere)."""
        self.send(("reset_peak",))
        reset_peak_rss()

    # -- shutdown ----------------------------------------------------------------------------
    def close(self, send: bool = True) -> None:
        """Stop the workers (a shutdown message, then bounded joins) and leave the group."""
        if self.closed:
            return
        self.closed = True
        if send:
            try:
                self.channel.send(("shutdown",))
            except Exception:  # a dead worker: nothing to tell it
                log.debug("tensor-parallel shutdown message not sent", exc_info=True)
        stop(self.procs)
        if self.owns_group and dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # a peer already gone: the group ends with the process
                log.debug("destroy_process_group failed", exc_info=True)


# -- helpers shared by rank 0 and the workers ---------------------------------------------------
def backend_of(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def rank_device(device: torch.device, local_rank: int) -> torch.device:
    """One device per rank: cuda:LOCAL_RANK on GPUs; every rank on the CPU otherwise."""
    if device.type == "cuda":
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return device


def check_weights_shardable(path: str, size: int) -> None:
    """The checkpoint's shapes split over ``size`` ranks (its family's rule), read from its
    config alone."""
    from .canvas_llm import is_canvas_checkpoint
    if is_canvas_checkpoint(path):
        from ..models.diffusion_gemma import check_shardable as check_canvas, read_config as read_canvas_config
        check_canvas(read_canvas_config(Path(path))[1], size)
        return
    _, _, cfg = read_config(path)
    check_shardable(cfg, size)


def load_shard(weights: Weights, device, rank: int, size: int) -> tuple[DiffusionLM | None, str | None]:
    from .canvas_llm import is_canvas_checkpoint
    try:
        shard = Shard(rank, size, dist.group.WORLD)
        if is_canvas_checkpoint(weights.path):
            from ..models.diffusion_gemma import load_diffusion_gemma
            return load_diffusion_gemma(weights.path, dtype=weights.dtype, device=device, shard=shard,
                                        quantization=weights.quantization), None
        return load_model(weights.path, dtype=weights.dtype, device=device, shard=shard,
                          quantization=weights.quantization), None
    except Exception as e:  # reported to rank 0, which raises it
        return None, f"rank {rank}: {type(e).__name__}: {e}"


def gather_errors(group, error: str | None) -> list[str]:
    errors = [None] * dist.get_world_size(group)
    dist.all_gather_object(errors, error, group=group)
    return [e for e in errors if e]


def rank_report(model: DiffusionLM) -> dict:
    return {"rank": model.shard.rank, "loaded_bytes": getattr(model, "loaded_bytes", 0),
            "num_parameters": sum(p.numel() for p in model.parameters()),
            "peak_rss_mb": peak_rss_mb()}


def peak_rss_mb() -> float:
    """This process's peak resident memory (VmHWM; getrusage where /proc is missing)."""
    try:
        with open("/proc/self/status") as f:
            kb = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
    except (OSError, StopIteration):
        kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return round(kb / 1024, 1)


def reset_peak_rss() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # Linux: reset VmHWM to the current RSS
    except OSError:
        pass


def gather_reports(group, report: dict) -> list[dict]:
    reports = [None] * dist.get_world_size(group)
    dist.all_gather_object(reports, report, group=group)
    return reports


def wait_for_workers(store, procs: list) -> None:
    """Until every spawned worker has reached the store; a worker that dies first is an error
    naming it, not a wait for the timeout."""
    deadline = time.monotonic() + TIMEOUT_S
    keys = [f"joined/{r + 1}" for r in range(len(procs))]
    while not store.check(keys):
        for r, p in enumerate(procs):
            if not p.is_alive():
                raise WorkerDied(f"tensor-parallel rank {r + 1} exited with code {p.exitcode} "
                                 f"before joining the group")
        if time.monotonic() > deadline:
            raise WorkerDied(f"tensor-parallel workers did not start within {TIMEOUT_S:.0f} s")
        time.sleep(JOIN_POLL_S)


def stop(procs: list, timeout: float = 10.0) -> None:
    """Join the workers; terminate, then kill, the ones that do not exit in time."""
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.terminate()
            p.join(2.0)
        if p.is_alive():
            p.kill()
            p.join(2.0)


# -- the other ranks ------------------------------------------------------------------------------
def worker_main(weights: Weights, device: str, rank: int, size: int, port: int, threads: int,
                keep_freed_memory: bool) -> None:
    """A spawned worker: join rank 0's store, then serve steps until told to stop."""
    torch.set_num_threads(threads)
    if keep_freed_memory and device == "cpu":
        from . import host_memory
        host_memory.keep_freed_memory()
    dev = rank_device(torch.device(device), rank)
    store = dist.TCPStore("127.0.0.1", port, size, is_master=False, timeout=timedelta(seconds=TIMEOUT_S))
    store.set(f"joined/{rank}", "1")
    dist.init_process_group(backend_of(dev), store=store, rank=rank, world_size=size,
                            timeout=timedelta(seconds=TIMEOUT_S))
    try:
        serve_rank(weights, dev, rank, size)
    finally:
        try:
            dist.destroy_process_group()
        except Exception:  # rank 0 already gone: the group ends with the process
            log.debug("destroy_process_group failed", exc_info=True)


def serve_rank(weights: Weights, device: torch.device, rank: int, size: int) -> None:
    channel = Channel(dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT), device)
    model, error = load_shard(weights, device, rank, size)
    if gather_errors(channel.group, error):
        return
    try:
        if isinstance(model, DiffusionLM):
            Worker(model, channel).serve()
        else:  # a canvas model (DiffusionGemma): the sampler's batches, mirrored
            from .canvas_parallel import CanvasWorker
            CanvasWorker(model, channel).serve()
    except Exception as e:  # rank 0 is gone or a step failed here: rank 0 reports it
        print(f"dllm tensor-parallel rank {rank}: {type(e).__name__}: {e}", file=sys.stderr)


class RankWorker:
    """A rank other than 0: runs each message rank 0 sends (its kind names the method) until
    told to stop, under ``grad_mode``; every rank answers ``report`` and ``reset_peak``."""

    grad_mode = staticmethod(torch.inference_mode)

    def __init__(self, model, channel: Channel) -> None:
        self.model, self.channel = model, channel

    def serve(self) -> None:
        while True:
            kind, *args = self.channel.receive()
            if kind == "shutdown":
                return
            with self.grad_mode():
                getattr(self, kind)(*args)

    def report(self) -> None:
        gather_reports(self.channel.group, rank_report(self.model))

    def reset_peak(self) -> None:
        reset_peak_rss()


class Worker(RankWorker):
    """Runs the steps rank 0 sends: the same forward on this rank's slice of the model."""

    def __init__(self, model: DiffusionLM, channel: Channel) -> None:
        super().__init__(model, channel)
        self.runner = Runner(model)
        self.caches: dict[int, KVCache] = {}

    def step(self, ops: list, fields: dict, where: tuple, hooks: dict | None) -> None:
        """Rank 0's ``step_message``: the same forward on this rank's slice."""
        self.apply(ops)
        cache_id, start, stop = where
        cache = self.caches[cache_id]
        view = cache if start is None else cache.view(start, stop)
        step = StepInputs(**fields)
        self.runner.run(step, self.runner.context(step, view, rank_hooks(hooks)))

    def apply(self, ops: list) -> None:
        """Rank 0's KV pool changes since the last step, in order."""
        for op, cache_id, *args in ops:
            if op == "new":
                self.caches[cache_id] = self.runner.new_cache()
            elif op == "drop":
                self.caches.pop(cache_id, None)
            else:
                self.caches[cache_id].arrange(*args)

    def forward(self, input_ids, attention_mask) -> None:
        self.model(input_ids, attention_mask)
