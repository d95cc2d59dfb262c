"""``dllm serve --replicas N``: data-parallel serving on Ray Serve (one node or a Ray cluster).

Two deployments make one Ray Serve application:

- ``engine``: N replicas (a fixed number, or Ray Serve autoscaling between a min and a max),
  each a process holding one ``LLM`` and its continuous-batching loop (``InProcessEngine``; a
  DiffusionGemma checkpoint's replica runs its own batch loop, ``canvas_engine.CanvasEngine``).
  Ray Serve routes requests to them (power of two choices on their ongoing requests), caps
  each at ``--max-num-seqs`` ongoing requests, queues the rest at the caller up to
  ``--max-queue`` (beyond that: 429), health-checks them and restarts a dead one.
- ``front``: the same FastAPI app as the single-process server (``create_app``), on an
  ``LLM`` built on the meta device (tokenizer, config, validation: no weights), talking to the
  replicas through ``RayServeEngine``. Bad input is refused here, before a replica is chosen.

Replicas push their metrics to a small actor (``MetricsBoard``) twice a second; ``/metrics``
sums them with the front's own and adds per-replica figures and Ray Serve's view of the
replicas. Nothing here routes or balances: Ray Serve does."""
from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field

import ray
import torch
from ray import serve
from ray.exceptions import ActorUnavailableError, RayActorError
from ray.serve.exceptions import BackPressureError
from ray.serve.handle import DeploymentHandle

from ..errors import UserError
from ..engine.llm import LLM
from ..sampling_params import SamplingParams
from .app import create_app
from .limits import DEFAULT_MAX_REQUEST_BYTES
from .engine_client import GenerateRequest, local_engine
from .loop import Event
from .metrics import Metrics
from .protocol import ApiError

log = logging.getLogger("dllm_engine.server")

APP_NAME = "dllm"
REPORT_S = 0.5  # how often a replica pushes its metrics
STALE_S = 10.0  # a replica silent for this long is reported down
REPLICA_LOST = (RayActorError, ActorUnavailableError)  # the replica's process died or is unreachable
RETRIES = 1  # a request nothing was sent for yet is re-sent this many times after its replica died
FRONT_MAX_ONGOING = 100_000  # the front only waits on replicas: no reason to cap it
# Ray runs its workers at nice 15, below its own daemons; the front and the replicas are the
# service itself, so they run at normal priority, as the single-process server does
NORMAL_PRIORITY = {"runtime_env": {"env_vars": {"RAY_worker_niceness": "0"}}}


@dataclass
class ReplicaOptions:
    """What each replica process loads and how it runs."""
    model: str
    dtype: str = "auto"
    device: str = "cpu"
    max_num_seqs: int = 256
    max_queue: int = 256
    threads: int = 1  # torch CPU threads per replica
    shutdown_timeout: float = 30.0
    keep_freed_memory: bool = True  # CPU allocator tuning of the replica process (--no-keep-freed-memory)
    compile: bool = False  # --compile, --fixed-shapes, --compile-step: as LLM's options
    fixed_shapes: bool = False
    compile_step: bool = False
    revision: str | None = None  # of a Hugging Face id: each replica resolves it in its own cache
    seed: int | None = None  # the front's stream of request seeds (--seed; None: fresh per request)
    quantization: str | None = None  # --quantization: each replica quantizes its own copy on load
    prefix_cache: bool = True  # --no-prefix-cache: each replica has its own prefix store otherwise
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES  # the front's body limit (--max-request-bytes)
    # --tensor-parallel-size: each replica is rank 0 of its own group, its other ranks processes
    # it spawns on its node (``engine/parallel.py``)
    tensor_parallel_size: int = 1
    # --kv-cache-memory, --gpu-memory-utilization: each replica's own budget (a replica is a
    # process with its own pools, on its own GPUs on CUDA), as LLM's options
    kv_cache_memory: int | None = None
    gpu_memory_utilization: float = 0.9

    def __post_init__(self) -> None:
        if self.threads < 1:
            raise UserError(f"threads per replica must be >= 1, got {self.threads}")

    def actor_options(self) -> dict:
        """Ray resources of one replica: a GPU per rank on CUDA, else ``threads`` CPUs per rank
        (Ray reserves them all for the replica's actor; its ranks run in processes it starts)."""
        ranks = self.tensor_parallel_size
        if torch.device(self.device).type == "cuda":
            return {"num_cpus": 1, "num_gpus": ranks} | NORMAL_PRIORITY
        return {"num_cpus": self.threads * ranks} | NORMAL_PRIORITY


