"""Tensor and expert parallelism (``tensor_parallel_size``): 2 ranks over gloo on the CPU give
the logits (fp32, to 1e-5 absolute + 1e-5 relative) and greedy tokens of one process, for every
family, method and strategy; each rank reads only its slices; shapes that do not split are
refused by name; a dead rank is an error (and a 503 from the server), never a hang.

Each family's 2-rank group starts once for the module (worker start-up dominates the runtime)."""
import os
import signal

os.environ.setdefault("DLLM_TP_TIMEOUT", "60")  # every collective of these tests is bounded by it

import httpx
import numpy as np
import pytest
import torch

from dllm_engine import LLM, SamplingParams
from dllm_engine.engine import parallel
from dllm_engine.engine.parallel import WorkerDied
from dllm_engine.models import load_model
from dllm_engine.models.parallel import Shard, check_shardable
from fixtures import (tiny_config, tiny_llada2_config, write_checkpoint, write_llada2_checkpoint,
                      write_llada_moe_checkpoint)

pytestmark = pytest.mark.slow  # two-rank process groups

FULL = ["reference", "dual-cache", "dual-cache+focus", "dual-cache+early-skip", "dual-cache+adaptive-length"]
BLOCK = ["block", "block+focus", "block+adaptive-length"]
# llada2_moe last: the dead-worker test ends the last family's group with a block request
METHODS = {"llada": FULL + ["dual-cache+jump-share"], "Dream": FULL, "sdar": BLOCK,
           "llada_moe": FULL + ["dual-cache+jump-share"], "llada2_moe": BLOCK}
PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [14, 15, 16], [20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32]]


def write(folder, family: str):
    """LLaDA with the embedded checkpoints' vocabulary of 95 ids: the padded vocab-parallel
    embedding and head (48 + 47 rows)."""
    if family == "llada2_moe":
        return write_llada2_checkpoint(folder)
    if family == "llada_moe":  # softmax routers with an expert bias: the bias must travel whole
        return write_llada_moe_checkpoint(folder, expert_bias=0.2)
    return write_checkpoint(folder, family, **({"vocab_size": 95} if family == "llada" else {}))


@pytest.fixture(scope="module", params=list(METHODS))
def pair(request, tmp_path_factory):
    """(family, one-process LLM, 2-rank LLM) on the same random checkpoint."""
    folder = write(tmp_path_factory.mktemp(request.param), request.param)
    two = LLM(folder, tensor_parallel_size=2)
    yield request.param, LLM(folder), two
    two.close()


