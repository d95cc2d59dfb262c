"""Admission by memory (``LLM(..., kv_cache_memory=...)``, ``--kv-cache-memory``): a budget that
fits 16 sequences under 256 requests runs them all, at most the budget in KV pools at any time,
each with the tokens it gets alone; a request that could never fit is refused with a clear error,
offline (``UserError``) and through the server (400); ``/metrics`` shows the budget."""
import httpx
import torch
import pytest

from dllm_engine import LLM, SamplingParams
from dllm_engine.engine.engine import Engine
from dllm_engine.engine.llm import parse_bytes
from dllm_engine.errors import UserError
from fixtures import write_checkpoint

PARAMS = SamplingParams(method="dual-cache", threshold=0.9, max_new_tokens=16, block_length=8)
PROMPTS = [[5 + i % 7, 6, 7, 8, 9, 10 + i % 5] for i in range(256)]  # one length: one pool


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("ckpt"), "llada")


def budget_for(llm: LLM, count: int) -> int:
    """The bytes ``count`` of the test's sequences need together."""
    seqs = [llm.make_sequence(p, PARAMS) for p in PROMPTS[:count]]
    return llm.engine.memory_needed(seqs, fresh=True)


def test_a_budget_for_16_runs_256_requests_within_it(folder, monkeypatch):
    free = LLM(folder)
    budget = budget_for(free, 16)
    assert budget_for(free, 17) > budget  # the budget really holds 16 at most
    want = free.generate(PROMPTS, PARAMS)
    peaks, widths = [], []
    arrange = Engine.arrange

    def recording(self, seqs):
        arrange(self, seqs)
        peaks.append(self.cache_bytes)
        widths.append(len(seqs))

    monkeypatch.setattr(Engine, "arrange", recording)
    llm = LLM(folder, kv_cache_memory=budget)
    got = llm.generate(PROMPTS, PARAMS)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert max(peaks) <= budget and max(widths) == 16  # as many as fit, never more
    for i in (0, 100, 255):  # the tokens each gets alone
        assert free.generate([PROMPTS[i]], PARAMS)[0].token_ids == got[i].token_ids
    assert llm.engine.waiting_for_memory == 0 and not llm.engine.has_work()


def test_a_request_that_can_never_fit_is_refused_and_the_engine_stays_usable(folder):
    small = LLM(folder, kv_cache_memory=budget_for(LLM(folder), 1))
    refused = r"needs about [\d.]+ \w+ of KV cache .* more than the budget of [\d.]+ \w+ \(kv_cache_memory\)"
    with pytest.raises(UserError, match=refused):
        small.generate([PROMPTS[0], PROMPTS[1]], PARAMS.replace(max_new_tokens=256, block_length=32))
    assert not small.engine.has_work()
    assert small.generate([PROMPTS[0]], PARAMS)[0].token_ids  # one that fits still runs


def test_budgets_are_bytes_or_sizes_with_units(folder):
    assert parse_bytes("2GiB") == 2 << 30 and parse_bytes("512M") == 512 << 20 and parse_bytes(1000) == 1000
    for bad in ("lots", "-1", 0):
        with pytest.raises(UserError, match="kv_cache_memory"):
            LLM(folder, kv_cache_memory=bad)


@pytest.mark.slow  # a live server
def test_the_server_refuses_what_cannot_fit_and_shows_the_budget(folder):
    from test_server import NAME, serving
    budget = budget_for(LLM(folder), 2)
    llm = LLM(folder, kv_cache_memory=budget)
    with serving(llm) as (url, _):
        ok = httpx.post(url + "/v1/completions", json={"model": NAME, "prompt": "sort : c b a", "max_tokens": 8},
                        timeout=60)
        assert ok.status_code == 200
        big = httpx.post(url + "/v1/completions", json={"model": NAME, "prompt": "sort : c b a", "max_tokens": 512,
                                                         "block_length": 32}, timeout=60)
        assert big.status_code == 400 and "kv_cache_memory" in big.json()["error"]["message"]
        text = httpx.get(url + "/metrics", timeout=30).text
    assert f"dllm_kv_cache_memory_budget_bytes {budget}" in text
    assert "# TYPE dllm_kv_cache_bytes gauge" in text and "dllm_waiting_for_memory 0" in text


@pytest.mark.parametrize("method,fixed_shapes", [("dual-cache", False), ("dual-cache", True),
                                                 ("dual-cache+early-skip", False), ("dual-cache+jump-share", False)])
def test_out_of_memory_in_a_step_halves_the_group_and_loses_nothing(folder, monkeypatch, method, fixed_shapes):
    """A device out-of-memory error in a forward of more than 4 rows (injected: a CPU has none):
    the engine steps the halves instead, every request finishes with its own tokens, and no more
    than half the failed group is admitted afterwards."""
    from dllm_engine.engine.runner import Runner
    llm, params = LLM(folder, fixed_shapes=fixed_shapes), PARAMS.replace(method=method)
    want = llm.generate(PROMPTS[:24], params)
    run, sizes = Runner.run, []

    def tight(self, step, ctx):
        live = sum(n > 0 for n in step.lengths)  # rows of sequences (not a fixed shape's padding)
        sizes.append(live)
        if live > 4:
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")
        return run(self, step, ctx)

    monkeypatch.setattr(Runner, "run", tight)
    got = llm.generate(PROMPTS[:24], params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [o.stats.nfe for o in got] == [o.stats.nfe for o in want]
    assert max(sizes) > 4 and llm.engine.oom_limit <= 12 and not llm.engine.has_work()


def test_on_cuda_the_default_budget_is_a_share_of_the_device_less_the_weights(monkeypatch):
    """No GPU here: torch.cuda's memory queries are stood in for. 90% of an 80 GiB device less
    16 GiB of weights; an explicit budget wins; a CPU gets none; a share that leaves nothing is
    refused."""
    from dllm_engine.engine.llm import memory_budget
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (70 << 30, 80 << 30))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 16 << 30)
    cuda = torch.device("cuda", 0)
    assert memory_budget(cuda, None, 0.9) == int(0.9 * (80 << 30)) - (16 << 30)
    assert memory_budget(cuda, 1 << 30, 0.9) == 1 << 30
    assert memory_budget(torch.device("cpu"), None, 0.9) is None
    with pytest.raises(UserError, match="leaves no memory for the KV cache"):
        memory_budget(cuda, None, 0.1)
    with pytest.raises(UserError, match=r"gpu_memory_utilization must be in \(0, 1\]"):
        memory_budget(cuda, None, 1.5)