@dataclass
class Scaling:
    """``replicas`` fixed replicas, or (``replicas=None``, ``--replicas auto``) Ray Serve
    autoscaling between ``min_replicas`` and ``max_replicas`` aiming at
    ``target_ongoing_requests`` per replica."""
    replicas: int | None = 1
    min_replicas: int = 1
    max_replicas: int = 4
    target_ongoing_requests: float = 16.0

    def __post_init__(self) -> None:
        if self.replicas is not None and self.replicas < 1:
            raise UserError(f"--replicas must be >= 1 or 'auto', got {self.replicas}")
        if not 0 <= self.min_replicas <= self.max_replicas or self.max_replicas < 1:
            raise UserError(f"need 0 <= --min-replicas ({self.min_replicas}) <= --max-replicas "
                            f"({self.max_replicas}) and --max-replicas >= 1")
        if self.target_ongoing_requests <= 0:
            raise UserError(f"--target-ongoing-requests must be > 0, got {self.target_ongoing_requests}")

    @property
    def most(self) -> int:
        return self.replicas or self.max_replicas

    def deployment_options(self, replica: ReplicaOptions) -> dict:
        """``serve.deployment`` options of the engine deployment."""
        opts = dict(ray_actor_options=replica.actor_options(), max_ongoing_requests=replica.max_num_seqs,
                    max_queued_requests=max(1, replica.max_queue),
                    graceful_shutdown_timeout_s=replica.shutdown_timeout)
        if self.replicas is not None:
            return opts | {"num_replicas": self.replicas}
        return opts | {"num_replicas": "auto", "autoscaling_config": {
            "min_replicas": self.min_replicas, "max_replicas": self.max_replicas,
            "target_ongoing_requests": self.target_ongoing_requests}}


@dataclass
class ReplicaReport:
    """One replica's state, as it last pushed it."""
    replica: str
    pid: int
    metrics: Metrics
    queue_depth: int
    running: int
    ongoing: int  # requests in its hands (what Ray Serve routes on)
    # (its memory budget in bytes or None, bytes its KV pools hold, sequences waiting for memory)
    memory: tuple[int | None, int, int] = (None, 0, 0)
    time: float = field(default_factory=time.time)


class MetricsBoard:
    """Each replica's latest report (a Ray actor: replicas push, the front reads)."""

    def __init__(self) -> None:
        self.latest: dict[str, ReplicaReport] = {}

    def put(self, report: ReplicaReport) -> None:
        self.latest[report.replica] = report

    def reports(self) -> list[ReplicaReport]:
        return list(self.latest.values())


class EngineReplica:
    """One replica: an LLM and its engine loop in this process."""

    async def __init__(self, options: ReplicaOptions, board) -> None:
        if torch.device(options.device).type == "cpu":
            torch.set_num_threads(options.threads)
        self.board = board
        self.llm = LLM(options.model, dtype=options.dtype, device=options.device,
                       max_num_seqs=options.max_num_seqs, keep_freed_memory=options.keep_freed_memory,
                       compile=options.compile, fixed_shapes=options.fixed_shapes,
                       compile_step=options.compile_step, revision=options.revision,
                       quantization=options.quantization, prefix_cache=options.prefix_cache,
                       tensor_parallel_size=options.tensor_parallel_size,
                       kv_cache_memory=options.kv_cache_memory,
                       gpu_memory_utilization=options.gpu_memory_utilization)
        self.metrics = Metrics()
        self.engine = local_engine(self.llm, options.max_queue, self.metrics)  # a canvas model: its own loop
        self.engine.start()
        self.replica = serve.get_replica_context().replica_tag
        self.ongoing = 0
        self.reporter = asyncio.create_task(self.report_forever())

    async def generate(self, request: GenerateRequest) -> AsyncIterator[Event]:
        """The request's events; Ray Serve cancelling the call cancels the request."""
        self.ongoing += 1
        try:
            async for event in self.engine.generate(request):
                yield event
        finally:
            self.ongoing -= 1

    def check_health(self) -> None:
        """Ray Serve's health check: a replica whose engine thread died, or one of whose
        tensor-parallel ranks died, is restarted."""
        if not self.engine.alive():
            raise RuntimeError(f"replica {self.replica}: its engine loop has stopped or a tensor-parallel "
                               "rank has died")

    def report(self) -> ReplicaReport:
        return ReplicaReport(self.replica, os.getpid(), self.metrics.merged([]), self.engine.queue_depth(),
                             self.engine.num_running(), self.ongoing, self.engine.memory())

    async def report_forever(self) -> None:
        while True:
            try:
                await self.board.put.remote(self.report())
            except REPLICA_LOST:  # the board is gone: the server is shutting down
                return
            await asyncio.sleep(REPORT_S)

    def __del__(self) -> None:
        """After Ray Serve has drained this replica (``graceful_shutdown_timeout_s``)."""
        self.reporter.cancel()
        self.engine.shutdown(timeout=1.0)