def ragged_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """Three rows, left-padded to 14 tokens (4, 0 and 9 pads)."""
    ids = torch.randint(5, 90, (3, 14), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(3, 14, dtype=torch.long)
    mask[0, :4] = 0
    mask[2, :9] = 0
    return ids, mask


def test_logits_equal_one_process(pair):
    _, one, two = pair
    ids, mask = ragged_batch()
    with torch.inference_mode():
        expected = one.model(ids, mask)
    got = two.parallel.forward(ids, mask)
    valid = mask.bool()
    assert got.shape == expected.shape
    # float32 rounding only: the row-parallel all-reduce adds the ranks' partial sums in another
    # order than one matmul does (seen: 1.05e-5 on a logit of magnitude ~3)
    torch.testing.assert_close(got[valid], expected[valid], rtol=1e-5, atol=1e-5)


def test_greedy_tokens_equal_one_process(pair):
    """Every method and strategy: the same tokens and the same work (a strategy's hooks decided
    the same on both ranks as in one process); FOCUS and early skipping did shrink the work."""
    family, one, two = pair
    work = {}
    for method in METHODS[family]:
        params = SamplingParams(method=method, max_new_tokens=16, block_length=8)
        a, b = one.generate(PROMPTS, params), two.generate(PROMPTS, params)
        assert [o.token_ids for o in b] == [o.token_ids for o in a], method
        assert (b.stats.nfe, b.stats.decoded_tokens) == (a.stats.nfe, a.stats.decoded_tokens), method
        assert b.stats.processed_tokens == pytest.approx(a.stats.processed_tokens), method
        work[method] = b.stats.processed_tokens
    base = METHODS[family][0] if family in ("sdar", "llada2_moe") else "dual-cache"
    for method in (m for m in work if m.endswith(("+focus", "+early-skip"))):
        assert work[method] < work[base], method


def test_rows_joining_and_leaving_move_on_every_rank(pair):
    """Two running sequences at a time: five prompts join as others finish, so KV pool rows
    move between steps; rank 1's pools must move the same way."""
    family, one, two = pair
    params = SamplingParams(method=METHODS[family][-1], max_new_tokens=16, block_length=8)
    prompts = PROMPTS + [[40, 41, 42, 43, 44], [50, 51]]
    one.engine.max_num_seqs = two.engine.max_num_seqs = 2
    try:
        a, b = one.generate(prompts, params), two.generate(prompts, params)
    finally:
        one.engine.max_num_seqs = two.engine.max_num_seqs = 256
    assert [o.token_ids for o in b] == [o.token_ids for o in a]


def test_fixed_shapes_on_two_ranks(pair):
    """Fixed-shape steps (rows 3 -> 4, tokens and keys bucketed): every rank pads its pools and
    steps the same way, and the tokens are one process's."""
    family, one, two = pair
    method = "block" if family in ("sdar", "llada2_moe") else "dual-cache"  # no hooks: fixed throughout
    params = SamplingParams(method=method, max_new_tokens=16, block_length=8)
    expected = [o.token_ids for o in one.generate(PROMPTS, params)]
    two.engine.runner.set_step_shapes(True)
    try:
        assert [o.token_ids for o in two.generate(PROMPTS, params)] == expected
    finally:
        two.engine.runner.set_step_shapes(False)


def test_each_rank_reads_only_its_slices(pair):
    _, one, two = pair
    full = sum(p.numel() * p.element_size() for p in one.model.parameters())
    reports = two.parallel.report()
    assert [r["rank"] for r in reports] == [0, 1]
    for r in reports:  # half of every split tensor, all of the norms and the router
        assert 0.45 * full < r["loaded_bytes"] < 0.55 * full


# -- without processes: the loader's slices and the shape checks -------------------------------
@pytest.mark.parametrize("family,size", [("Dream", 2), ("llada2_moe", 2), ("Dream", 4), ("llada", 2),
                                         ("llada_moe", 2)])
def test_shard_is_the_slice_of_the_checkpoint(tmp_path, family, size):
    """Rank r's tensors are rows / columns of the full ones (Dream at 4 ranks: 2 KV heads, each
    replicated on 2 ranks; LLaDA's 95-id vocabulary: 48 rows each, the last one zero); the
    experts a rank does not hold are not read."""
    folder = write(tmp_path, family)
    full = dict(load_model(folder).named_parameters())
    for rank in range(size):
        part = load_model(folder, shard=Shard(rank, size))
        params = dict(part.named_parameters())
        head = full["lm_head.weight"]
        vocab = -(-head.shape[0] // size)
        expected = torch.cat([head, head.new_zeros(vocab * size - head.shape[0], head.shape[1])])
        assert torch.equal(params["lm_head.weight"], expected[rank * vocab:(rank + 1) * vocab])
        padding = 2 * (vocab * size - head.shape[0]) * head.shape[1] * 4 if rank == size - 1 else 0
        assert part.loaded_bytes == sum(t.numel() * 4 for t in part.state_dict().values()) - padding
        down = full["layers.0.mlp.down_proj.weight"]
        cols = down.shape[1] // size
        assert torch.equal(params["layers.0.mlp.down_proj.weight"], down[:, rank * cols:(rank + 1) * cols])
        if family == "Dream":
            kv = rank * 2 // size  # KV head of this rank's query heads
            k = full["layers.1.self_attn.k_proj.bias"].view(2, -1)[kv]
            assert torch.equal(params["layers.1.self_attn.k_proj.bias"], k)
        if family in ("llada2_moe", "llada_moe"):
            experts = {n.split(".")[4] for n in params if ".experts." in n}
            assert experts == {str(e) for e in range(rank * 8 // size, (rank + 1) * 8 // size)}
        if family == "llada_moe":  # the router and its bias are replicated
            gate = "layers.1.mlp.gate"
            assert torch.equal(params[gate + ".weight"], full[gate + ".weight"])
            bias = part.layers[1].mlp.gate.expert_bias
            assert bias.min() > 0 and torch.equal(bias, load_model(folder).layers[1].mlp.gate.expert_bias)


@pytest.mark.parametrize("overrides,size,message", [
    ({}, 3, "num_heads 4 is not divisible by tensor_parallel_size 3"),
    ({"num_heads": 6, "num_kv_heads": 3, "hidden_size": 36}, 2,
     "num_kv_heads 3 and tensor_parallel_size 2: one must divide the other"),
    ({"intermediate_size": 50}, 4, "intermediate_size 50 is not divisible by tensor_parallel_size 4"),
])
def test_shapes_that_do_not_divide_are_refused(overrides, size, message):
    with pytest.raises(ValueError, match=message):
        check_shardable(tiny_config("sdar", **overrides), size)


def test_experts_that_do_not_divide_are_refused():
    with pytest.raises(ValueError, match="num_experts 8 is not divisible by tensor_parallel_size 3"):
        check_shardable(tiny_llada2_config(num_heads=3, num_kv_heads=3, hidden_size=24,
                                           intermediate_size=48, vocab_size=96), 3)


def no_process_may_start(monkeypatch) -> None:
    """Starting a worker or the rendezvous store fails the test."""
    def started(*args, **kwargs):
        raise AssertionError("a process or the TCP store was started")
    monkeypatch.setattr(parallel.mp, "get_context", started)
    monkeypatch.setattr(parallel.dist, "TCPStore", started)
    monkeypatch.setattr(parallel.dist, "init_process_group", started)


def test_llm_refuses_before_starting_any_process(tmp_path, monkeypatch):
    folder = write(tmp_path, "llada")
    no_process_may_start(monkeypatch)
    with pytest.raises(ValueError, match="num_heads 4 is not divisible by tensor_parallel_size 3"):
        LLM(folder, tensor_parallel_size=3)
    with pytest.raises(ValueError, match="num_heads 4 is not divisible by tensor_parallel_size 3"):
        LLM(folder, device="meta", tensor_parallel_size=3)  # a weights-free front (serve --replicas)
    with pytest.raises(ValueError, match="tensor_parallel_size must be an integer >= 1"):
        LLM(folder, tensor_parallel_size=0)


def test_torchrun_with_another_world_size_is_refused(tmp_path, monkeypatch):
    """Under torchrun (RANK / WORLD_SIZE set) the engine joins its group, which must be as
    large as ``tensor_parallel_size``; a mismatch is refused before any collective."""
    folder = write(tmp_path, "llada")
    no_process_may_start(monkeypatch)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(ValueError, match="tensor_parallel_size 2 but torchrun started WORLD_SIZE 3"):
        LLM(folder, tensor_parallel_size=2)


# -- a rank that dies ---------------------------------------------------------------------------
def kill_worker(llm: LLM) -> None:
    proc = llm.parallel.procs[0]
    os.kill(proc.pid, signal.SIGKILL)
    proc.join(10)


@pytest.mark.parametrize("pair", [list(METHODS)[-1]], indirect=True)
def test_dead_worker_is_an_error_and_the_server_answers_503(pair):
    """The server steps a tensor-parallel engine from its loop thread; then a killed rank: the
    server fails the request and every later one with 503 and /health says so; generate raises
    WorkerDied naming the rank. (Runs last: it ends the group of the
    module's last family.)"""
    from test_server import SHORT, serving
    _, _, llm = pair
    with serving(llm) as (url, app):
        assert app.state.server.engine.alive()
        served = httpx.post(f"{url}/v1/completions", json=SHORT, timeout=60)
        assert served.status_code == 200 and served.json()["usage"]["completion_tokens"] > 0
        pid = llm.parallel.procs[0].pid
        kill_worker(llm)
        r = httpx.post(f"{url}/v1/completions", json=SHORT, timeout=30)
        # found dead by its exit code, not by a collective timing out (DLLM_TP_TIMEOUT, 60 s)
        assert r.status_code == 503
        assert f"rank 1 (pid {pid}) exited with code -9" in r.json()["error"]["message"]
        assert httpx.post(f"{url}/v1/completions", json=SHORT, timeout=30).status_code == 503
        assert httpx.get(f"{url}/health", timeout=30).status_code == 503
        assert not app.state.server.engine.alive()  # a replica's health check: Ray Serve restarts it
    with pytest.raises(WorkerDied, match="rank 1"):
        llm.generate(PROMPTS[:1], SamplingParams(method="block", max_new_tokens=8, block_length=8))


PLAIN = (int, float, bool, str, type(None), torch.Tensor)


def plain_data(value) -> bool:
    """Whether ``value`` is ints, floats, bools, strings, None, tensors and NumPy arrays of
    numbers inside tuples, lists and dicts only (no Sequence, strategy state or hooks object)."""
    if isinstance(value, (tuple, list)):
        return all(plain_data(v) for v in value)
    if isinstance(value, dict):
        return all(plain_data(k) and plain_data(v) for k, v in value.items())
    if isinstance(value, np.ndarray):
        return value.dtype.kind in "biuf"
    return type(value) in PLAIN or isinstance(value, torch.Tensor)


@pytest.mark.parametrize("family,method", [("llada", "dual-cache+early-skip"), ("llada", "dual-cache+focus"),
                                           ("llada", "dual-cache+focus-probe"), ("sdar", "block+focus"),
                                           ("llada", "dual-cache+jump-share")])
def test_the_step_message_is_plain_data(tmp_path, monkeypatch, family, method):
    """What rank 0 sends each step (built here in one process, at every step of a run): plain
    data, hooks included, which the other ranks rebuild into hooks of the same class."""
    from dllm_engine.engine.runner import Runner
    llm = LLM(write(tmp_path, family))
    messages, run = [], Runner.run

    def recording(self, step, ctx):
        messages.append((parallel.step_message([("new", 0)], step, (0, 0, len(step.lengths)), ctx.hooks),
                         type(ctx.hooks)))
        return run(self, step, ctx)

    monkeypatch.setattr(Runner, "run", recording)
    llm.generate(PROMPTS, SamplingParams(method=method, max_new_tokens=16, block_length=8))
    with_hooks = [(m, kind) for m, kind in messages if m[4] is not None]
    assert messages and (with_hooks or method.endswith("jump-share"))
    assert all(plain_data(m) for m, _ in messages)
    for message, kind in with_hooks:
        assert type(parallel.rank_hooks(message[4])) is kind
