"""``dllm serve --replicas 1 --tensor-parallel-size 2``: one Ray Serve replica of tiny-llada
whose model is split over two ranks (the replica is rank 0 and spawns rank 1), on its own local
Ray cluster for this module (the replica takes both CPUs: ``ReplicaOptions.actor_options``).

Every wait is bounded."""
import asyncio
import os
from pathlib import Path

import httpx
import pytest

ray = pytest.importorskip("ray", reason="the Ray Serve tests need the distributed extra: "
                                        "pip install -e '.[distributed]' (make venv installs it)")

from dllm_engine import LLM  # noqa: E402
from dllm_engine.server.replicated import ReplicaOptions, Scaling  # noqa: E402
from test_replicated import MODEL, PROMPTS, TIMEOUT, ask, expected, local_cluster, metrics, wait_until  # noqa: E402

pytestmark = pytest.mark.slow  # a Ray Serve replica and its second rank


@pytest.fixture(scope="module")
def cluster():
    """One local Ray instance and the application; yields (base URL, metrics board)."""
    replica = ReplicaOptions(str(MODEL), max_num_seqs=8, max_queue=8, threads=1, shutdown_timeout=5,
                             tensor_parallel_size=2)
    assert replica.actor_options()["num_cpus"] == 2  # a thread for each rank
    with local_cluster(replica, Scaling(replicas=1)) as running:
        yield running


def children(pid: int) -> list[str]:
    """The command lines of ``pid``'s child processes (from /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append((entry / "cmdline").read_bytes().replace(b"\0", b" ").decode())
        except (OSError, ValueError, IndexError):
            continue
    return found


def test_a_replica_split_over_two_ranks_answers_as_one_process(cluster):
    """Chat and completions, streamed and not, answered by the two-rank replica: the text one
    process gives offline; the replica holds a second rank (a spawned child process)."""
    url, board = cluster
    offline = LLM(MODEL)

    async def run() -> list[tuple[str, str]]:
        async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as c:
            return await asyncio.gather(*(ask(c, i, p) for i, p in enumerate(PROMPTS[:4])))

    answers = asyncio.run(run())
    assert [text for _, text in answers] == [expected(offline, i, p) for i, p in enumerate(PROMPTS[:4])]
    reports = wait_until(lambda: ray.get(board.reports.remote(), timeout=30), "the replica to report")
    assert len(reports) == 1 and reports[0].pid != os.getpid()
    assert any("multiprocessing" in line for line in children(reports[0].pid)), children(reports[0].pid)
    assert metrics(url)['dllm_serve_replicas{state="RUNNING"}'] == 1