class RayServeEngine:
    """The front's ``EngineClient``: every request goes to the ``engine`` deployment."""

    def __init__(self, handle: DeploymentHandle, board, app_name: str) -> None:
        self.handle = handle.options(stream=True)
        self.deployment = handle.deployment_name
        self.board, self.app_name = board, app_name
        self.tokenizer_lock = threading.Lock()  # the front's tokenizer: used by the event loop only
        self.routing = 0  # requests sent to Ray Serve and not yet taken by a replica
        self.retried = 0  # requests sent again because their replica died

    def start(self) -> None:
        pass  # the replicas run already

    def shutdown(self, timeout: float) -> None:
        pass  # Ray Serve drains each replica for graceful_shutdown_timeout_s, then stops it

    async def generate(self, request: GenerateRequest) -> AsyncIterator[Event]:
        """Sends the request to a replica; if that replica dies before the request produced
        anything, sends it again (``RETRIES`` times), else ends it with a 502."""
        admitted = progressed = False
        for attempt in range(RETRIES + 1):
            try:
                async with aclosing(self.attempt(request)) as events:
                    async for event in events:
                        if event.accepted and admitted:
                            continue  # a retry's admission: the app has had one
                        admitted |= event.accepted
                        progressed |= not event.accepted
                        yield event
                return
            except REPLICA_LOST as e:
                if progressed or attempt == RETRIES:
                    yield Event(error=ApiError(502, f"the replica serving this request died "
                                               f"({type(e).__name__}); retry", kind="server_error"))
                    return
                log.warning("request %s: its replica died before answering; sending it again",
                            request.request_id)
                self.retried += 1

    async def attempt(self, request: GenerateRequest) -> AsyncIterator[Event]:
        """One call to a replica (raises REPLICA_LOST if it dies); closing it cancels the call."""
        response, waiting, refused = None, True, None
        self.routing += 1
        try:
            response = self.handle.generate.remote(request)
            async for event in response:
                if waiting:  # a replica has taken it
                    self.routing, waiting = self.routing - 1, False
                yield event
        except BackPressureError as e:
            refused = ApiError(429, f"every replica is busy and the queue is full ({e}); retry later",
                               kind="rate_limit_error")
        finally:
            self.routing -= waiting
            if response is not None and refused is None:
                response.cancel()  # no-op when it finished; else the replica drops the request
        if refused is not None:  # (cancelling a refused call would raise its error again)
            yield Event(error=refused)

    async def is_healthy(self) -> bool:
        return (await self.replica_states()).get("RUNNING", 0) > 0

    async def replica_states(self) -> dict[str, int]:
        """Ray Serve's count of the engine deployment's replicas by state."""
        status = await asyncio.to_thread(serve.status)
        app = status.applications.get(self.app_name)
        deployment = app.deployments.get(self.deployment) if app else None
        return dict(deployment.replica_states) if deployment else {}

    async def render_metrics(self, front: Metrics) -> str:
        reports = await self.board.reports.remote()
        fresh = [r for r in reports if time.time() - r.time < STALE_S]
        text = front.merged([r.metrics for r in reports]).render(
            sum(r.queue_depth for r in fresh), sum(r.running for r in fresh), summed_memory(fresh))
        lines = replica_lines(reports, fresh) + self.routing_lines(await self.replica_states())
        return text + "\n".join(lines) + "\n"

    def routing_lines(self, states: dict[str, int]) -> list[str]:
        """Ray Serve's view of the engine deployment, and what this front sent it."""
        return [*Metrics.family("serve_replicas", "gauge", "Ray Serve's engine replicas by state.",
                                [f'dllm_serve_replicas{{state="{s}"}} {n}' for s, n in sorted(states.items())]),
                *Metrics.family("router_queued_requests", "gauge",
                                "Requests waiting in Ray Serve for a replica (up to --max-queue).",
                                [f"dllm_router_queued_requests {self.routing}"]),
                *Metrics.family("router_retried_requests_total", "counter",
                                "Requests sent again because their replica died before answering.",
                                [f"dllm_router_retried_requests_total {self.retried}"])]


def summed_memory(reports: list[ReplicaReport]) -> tuple[int | None, int, int]:
    """The replicas' memory figures summed: the budget is None when no replica has one."""
    budgets = [r.memory[0] for r in reports if r.memory[0] is not None]
    return (sum(budgets) if budgets else None, sum(r.memory[1] for r in reports),
            sum(r.memory[2] for r in reports))


