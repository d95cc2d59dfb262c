"""The seam between the HTTP app and the engine behind it.

The app validates a request (tokenizing, checking its options against the model) and hands an
``EngineClient`` a ``GenerateRequest``; the client answers with a stream of ``Event``s. Two
clients exist: ``InProcessEngine`` (the engine loop in this process: ``dllm serve``) and
``server.replicated.RayServeEngine`` (Ray Serve replicas, each an ``InProcessEngine``:
``dllm serve --replicas N``). Everything the app does — routes, validation, SSE, errors,
cancellation — is the same code for both."""
from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Protocol

from ..engine.llm import LLM
from ..errors import UserError
from ..sampling_params import SamplingParams
from ..seeds import choice_seeds
from .loop import EngineLoop, Event, Job
from .metrics import Metrics, process_memory
from .protocol import ApiError, value_error


@dataclass
class GenerateRequest:
    """A validated request, as the engine needs it (picklable: it may cross processes)."""
    request_id: str
    prompts: list[list[int]]
    params: SamplingParams
    stops: list[str]
    stream: bool
    n: int = 1  # choices per prompt

    @property
    def num_choices(self) -> int:
        return len(self.prompts) * self.n

    def choices(self) -> list[tuple[list[int], SamplingParams]]:
        """(prompt, options) per choice, prompt-major, so OpenAI's choice index is the place in
        this list; choice j of a prompt samples with seed + j."""
        return [(ids, self.params.replace(seed=seed))
                for ids in self.prompts for seed in choice_seeds(self.params.seed, self.n)]


class EngineClient(Protocol):
    """What the HTTP app needs from the engine it serves."""

    tokenizer_lock: threading.Lock  # held while the app's tokenizer encodes

    def start(self) -> None: ...

    def shutdown(self, timeout: float) -> None:
        """Refuse new requests, let in-flight ones finish for up to ``timeout`` s, cancel the rest."""

    def generate(self, request: GenerateRequest) -> AsyncIterator[Event]:
        """The request's events: first ``accepted`` or an error (429 / 503 / 400), then text and
        one result per prompt. An error event ends the stream; closing it early cancels the request."""

    async def is_healthy(self) -> bool: ...

    async def render_metrics(self, front: Metrics) -> str:
        """Prometheus text: the app's own ``front`` metrics with the engine's."""


async def relay(submit: Callable[[], tuple[asyncio.Queue, int]], cancel: Callable[[], None]) -> AsyncIterator[Event]:
    """One request's events, as ``EngineClient.generate`` gives them: ``submit()`` queues it and
    returns its event queue and its number of choices (a ``UserError`` or ``ApiError`` it raises
    is the request's one event); then ``accepted``, and its events up to the last choice's result
    or an error (which ends it: the engine has dropped the request already); ``cancel()`` when
    the stream is closed before that."""
    try:
        events, pending = submit()
    except UserError as e:
        yield Event(error=value_error(e))
        return
    except ApiError as e:
        yield Event(error=e)
        return
    try:
        yield Event(accepted=True)
        while pending:
            event = await events.get()
            pending = 0 if event.error is not None else pending - (event.result is not None)
            yield event
    finally:
        if pending:
            cancel()


class InProcessEngine:
    """The engine loop of ``llm``, driven by a thread of this process."""

    def __init__(self, llm: LLM, max_queue: int = 256, metrics: Metrics | None = None) -> None:
        self.llm = llm
        self.loop = EngineLoop(llm, max_queue=max_queue, metrics=metrics)
        self.tokenizer_lock = self.loop.tokenizer_lock

    def start(self) -> None:
        self.loop.start()

    def shutdown(self, timeout: float) -> None:
        self.loop.shutdown(timeout)

    def generate(self, request: GenerateRequest) -> AsyncIterator[Event]:
        job: Job | None = None

        def submit() -> tuple[asyncio.Queue, int]:
            nonlocal job
            job = Job([self.llm.make_sequence(ids, params) for ids, params in request.choices()],
                      request.stops, request.stream)
            self.loop.submit(job)
            return job.events, len(job.seqs)

        return relay(submit, lambda: self.loop.cancel(job))

    def alive(self) -> bool:
        """Whether the engine can still step (a replica's health check): its loop thread runs
        and no tensor-parallel rank has died (``EngineLoop.fail``)."""
        return self.loop.thread.is_alive() and self.loop.failure is None

    def queue_depth(self) -> int:
        return self.loop.queue_depth()

    def num_running(self) -> int:
        return self.loop.num_running()

    async def is_healthy(self) -> bool:
        return self.alive() and self.loop.accepting

    async def render_metrics(self, front: Metrics) -> str:
        # the loop records into ``front`` itself when the app made it share one Metrics
        metrics = front if front is self.loop.metrics else front.merged([self.loop.metrics])
        store = self.llm.engine.prefix_store
        return metrics.render(self.loop.queue_depth(), self.loop.num_running(), self.memory(),
                              None if store is None else (store.nbytes, store.hit_rate),
                              process_memory(self.llm.device))

    def memory(self) -> tuple[int | None, int, int]:
        """(the memory budget in bytes or None, bytes the KV pools hold, sequences waiting for memory)."""
        engine = self.llm.engine
        return engine.memory_budget, engine.cache_bytes, engine.waiting_for_memory


def local_engine(llm, max_queue: int = 256, metrics: Metrics | None = None):
    """The engine that runs ``llm`` in this process: its step loop (``InProcessEngine``), or a
    canvas model's own loop (``canvas_engine.CanvasEngine``, DiffusionGemma)."""
    from ..engine.canvas_llm import CanvasLLM
    if isinstance(llm, CanvasLLM):
        from .canvas_engine import CanvasEngine
        return CanvasEngine(llm, max_queue, metrics)
    return InProcessEngine(llm, max_queue, metrics)
