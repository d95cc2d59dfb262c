"""``dllm serve --replicas``: two Ray Serve replicas of tiny-llada (one thread each, fixed-shape
steps) behind the same HTTP app as the single-process server, on ONE local Ray cluster started
for this module.

Every wait is bounded (client timeouts, deadlines on polls)."""
import asyncio
import contextlib
import os
import random
import re
import signal
import socket
import time

# Ray Serve marks its HTTP proxy unhealthy after three 5 s readiness checks; on 2 cores shared
# with the other test worker (a process group's ranks, a compile) its start-up can take longer.
# The cluster's processes inherit this from the driver.
os.environ.setdefault("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "30")

import httpx
import pytest
from fastapi.testclient import TestClient

ray = pytest.importorskip("ray", reason="the Ray Serve tests need the distributed extra: "
                                        "pip install -e '.[distributed]' (make venv installs it)")
from ray import serve  # noqa: E402

from dllm_engine import LLM, SamplingParams  # noqa: E402
from dllm_engine.cli import main  # noqa: E402
from dllm_engine.cli.common import CHECKPOINTS  # noqa: E402
from dllm_engine.server import create_app  # noqa: E402
from dllm_engine.server.replicated import ReplicaOptions, Scaling, deploy  # noqa: E402
from dllm_lab.tasks import load_split  # noqa: E402

pytestmark = pytest.mark.slow  # Ray Serve replicas

MODEL = CHECKPOINTS / "tiny-llada"
DEFAULTS = SamplingParams(method="dual-cache", threshold=0.9, max_new_tokens=32, block_length=8)
# per replica / queued at the front: 2 * 8 + 40 requests at once. Ray Serve may refuse a burst
# before its queue is quite full (it counts a request as queued until a replica takes it), so
# the queue holds more than the 32 concurrent requests of the first test.
MAX_NUM_SEQS, MAX_QUEUE = 8, 40
PROMPTS = [e.prompt for e in load_split(limit=6)][:32]
# ~950 one-token steps over a ~970-token canvas: far longer than any test waits
LONG = {"prompt": "sort : c b a", "max_tokens": 960, "block_length": 960, "method": "reference",
        "threshold": None}
TIMEOUT = 120  # seconds: no request of this module may take longer


def free_port_below_ephemeral() -> int:
    """A free port on 127.0.0.1 between Ray's worker ports (10002-19999) and the kernel's
    ephemeral range: Ray's GCS, raylet and Serve actors bind many ports with port 0 while the
    application starts, and one of them took a port drawn from that range before the HTTP proxy
    bound it ("Failed to bind to address")."""
    try:
        ephemeral = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral = 32768
    ports = range(20000, ephemeral)
    for port in random.sample(ports, min(200, len(ports))):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port between 20000 and {ephemeral}")


@contextlib.contextmanager
def local_cluster(replica: ReplicaOptions, scaling: Scaling):
    """A local Ray instance of 2 CPUs running the application; yields (base URL, metrics
    board), and shuts both down after."""
    port = free_port_below_ephemeral()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        board = deploy(replica, scaling, DEFAULTS, port=port)
        yield f"http://127.0.0.1:{port}", board
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="module")
def cluster():
    """One local Ray instance and the application; yields (base URL, metrics board)."""
    # the replicas run fixed-shape steps (``--fixed-shapes`` reaches them); the offline
    # engine they are compared with runs dynamic ones: the tokens must still be the same
    replica = ReplicaOptions(str(MODEL), max_num_seqs=MAX_NUM_SEQS, max_queue=MAX_QUEUE, threads=1,
                             shutdown_timeout=5, fixed_shapes=True)
    with local_cluster(replica, Scaling(replicas=2)) as running:
        yield running


@pytest.fixture(scope="module")
def url(cluster):
    return cluster[0]


@pytest.fixture(scope="module")
def offline():
    return LLM(MODEL)


def metrics(url: str) -> dict[str, float]:
    """``/metrics`` as {sample name with labels: value}."""
    text = httpx.get(url + "/metrics", timeout=30).text
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"^(dllm_\S+) (\S+)$", text, re.M)}


