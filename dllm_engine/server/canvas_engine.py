"""The server's engine for a canvas model (DiffusionGemma; ``engine.canvas_llm``): an
``EngineClient`` whose one thread runs the queued choices through ``CanvasLLM`` in batches.

Not continuous batching: a batch runs its canvases to the end, and a request that arrives
meanwhile waits for the next batch (the engine's step loop, where requests join and leave between
steps, does not take this family yet: docs/models/diffusion-gemma.md). Within that, it serves as
the other families' loop does: a request's choices are admitted whole or refused (429 when the
queue is full, 503 while shutting down), each choice samples with its own seed, a streamed
choice gets its text canvas by canvas (when each of its canvases ends; a stop string or EOS ends
it), and a client that goes away has its choices dropped if they have not started (a running
batch runs to its end)."""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from ..engine.canvas_llm import CanvasLLM, Request
from ..engine.stop_strings import find_stop
from ..errors import UserError
from .engine_client import GenerateRequest, relay
from .loop import Event, held_back
from .metrics import Metrics, process_memory
from .protocol import ApiError, ChoiceResult

log = logging.getLogger("dllm_engine.server")


@dataclass
class Choice:
    """One choice of a request, as the loop thread tracks it."""
    job: CanvasJob
    index: int  # its place among the request's choices (OpenAI's choice index)
    request: Request
    ids: list[int] = field(default_factory=list)  # the canvases it kept so far
    sent: str = ""  # text streamed so far
    done: bool = False  # its text ended (EOS or a stop string): nothing more is streamed


class CanvasJob:
    """One HTTP request: its choices and the queue their events arrive on."""

    def __init__(self, stops: list[str], stream: bool) -> None:
        self.stops, self.stream = stops, stream
        self.events: asyncio.Queue[Event] = asyncio.Queue()
        self.aloop = asyncio.get_running_loop()
        self.cancelled = False

    def emit(self, event: Event) -> None:
        """Thread-safe: called by the loop thread."""
        try:
            self.aloop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # its event loop is closed: nobody is listening any more
            pass