def replica_lines(reports: list[ReplicaReport], fresh: list[ReplicaReport]) -> list[str]:
    """Per-replica figures (label ``replica``)."""
    up = {r.replica for r in fresh}
    lines = []
    for name, kind, doc, value in [
            ("replica_up", "gauge", "1 if the replica reported in the last seconds.",
             lambda r: int(r.replica in up)),
            ("replica_ongoing_requests", "gauge", "Requests the replica holds (Ray Serve routes on this).",
             lambda r: r.ongoing),
            ("replica_running_sequences", "gauge", "Sequences in the replica's running batch.",
             lambda r: r.running),
            ("replica_queue_depth", "gauge", "Sequences waiting for a slot in the replica.",
             lambda r: r.queue_depth),
            ("replica_kv_cache_memory_budget_bytes", "gauge",
             "The replica's memory budget for KV pools and step temporaries (-1: none).",
             lambda r: -1 if r.memory[0] is None else r.memory[0]),
            ("replica_kv_cache_bytes", "gauge", "Bytes the replica's KV pools hold.", lambda r: r.memory[1]),
            ("replica_waiting_for_memory", "gauge", "Sequences waiting in the replica because its budget is full.",
             lambda r: r.memory[2]),
            ("replica_output_tokens_total", "counter", "Tokens the replica returned to users.",
             lambda r: r.metrics.totals.output_tokens),
            ("replica_engine_steps_total", "counter", "Engine steps of the replica.", lambda r: r.metrics.steps)]:
        lines += Metrics.family(name, kind, doc, [f'dllm_{name}{{replica="{r.replica}"}} {value(r)}'
                                                  for r in reports])
    return lines


@serve.ingress()
class Front:
    """The HTTP app (``create_app``) in a Ray Serve replica, on ``RayServeEngine``."""

    def __init__(self, engine: DeploymentHandle, board, model: str, dtype: str,
                 defaults: SamplingParams, model_name: str | None, revision: str | None = None,
                 seed: int | None = None, max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES) -> None:
        self.engine, self.board = engine, board
        self.max_request_bytes = max_request_bytes
        self.model, self.dtype, self.defaults, self.model_name = model, dtype, defaults, model_name
        self.revision, self.seed = revision, seed

    def __serve_build_asgi_app__(self):
        # tokenizer, checks and the seeds of requests without one; no weights
        llm = LLM(self.model, dtype=self.dtype, device="meta", revision=self.revision, seed=self.seed)
        client = RayServeEngine(self.engine, self.board, serve.get_replica_context().app_name)
        return create_app(llm, self.defaults, self.model_name, engine=client,
                          max_request_bytes=self.max_request_bytes)


def build_app(replica: ReplicaOptions, scaling: Scaling, defaults: SamplingParams,
              model_name: str | None, board) -> serve.Application:
    """The Ray Serve application: ``front`` (one replica, no CPU reserved) over ``engine``."""
    engine = serve.deployment(EngineReplica, name="engine",
                              **scaling.deployment_options(replica)).bind(replica, board)
    front = serve.deployment(Front, name="front", num_replicas=1, max_ongoing_requests=FRONT_MAX_ONGOING,
                             ray_actor_options={"num_cpus": 0} | NORMAL_PRIORITY)
    return front.bind(engine, board, replica.model, replica.dtype, defaults, model_name, replica.revision,
                      replica.seed, replica.max_request_bytes)


def deploy(replica: ReplicaOptions, scaling: Scaling, defaults: SamplingParams,
           model_name: str | None = None, host: str = "127.0.0.1", port: int = 8000,
           app_name: str = APP_NAME):
    """Start Ray Serve's HTTP proxy on ``host:port`` and run the application on the connected
    Ray cluster; returns the metrics board (its owner must outlive the application)."""
    board = ray.remote(num_cpus=0)(MetricsBoard).remote()
    serve.start(http_options={"host": host, "port": port})
    serve.run(build_app(replica, scaling, defaults, model_name, board), name=app_name, route_prefix="/")
    return board


def run_replicated(replica: ReplicaOptions, scaling: Scaling, defaults: SamplingParams,
                   model_name: str | None, host: str, port: int, ray_address: str | None) -> None:
    """``dllm serve --replicas``: serve until SIGINT / SIGTERM. Without ``ray_address`` a local
    Ray instance is started (with enough CPUs for the replicas) and stopped with the server."""
    local = ray_address is None
    if local:  # the instance only serves: its HTTP proxy and controller get normal priority too
        os.environ.update(NORMAL_PRIORITY["runtime_env"]["env_vars"])
        ray.init(num_cpus=max(os.cpu_count() or 1, scaling.most * replica.actor_options()["num_cpus"]),
                 include_dashboard=False)
    else:
        ray.init(address=ray_address)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        deploy(replica, scaling, defaults, model_name, host, port)
        print(f"serving {replica.model} at http://{host}:{port}/v1 on Ray Serve "
              f"({scaling.replicas or 'auto'} replicas); Ctrl-C stops", flush=True)
        stop.wait()
    finally:
        serve.delete(APP_NAME)  # drains the replicas (--shutdown-timeout)
        if local:
            serve.shutdown()
            ray.shutdown()