def wait_until(check, what: str, timeout: float = 60):
    """Poll ``check()`` until it returns something truthy; fail after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while not (found := check()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)
    return found


def replica_values(url: str, name: str) -> dict[str, float]:
    pattern = re.compile(rf'dllm_{name}\{{replica="(\w+)"\}}')
    return {m.group(1): v for k, v in metrics(url).items() if (m := pattern.fullmatch(k))}


async def ask(c: httpx.AsyncClient, i: int, prompt: str) -> tuple[str, str]:
    """Request ``i``: chat or completion, streamed or not by its index; returns (id, text)."""
    chat, stream = i % 2 == 0, i % 4 < 2
    body = {"max_tokens": 8 * (1 + i % 4), "stream": stream}
    body |= {"messages": [{"role": "user", "content": prompt}]} if chat else {"prompt": prompt}
    path = "/v1/chat/completions" if chat else "/v1/completions"
    if not stream:
        r = await c.post(path, json=body)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        return r.json()["id"], choice["message"]["content"] if chat else choice["text"]
    rid, text = None, []
    async with c.stream("POST", path, json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                chunk = httpx.Response(200, content=line[6:]).json()
                assert "error" not in chunk, chunk
                rid = chunk["id"]
                for choice in chunk["choices"]:
                    text.append(choice["delta"].get("content") or "" if chat else choice["text"])
    return rid, "".join(text)


def expected(offline: LLM, i: int, prompt: str) -> str:
    params = DEFAULTS.replace(max_new_tokens=8 * (1 + i % 4))
    if i % 2 == 0:
        return offline.chat([[{"role": "user", "content": prompt}]], params)[0].text
    return offline.generate([prompt], params)[0].text


def test_32_concurrent_requests_match_offline_and_both_replicas_serve(url, offline):
    async def run_all():
        async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as c:
            return await asyncio.gather(*(ask(c, i, p) for i, p in enumerate(PROMPTS)))

    before = wait_until(lambda: len(v := replica_values(url, "replica_output_tokens_total")) == 2 and v,
                        "both replicas to report")
    answers = asyncio.run(run_all())
    assert len(answers) == 32
    for i, (prompt, (_, text)) in enumerate(zip(PROMPTS, answers)):
        assert text == expected(offline, i, prompt), (i, prompt)
    assert len({rid for rid, _ in answers}) == 32  # request ids are unique across replicas
    wait_until(lambda: all(v > before[r] for r, v in replica_values(url, "replica_output_tokens_total").items()),
               "both replicas to have served some")


def test_metrics_sum_the_replicas_and_show_ray_serve(url):
    m = metrics(url)
    ok = m['dllm_requests_total{status="200"}']
    r = httpx.post(url + "/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 16}, timeout=TIMEOUT)
    assert r.status_code == 200
    tokens = m["dllm_output_tokens_total"] + r.json()["usage"]["completion_tokens"]
    m = wait_until(lambda: (m := metrics(url))["dllm_output_tokens_total"] == tokens and m,
                   "the replicas to report the request")
    assert m['dllm_requests_total{status="200"}'] == ok + 1
    per_replica = replica_values(url, "replica_output_tokens_total")
    assert sum(per_replica.values()) == tokens and len(per_replica) == 2
    assert m['dllm_serve_replicas{state="RUNNING"}'] == 2
    assert sum(replica_values(url, "replica_up").values()) == 2
    assert httpx.get(url + "/health", timeout=30).json() == {"status": "ok"}
    assert httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"] == "tiny-llada"


BAD = [
    ("/v1/completions", {"prompt": "sort : b a", "bogus": 1}),
    ("/v1/completions", {"prompt": "sort : b a", "threshold": 2}),
    ("/v1/completions", {"prompt": "sort : b a", "method": "block"}),
    ("/v1/completions", {"prompt": "sort : b a", "method": "dual-cache+warp"}),
    ("/v1/completions", {"prompt": "sort : b a", "seed": -1}),  # (max_tokens 12 is fine: whole blocks)
    ("/v1/completions", {"prompt": "sort : b a", "max_tokens": 1024}),
    ("/v1/completions", {"prompt": [999]}),
    ("/v1/completions", {"prompt": []}),
    ("/v1/completions", {"prompt": "sort : b a", "model": "gpt-4"}),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}),
    ("/v1/chat/completions", {"messages": [], "stream": True}),
]


@pytest.mark.parametrize("path,body", BAD)
def test_bad_inputs_answer_what_the_single_process_server_answers(url, offline, path, body):
    with TestClient(create_app(offline, DEFAULTS)) as single:
        want = single.post(path, json=body)
    got = httpx.post(url + path, json=body, timeout=30)
    assert want.status_code in (400, 404)
    assert (got.status_code, got.json()) == (want.status_code, want.json())


def test_a_full_deployment_answers_429_and_frees_its_slots_when_clients_leave(url, offline):
    """2 replicas x 8 running + 40 waiting in Ray Serve's queue: the next request is refused."""
    async def scenario():
        async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT,
                                     limits=httpx.Limits(max_connections=80)) as c:
            running = [asyncio.create_task(c.post("/v1/completions", json=LONG))
                       for _ in range(2 * MAX_NUM_SEQS)]
            await wait_async(lambda m: m["dllm_running_sequences"] == 2 * MAX_NUM_SEQS, c)
            queued = [asyncio.create_task(c.post("/v1/completions", json=LONG)) for _ in range(MAX_QUEUE)]
            await wait_async(lambda m: m["dllm_router_queued_requests"] == MAX_QUEUE, c)
            r = await c.post("/v1/completions", json={"prompt": "sort : b a", "max_tokens": 8})
            assert r.status_code == 429, r.text
            assert r.json()["error"]["type"] == "rate_limit_error"
            for task in running + queued:
                task.cancel()
            await asyncio.gather(*running, *queued, return_exceptions=True)
            await wait_async(lambda m: m["dllm_running_sequences"] == 0
                             and m["dllm_router_queued_requests"] == 0, c)
            return await c.post("/v1/completions", json={"prompt": PROMPTS[2], "max_tokens": 16})

    r = asyncio.run(scenario())
    assert r.json()["choices"][0]["text"] == offline.generate([PROMPTS[2]], DEFAULTS.replace(max_new_tokens=16))[0].text