class CanvasEngine:
    """``EngineClient`` of a ``CanvasLLM`` (see the module docstring)."""

    def __init__(self, llm: CanvasLLM, max_queue: int = 256, metrics: Metrics | None = None) -> None:
        if max_queue < 0:
            raise UserError(f"max_queue must be >= 0, got {max_queue}")
        self.llm, self.max_queue = llm, max_queue
        self.metrics = metrics or Metrics()
        self.lock = threading.Condition()
        self.queue: list[Choice] = []  # waiting for a batch (guarded by lock)
        self.running = 0  # choices in the batch now running
        self.accepting, self.stopping = True, False
        self.tokenizer_lock = threading.Lock()  # the HTTP side encodes while this thread decodes
        self.thread = threading.Thread(target=self.run, name="dllm-canvas-loop", daemon=True)

    # -- asyncio side ---------------------------------------------------------------------------
    def start(self) -> None:
        self.thread.start()

    def shutdown(self, timeout: float) -> None:
        """Refuse new requests, let queued and running ones finish for up to ``timeout`` s, then
        drop what is still queued (a running batch ends first)."""
        with self.lock:
            self.accepting = False
            self.lock.wait_for(lambda: not self.queue and not self.running, timeout=timeout)
            self.stopping = True
            self.lock.notify_all()
        self.thread.join()

    def generate(self, request: GenerateRequest) -> AsyncIterator[Event]:
        job: CanvasJob | None = None

        def submit() -> tuple[asyncio.Queue, int]:
            nonlocal job
            job = CanvasJob(request.stops, request.stream)
            choices = [Choice(job, i, Request(i, ids, self.llm.resolve_for_prompt(params, len(ids))))
                       for i, (ids, params) in enumerate(request.choices())]
            for c in choices:
                self.llm.check_memory(c.request)
            self.submit(choices)
            return job.events, len(choices)

        return relay(submit, lambda: self.cancel(job))

    def cancel(self, job: CanvasJob) -> None:
        """The job's choices not yet in a batch leave the queue; a running batch runs on, and
        sends this job nothing more."""
        with self.lock:
            job.cancelled = True
            self.queue = [c for c in self.queue if c.job is not job]
            self.lock.notify_all()

    def submit(self, choices: list[Choice]) -> None:
        capacity = self.llm.max_num_seqs + self.max_queue
        if len(choices) > capacity:
            raise ApiError(400, f"{len(choices)} choices in one request; this server holds at most {capacity} "
                           f"(--max-num-seqs + --max-queue)", "prompt")
        with self.lock:
            if not self.accepting:
                raise ApiError(503, "server is shutting down", kind="server_error")
            if len(self.queue) + self.running + len(choices) > capacity:
                raise ApiError(429, f"server full: {len(self.queue) + self.running} choices in flight, this "
                               f"request needs {len(choices)} more, the limit is {capacity} (--max-num-seqs "
                               f"{self.llm.max_num_seqs} + --max-queue {self.max_queue}); retry later",
                               kind="rate_limit_error")
            self.queue += choices
            self.lock.notify_all()

    def alive(self) -> bool:
        """Whether the loop thread runs (a replica's health check)."""
        return self.thread.is_alive()

    def queue_depth(self) -> int:
        """Choices waiting for a batch."""
        with self.lock:
            return len(self.queue)

    def num_running(self) -> int:
        return self.running

    async def is_healthy(self) -> bool:
        return self.alive() and self.accepting

    async def render_metrics(self, front: Metrics) -> str:
        metrics = front if front is self.metrics else front.merged([self.metrics])
        return metrics.render(self.queue_depth(), self.num_running(), (self.llm.budget, 0, 0), None, process_memory(self.llm.device))

    # -- the loop thread ------------------------------------------------------------------------
    def run(self) -> None:
        while True:
            with self.lock:
                self.lock.wait_for(lambda: self.queue or self.stopping)
                if self.stopping:
                    for c in self.queue:
                        c.job.emit(Event(error=ApiError(503, "server shut down before the request finished",
                                                        kind="server_error")))
                    self.queue = []
                    return
                batch = self.next_batch()
                self.running = len(batch)
            try:
                self.run_batch(batch)
            except Exception as e:  # a bug or an out-of-memory: this batch's requests fail, the loop goes on
                log.exception("canvas batch failed")
                error = ApiError(500, f"request failed: {type(e).__name__}: {e}", kind="server_error")
                for job in {id(c.job): c.job for c in batch}.values():
                    job.emit(Event(error=error))
            finally:
                with self.lock:
                    self.running = 0
                    self.lock.notify_all()

    def next_batch(self) -> list[Choice]:
        """The first queued choice's batch (``CanvasLLM.batches``: same settings, within
        ``max_num_seqs`` and the memory budget), taken off the queue (lock held)."""
        first = self.llm.batches([c.request for c in self.queue])[0]
        taken = {id(r) for r in first}
        batch = [c for c in self.queue if id(c.request) in taken]
        self.queue = [c for c in self.queue if id(c.request) not in taken]
        return batch

    def run_batch(self, batch: list[Choice]) -> None:
        start = time.perf_counter()
        streaming = any(c.job.stream or c.job.stops for c in batch)
        outputs = self.llm.run_batch([c.request for c in batch],
                                     on_canvas=(lambda row, ids: self.canvas_ended(batch[row], ids)) if streaming else None)
        self.metrics.observe_step(time.perf_counter() - start)
        for choice, out in zip(batch, outputs):
            if choice.job.cancelled:
                continue
            text, reason = out.text, out.finish_reason
            cut = find_stop(text, choice.job.stops)
            if cut is not None:
                text, reason = text[:cut], "stop"
            self.send(choice, text)
            stats = dataclasses.replace(out.stats, output_tokens=len(out.token_ids))
            steps = None if out.steps is None else [s.as_dict() for s in out.steps]
            result = ChoiceResult(choice.index, text, reason, len(out.prompt_token_ids), len(out.token_ids), stats,
                                  None, steps)
            self.metrics.observe_sequence(stats, len(out.prompt_token_ids))
            choice.job.emit(Event(choice.index, result=result))

    def canvas_ended(self, choice: Choice, argmax_ids: list[int]) -> None:
        """Stream what a choice's ended canvas adds: its text up to EOS, held back where a stop
        string could still begin."""
        if choice.done or choice.job.cancelled:
            return
        choice.ids += argmax_ids
        ids, stopped = self.llm.answer(choice.ids, choice.request.params)
        with self.tokenizer_lock:
            text = self.llm.tokenizer.decode(ids, skip_special_tokens=True) if self.llm.tokenizer else ""
        cut = find_stop(text, choice.job.stops)
        choice.done = stopped or cut is not None
        self.send(choice, text[:cut] if cut is not None else text if choice.done else held_back(text, choice.job.stops))

    def send(self, choice: Choice, text: str) -> None:
        """Stream the new part of ``text`` (a streamed choice only)."""
        if choice.job.stream and len(text) > len(choice.sent) and text.startswith(choice.sent):
            choice.job.emit(Event(choice.index, text[len(choice.sent):]))
            choice.sent = text
