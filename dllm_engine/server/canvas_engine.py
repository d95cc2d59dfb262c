"""The server's engine for a canvas model (DiffusionGemma; ``engine.canvas_llm``): an
``EngineClient`` whose one thread runs the queued choices through a ``CanvasGroup``, continuous
batching by denoising step: between two steps of the running rows, queued choices join (in arrival
order, while they share its settings, fit ``max_num_seqs`` and the memory budget; an older choice
of other settings stops the joining, so the group drains and that choice's group runs next),
finished ones leave with their answers, and the choices of clients that went away leave too.
Otherwise it serves as the other families' loop does: a request's choices are admitted whole or
refused (429 when the queue is full, 503 while shutting down), each choice samples with its own
seed, and a streamed choice gets its text canvas by canvas (as each of its canvases ends; a stop
string or EOS ends it)."""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import torch

from ..engine.canvas_llm import CanvasGroup, CanvasLLM, Request, group_key
from ..engine.parallel import WorkerDied
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
        self.queue: list[Choice] = []  # waiting to join (guarded by lock)
        self.group: CanvasGroup | None = None  # the running rows (the loop thread's)
        self.members: dict[int, Choice] = {}  # id(request) -> its choice, for the group's rows
        self.running = 0  # choices in the group (guarded by lock)
        self.group_bytes = 0  # what the group's sampler holds at its peak (``CanvasLLM.batch_bytes``)
        self.waiting_for_memory = 0  # queued choices the last join left waiting for the budget
        self.accepting, self.stopping = True, False
        self.failure: str | None = None  # a tensor-parallel rank died: this engine cannot run a group again
        self.tokenizer_lock = threading.Lock()  # the HTTP side encodes while this thread decodes
        self.thread = threading.Thread(target=self.run, name="dllm-canvas-loop", daemon=True)

    # -- asyncio side ---------------------------------------------------------------------------
    def start(self) -> None:
        self.thread.start()

    def shutdown(self, timeout: float) -> None:
        """Refuse new requests, let queued and running ones finish for up to ``timeout`` s, then
        end what is left with 503 (after the running canvas)."""
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
        """The job's queued choices leave the queue, its running ones the group before its next
        step; it is sent nothing more."""
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
                raise ApiError(503, self.failure or "server is shutting down", kind="server_error")
            if len(self.queue) + self.running + len(choices) > capacity:
                raise ApiError(429, f"server full: {len(self.queue) + self.running} choices in flight, this "
                               f"request needs {len(choices)} more, the limit is {capacity} (--max-num-seqs "
                               f"{self.llm.max_num_seqs} + --max-queue {self.max_queue}); retry later",
                               kind="rate_limit_error")
            self.queue += choices
            self.lock.notify_all()

    def alive(self) -> bool:
        """Whether the engine can still run a group (a replica's health check): its loop thread
        runs and no tensor-parallel rank has died."""
        return self.thread.is_alive() and self.failure is None

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
        return metrics.render(self.queue_depth(), self.num_running(), self.memory(), None,
                              process_memory(self.llm.device))

    def memory(self) -> tuple[int | None, int, int]:
        """As ``InProcessEngine.memory``: the budget, the running group's peak bytes, the choices
        waiting for the budget (as the last join between two steps left them)."""
        return self.llm.budget, self.group_bytes, self.waiting_for_memory

    # -- the loop thread ------------------------------------------------------------------------
    def run(self) -> None:
        while True:
            with self.lock:
                self.lock.wait_for(lambda: self.queue or self.group is not None or self.stopping)
                if self.stopping:
                    error = Event(error=ApiError(503, "server shut down before the request finished",
                                                 kind="server_error"))
                    for c in [*self.queue, *self.members.values()]:
                        c.job.emit(error)
                    self.queue, self.members, self.group = [], {}, None
                    return
                try:
                    self.join()
                    failure = None
                except Exception as e:  # a bug: the group's requests fail below, and the choice that was
                    failure = e        # joining, so the loop goes on without meeting it again
                    if self.queue:
                        self.queue.pop(0).job.emit(Event(error=ApiError(500, f"request failed: {type(e).__name__}: "
                                                                             f"{e}", kind="server_error")))
                self.running = len(self.members)
            start = time.perf_counter()
            try:
                if failure is not None:
                    raise failure
                finished = self.group.run_step()
                self.metrics.observe_step(time.perf_counter() - start)
                for request, out in finished:
                    self.finish(self.members.pop(id(request)), out)
            except Exception as e:  # a bug or an out-of-memory: the group's requests fail, the loop goes on
                self.group_failed(e)
                continue
            with self.lock:
                if not len(self.group):
                    self.group, self.group_bytes = None, 0
                self.running = 0 if self.group is None else len(self.group)
                self.lock.notify_all()

    def join(self) -> None:
        """Between two denoising steps (lock held): the choices of clients that went away leave the
        group; queued choices join it in arrival order (see the module docstring)."""
        gone = [c for c in self.members.values() if c.job.cancelled]
        if gone:
            self.group.leave([c.request for c in gone])
            for c in gone:
                del self.members[id(c.request)]
        if self.group is None or not len(self.group):
            self.group = CanvasGroup(self.llm, group_key(self.queue[0].request.params), self.canvas_ended_request) \
                if self.queue else self.group
        taken, self.waiting_for_memory = 0, 0
        for c in self.queue:
            if not self.group.fits(c.request):  # other settings, no room, or not in the budget: wait
                self.waiting_for_memory = len(self.queue) - taken if self.group.takes(c.request) else 0
                break
            self.group.add(c.request, stream=c.job.stream or bool(c.job.stops))
            self.members[id(c.request)] = c
            taken += 1
        self.queue = self.queue[taken:]
        members = [c.request for c in self.members.values()]
        self.group_bytes = self.llm.batch_bytes(members) if members else 0
        if self.queue and not len(self.group):  # it cannot run alone: the budget fell below it (an out-of-memory)
            c = self.queue.pop(0)
            c.job.emit(Event(error=ApiError(500, f"request failed: out of device memory; it needs "
                                                 f"{self.llm.batch_bytes([c.request]) / 2**20:.1f} MiB, the budget is now "
                                                 f"{self.llm.budget / 2**20:.1f} MiB", kind="server_error")))

    def group_failed(self, error: Exception) -> None:
        """The running group ends. Out of device memory, later groups are held below the bytes
        this one needed, and with more than one row its choices that have sent nothing yet queue
        again at the front (they start over in smaller groups: nothing is lost); every other
        choice gets the error. A dead tensor-parallel rank ends the engine (``fail``)."""
        if isinstance(error, WorkerDied):
            return self.fail(error)
        members = list(self.members.values())
        oom = isinstance(error, torch.OutOfMemoryError)
        if oom:
            limit = self.llm.lower_budget([c.request for c in members])
            log.warning("out of device memory in a group of %d rows: groups below %.1f MiB from now on",
                        len(members), limit / 2**20)
        else:
            log.exception("canvas group failed")
        again = [c for c in members if oom and len(members) > 1 and not c.sent and not c.ids]
        event = Event(error=ApiError(500, f"request failed: {type(error).__name__}: {error}", kind="server_error"))
        for job in {id(c.job): c.job for c in members if not any(c is a for a in again)}.values():
            job.emit(event)
        with self.lock:
            self.queue = [*again, *self.queue]
            self.members, self.group, self.running, self.group_bytes = {}, None, 0, 0
            self.lock.notify_all()

    def fail(self, error: Exception) -> None:
        """As the step loop's ``EngineLoop.fail``: the engine cannot run a group again, so it
        refuses new requests and ends the running and queued ones with 503; ``/health`` and the
        replica's health check fail."""
        log.error("engine unavailable: %s", error)
        with self.lock:
            self.accepting = False
            self.failure = f"engine unavailable: {error}"
            ended = [*self.members.values(), *self.queue]
            self.queue, self.members, self.group, self.running, self.group_bytes = [], {}, None, 0, 0
            self.lock.notify_all()
        event = Event(error=ApiError(503, self.failure, kind="server_error"))
        for job in {id(c.job): c.job for c in ended}.values():
            job.emit(event)

    def finish(self, choice: Choice, out) -> None:
        """A finished choice's answer: the rest of its text (streamed) and its result."""
        if choice.job.cancelled:
            return
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

    def canvas_ended_request(self, request: Request, argmax_ids: list[int]) -> None:
        choice = self.members.get(id(request))
        if choice is not None:
            self.canvas_ended(choice, argmax_ids)

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