async def wait_async(check, c: httpx.AsyncClient, timeout: float = 60) -> dict[str, float]:
    """Poll ``/metrics`` until ``check(metrics)``; returns those metrics."""
    deadline = time.monotonic() + timeout
    while True:
        text = (await c.get("/metrics")).text
        m = {k: float(v) for k, v in re.findall(r"^(dllm_\S+) (\S+)$", text, re.M)}
        if check(m):
            return m
        assert time.monotonic() < deadline, f"timed out; metrics:\n{text}"
        await asyncio.sleep(0.2)


async def outcome(c: httpx.AsyncClient, body: dict) -> tuple[str, str]:
    """("ok", text) or ("error", "status message") of a completion, streamed or not."""
    if not body.get("stream"):
        r = await c.post("/v1/completions", json=body)
        return ("ok", r.json()["choices"][0]["text"]) if r.status_code == 200 else \
            ("error", f"{r.status_code} {r.json()['error']['message']}")
    text = []
    async with c.stream("POST", "/v1/completions", json=body) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                chunk = httpx.Response(200, content=line[6:]).json()
                if "error" in chunk:
                    return "error", f"{chunk['error']['code']} {chunk['error']['message']}"
                text += [choice["text"] for choice in chunk["choices"]]
    return "ok", "".join(text)


def test_killing_a_replica_mid_load_ends_its_requests_clearly_and_ray_replaces_it(cluster, offline):
    """The killed replica's requests are sent again if they had produced nothing, else end at
    once with a 502 naming the cause; the server stays up and Ray Serve starts a new replica."""
    url, board = cluster
    pids = {r.replica: r.pid for r in ray.get(board.reports.remote(), timeout=30)}
    victim = sorted(pids)[0]
    retried = metrics(url)["dllm_router_retried_requests_total"]

    def ongoing(m: dict, replica: str) -> float:
        return m.get(f'dllm_replica_ongoing_requests{{replica="{replica}"}}', 0)

    async def scenario():
        async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as c:
            # more than one replica takes (MAX_NUM_SEQS), so both hold some
            load = [asyncio.create_task(outcome(c, {**LONG, "prompt": PROMPTS[i], "stream": i % 2 == 0}))
                    for i in range(MAX_NUM_SEQS + 4)]
            await wait_async(lambda m: all(ongoing(m, r) > 0 for r in pids), c)
            os.kill(pids[victim], signal.SIGKILL)
            # each of the victim's requests either failed (its task is done) or was sent again
            m = await wait_async(lambda m: sum(t.done() for t in load) + m["dllm_router_retried_requests_total"]
                                 - retried >= ongoing(m, victim), c)
            done = [t.result() for t in load if t.done()]
            for task in load:
                task.cancel()
            await asyncio.gather(*load, return_exceptions=True)
            return done, m["dllm_router_retried_requests_total"] - retried

    failed, resent = asyncio.run(scenario())
    assert failed or resent
    for kind, message in failed:  # LONG requests cannot have finished: only errors are done
        assert kind == "error" and re.fullmatch(r"502 the replica serving this request died \(\w+\); retry",
                                                message), message
    r = httpx.post(url + "/v1/completions", json={"prompt": PROMPTS[1], "max_tokens": 16}, timeout=TIMEOUT)
    assert r.json()["choices"][0]["text"] == offline.generate([PROMPTS[1]], DEFAULTS.replace(max_new_tokens=16))[0].text
    wait_until(lambda: (m := metrics(url)).get('dllm_serve_replicas{state="STARTING"}', 0)
               + m.get('dllm_serve_replicas{state="RUNNING"}', 0) == 2, "Ray Serve to start a new replica")


def test_scaling_options_become_ray_serve_deployment_options():
    replica = ReplicaOptions("m", max_num_seqs=64, max_queue=128, threads=2, shutdown_timeout=7)
    fixed = Scaling(replicas=3).deployment_options(replica)
    normal = {"runtime_env": {"env_vars": {"RAY_worker_niceness": "0"}}}
    assert fixed == {"num_replicas": 3, "ray_actor_options": {"num_cpus": 2, **normal},
                     "max_ongoing_requests": 64, "max_queued_requests": 128, "graceful_shutdown_timeout_s": 7}
    auto = Scaling(replicas=None, min_replicas=1, max_replicas=5, target_ongoing_requests=8)
    opts = auto.deployment_options(ReplicaOptions("m", device="cuda"))
    assert opts["num_replicas"] == "auto"
    assert opts["ray_actor_options"] == {"num_cpus": 1, "num_gpus": 1, **normal}
    assert opts["autoscaling_config"] == {"min_replicas": 1, "max_replicas": 5, "target_ongoing_requests": 8}


def test_replicas_must_be_a_number_or_auto(capsys):
    with pytest.raises(SystemExit) as exit:
        main(["serve", str(MODEL), "--replicas", "two"])
    assert exit.value.code == 2
    assert "--replicas must be a number or 'auto', got 'two'" in capsys.readouterr().err


@pytest.mark.parametrize("args,message", [
    (["--replicas", "0"], "--replicas must be >= 1 or 'auto'"),
    (["--replicas", "auto", "--min-replicas", "3", "--max-replicas", "2"], "--min-replicas"),
    (["--replicas", "2", "--threads-per-replica", "0"], "threads per replica must be >= 1"),
    (["--ray-address", "ray://h:10001"], "--ray-address needs --replicas"),
    (["--replicas", "2", "--kv-cache-memory", "lots"], "kv_cache_memory must be a number of bytes"),
    (["--replicas", "2", "--kv-cache-memory", "0"], "kv_cache_memory must be a positive number of bytes"),
    (["--replicas", "2", "--gpu-memory-utilization", "1.5"], "gpu_memory_utilization must be in (0, 1]"),
])
def test_bad_replica_options_exit_2_naming_the_option(args, message, capsys):
    assert main(["serve", str(MODEL), *args]) == 2
    assert message in capsys.readouterr().err


def test_diffusion_gemma_replicas_refuse_what_its_sampler_does_not_run_before_starting(tmp_path, capsys):
    from tiny_diffusion_gemma import write_checkpoint
    folder = write_checkpoint(tmp_path)
    assert main(["serve", "--model", str(folder), "--replicas", "1", "--fixed-shapes"]) == 2
    assert "fixed_shapes: not available for diffusion_gemma" in capsys.readouterr().err

def test_each_replica_admits_by_its_own_memory_budget(cluster, offline):
    """``--kv-cache-memory`` with ``--replicas``: the application gives way to one replica whose
    budget fits one slow request. Of three, one runs and the others wait for memory, as the
    replica's figures and their sums in ``/metrics`` say; a request that could never fit gets
    the single-process server's 400; a request then answers as offline."""
    from dllm_engine.server.replicated import APP_NAME
    url, _ = cluster
    budget = 15 * 2**20  # one 600-token canvas (about 12 MB), not two; not LONG's (about 19 MB)
    serve.delete(APP_NAME)
    deploy(ReplicaOptions(str(MODEL), max_num_seqs=MAX_NUM_SEQS, max_queue=MAX_QUEUE, threads=1,
                          shutdown_timeout=5, kv_cache_memory=budget),
           Scaling(replicas=1), DEFAULTS, port=int(url.rsplit(":", 1)[1]))
    slow = {**LONG, "max_tokens": 600, "block_length": 600}  # ~600 steps: far longer than the wait

    async def scenario() -> dict[str, float]:
        async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as c:
            load = [asyncio.create_task(c.post("/v1/completions", json=slow)) for _ in range(3)]
            m = await wait_async(lambda m: m["dllm_running_sequences"] == 1 and m["dllm_waiting_for_memory"] >= 1, c)
            for task in load:
                task.cancel()
            await asyncio.gather(*load, return_exceptions=True)
            return m

    m = asyncio.run(scenario())
    replica = {k.split("{")[0]: v for k, v in m.items() if k.startswith("dllm_replica_")}
    assert m["dllm_kv_cache_memory_budget_bytes"] == replica["dllm_replica_kv_cache_memory_budget_bytes"] == budget
    assert 0 < m["dllm_kv_cache_bytes"] == replica["dllm_replica_kv_cache_bytes"] <= budget
    assert m["dllm_waiting_for_memory"] == replica["dllm_replica_waiting_for_memory"] >= 1
    with TestClient(create_app(LLM(MODEL, kv_cache_memory=budget), DEFAULTS)) as single:
        want = single.post("/v1/completions", json=LONG)
    got = httpx.post(url + "/v1/completions", json=LONG, timeout=TIMEOUT)
    assert want.status_code == 400 and "kv_cache_memory" in want.json()["error"]["message"]
    assert (got.status_code, got.json()) == (want.status_code, want.json())
    r = httpx.post(url + "/v1/completions", json={"prompt": PROMPTS[3], "max_tokens": 16}, timeout=TIMEOUT)
    assert r.json()["choices"][0]["text"] == offline.generate([PROMPTS[3]], DEFAULTS.replace(max_new_tokens=16))[0].text


def test_a_diffusion_gemma_checkpoint_serves_from_its_own_loop_on_a_replica(cluster, tmp_path_factory):
    """The last test on the cluster: tiny-llada's application gives way to a DiffusionGemma one
    (one replica running ``CanvasEngine``), whose answers, streamed canvas by canvas or whole,
    are the offline API's for a request alone."""
    from dllm_engine.server.replicated import APP_NAME
    from tiny_diffusion_gemma import write_checkpoint
    url, _ = cluster
    folder = write_checkpoint(tmp_path_factory.mktemp("tiny-diffusion-gemma"))
    serve.delete(APP_NAME)
    deploy(ReplicaOptions(str(folder), max_num_seqs=4, max_queue=8, threads=1, shutdown_timeout=5),
           Scaling(replicas=1), SamplingParams(), port=int(url.rsplit(":", 1)[1]))
    offline = LLM(folder)
    body = {"prompt": "w5 w6 w7", "seed": 5}
    want = offline.generate([body["prompt"]], SamplingParams(seed=5))[0]
    answer = httpx.post(url + "/v1/completions", json=body, timeout=TIMEOUT).json()
    assert answer["choices"][0]["text"] == want.text and answer["usage"]["completion_tokens"] == len(want.token_ids)
    chunks = []
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=TIMEOUT) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunks += [c["text"] for c in httpx.Response(200, content=line[6:]).json()["choices"]]
    assert "".join(chunks) == want.text
    models = httpx.get(url + "/v1/models", timeout=TIMEOUT).json()["data"][0]
    assert models["model_type"] == "diffusion_gemma" and models["methods"] == ["diffusion-gemma"]
    bad = httpx.post(url + "/v1/completions", json={**body, "threshold": 0.9}, timeout=TIMEOUT)
    assert bad.status_code == 400 and "does not apply to diffusion_gemma" in bad.text  # refused at the front
