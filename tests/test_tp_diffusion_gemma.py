"""Tensor and expert parallelism for DiffusionGemma (``LLM(folder, tensor_parallel_size=2)``):
2 ranks over gloo on the CPU sample what one process samples (the same seeded tokens, work counts
and traces; rows joining and leaving between canvases as the server runs them, streamed through
the server), each rank reads only its slices (its query heads, the key/value heads they read,
its part of the dense MLP and its experts), shapes that do not split are refused before any
process starts, and a dead rank is an error, never a hang.

The 2-rank group starts once for the module."""
import os
import signal

os.environ.setdefault("DLLM_TP_TIMEOUT", "60")  # every collective of these tests is bounded by it

import httpx
import pytest
import torch

from dllm_engine import LLM, SamplingParams
from dllm_engine.engine import parallel
from dllm_engine.engine.canvas_llm import CanvasGroup, Request, group_key
from dllm_engine.engine.parallel import WorkerDied
from dllm_engine.server.canvas_engine import CanvasEngine
from dllm_engine.errors import UserError
from dllm_engine.models.diffusion_gemma import load_diffusion_gemma
from dllm_engine.models.loader import named_tensors
from dllm_engine.models.parallel import Shard
from fixtures import serving
from tiny_diffusion_gemma import TEXT, write_checkpoint

pytestmark = pytest.mark.slow  # a two-rank process group

ROWS = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [14, 15, 16, 17, 18, 19, 20], [21]]
SEEDS = [1, 2, 3, 4, 5]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("dg-tp"))


@pytest.fixture(scope="module")
def pair(folder):
    """(one-process LLM, 2-rank LLM) on the tiny random checkpoint: 4 query heads, 2 sliding and
    1 full key/value heads (the full layers' copied on both ranks), 4 experts top-2."""
    two = LLM(folder, tensor_parallel_size=2)
    yield LLM(folder), two
    two.close()


def test_seeded_tokens_counts_and_traces_equal_one_process(pair):
    """One batch of rows of different lengths, each seeded: the same tokens, stops, work and
    denoising traces on two ranks (every rank reached the same decisions from the same logits)."""
    one, two = pair
    params = [SamplingParams(seed=s, record_steps=True) for s in SEEDS]
    want, got = one.generate(ROWS, params), two.generate(ROWS, params)
    for a, b in zip(want, got):
        assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
        assert (a.stats.nfe, a.stats.decoded_tokens) == (b.stats.nfe, b.stats.decoded_tokens)
        assert [(s.canvas, s.step, s.token_ids, s.accepted, s.argmax_ids) for s in a.steps] == \
            [(s.canvas, s.step, s.token_ids, s.accepted, s.argmax_ids) for s in b.steps]
    steps = SamplingParams(seed=9, steps=2, max_new_tokens=12)  # other settings: a new batch on every rank
    assert [o.token_ids for o in one.generate(ROWS[:2], steps)] == [o.token_ids for o in two.generate(ROWS[:2], steps)]


def run_group(llm, joins: dict[int, list[int]], leaves: dict[int, list[int]]) -> dict[int, list[int]]:
    """Requests joining a ``CanvasGroup`` before the denoising step ``joins`` names, others
    leaving before theirs (as the server's loop runs them): request index -> its tokens."""
    requests = [Request(i, ROWS[i], llm.resolve(SamplingParams(seed=SEEDS[i]))) for i in range(len(ROWS))]
    group = CanvasGroup(llm, group_key(requests[0].params))
    out, step = {}, 0
    while step == 0 or len(group) or any(s >= step for s in joins):
        for i in joins.get(step, []):
            group.add(requests[i])
        group.leave([requests[i] for i in leaves.get(step, [])])
        out.update({r.index: o.token_ids for r, o in group.run_step()})
        step += 1
    return out


def test_rows_joining_and_leaving_between_steps_move_on_every_rank(pair):
    one, two = pair
    joins, leaves = {0: [0, 1], 3: [2, 3], 7: [4]}, {4: [1]}
    want = run_group(one, joins, leaves)
    assert set(want) == {0, 2, 3, 4} and want == run_group(two, joins, leaves)


def test_the_server_streams_what_one_process_streams(pair):
    one, two = pair
    body = {"model": "tiny", "prompt": "w5 w6 w7", "seed": 3}
    texts = []
    for llm in (one, two):
        with serving(llm) as (url, _):
            answer = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()
            with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=60) as r:
                chunks = [line for line in r.iter_lines() if line.startswith("data: {")]
            texts.append((answer["choices"][0]["text"], len(chunks)))
    assert texts[0] == texts[1] and texts[0][1] > 1


def test_each_rank_holds_and_reads_only_its_slices(folder, pair):
    """Both ranks' slices, read without a group, put together are the checkpoint's tensors: query
    heads and MLP rows split, the full layers' one key/value head on both, experts 0-1 and 2-3;
    the embedding, norms and routers whole on each."""
    whole = named_tensors(load_diffusion_gemma(folder))
    ranks = [named_tensors(load_diffusion_gemma(folder, shard=Shard(r, 2))) for r in range(2)]
    full, sliding = "layers.1.", "layers.0."  # a full layer has no v_proj and one key/value head

    def joined(name: str, dim: int = 0) -> bool:
        return torch.equal(torch.cat([r[name] for r in ranks], dim=dim), whole[name])

    def copied(name: str) -> bool:
        return all(torch.equal(r[name], whole[name]) for r in ranks)

    assert joined(full + "self_attn.q_proj.weight") and copied(full + "self_attn.k_proj.weight")
    assert joined(sliding + "self_attn.k_proj.weight") and joined(sliding + "self_attn.v_proj.weight")
    assert joined(full + "self_attn.o_proj.weight", dim=1) and joined(full + "mlp.down_proj.weight", dim=1)
    assert joined(full + "experts.gate_up_proj") and joined(full + "experts.down_proj")
    assert copied("embed_tokens.weight") and copied(full + "router.proj.weight") and copied("norm.weight")
    reports = pair[1].parallel.report()
    full = sum(t.numel() * t.element_size() for t in whole.values())
    assert [r["rank"] for r in reports] == [0, 1] and all(0 < r["loaded_bytes"] < full for r in reports)


@pytest.mark.parametrize("text, size, message", [
    ({}, 3, "num_attention_heads 4 is not divisible by tensor_parallel_size 3"),
    ({"num_experts": 6, "top_k_experts": 2}, 4, "num_experts 6 is not divisible by tensor_parallel_size 4"),
    ({"num_key_value_heads": 4, "num_attention_heads": 12, "intermediate_size": 48, "num_experts": 12}, 3,
     "the sliding layers' 4 key/value heads and tensor_parallel_size 3: one must divide the other"),
])
def test_shapes_that_do_not_split_are_refused_before_any_process_starts(tmp_path, monkeypatch, text, size, message):
    monkeypatch.setattr("tiny_diffusion_gemma.TEXT", {**TEXT, **text})
    folder = write_checkpoint(tmp_path)
    monkeypatch.setattr(parallel.mp, "get_context", lambda *a: pytest.fail("a process started"))
    with pytest.raises(UserError, match=message):
        LLM(folder, tensor_parallel_size=size)
    with pytest.raises(UserError, match=message):
        LLM(folder, device="meta", tensor_parallel_size=size)  # a weights-free front (serve --replicas)


def test_a_dead_rank_is_an_error_not_a_hang(pair):
    """Last: it ends the module's group."""
    two = pair[1]
    proc = two.parallel.procs[0]
    os.kill(proc.pid, signal.SIGKILL)
    proc.join(10)
    with pytest.raises(WorkerDied, match="rank 1"):
        two.generate(ROWS[:1], SamplingParams(seed=1))
    with pytest.raises(WorkerDied):  # and stays one
        two.generate(ROWS[:1], SamplingParams(seed=1))
    engine = CanvasEngine(two)  # the server's loop: a group failing so fails its health check
    engine.start()
    try:
        assert engine.alive()
        engine.group_failed(WorkerDied("rank 1 exited"))
        assert not engine.alive()
    finally:
        engine.shutdown(5)


def test_int8_weights_on_two_ranks(folder):
    """After the module's group ended (the test above): each rank quantizes its slices, stacked
    experts included, and samples seeded rows (row-parallel slices get their own scales, so the
    tokens are not one process's int8 tokens)."""
    pytest.importorskip("torchao")
    two = LLM(folder, tensor_parallel_size=2, quantization="int8")
    try:
        layers = len(two.model.layers)
        assert two.model.quantization.describe().endswith(f", {2 * layers} stacked expert weights")
        params = [SamplingParams(seed=s) for s in SEEDS[:3]]
        first = two.generate(ROWS[:3], params)
        assert [o.token_ids for o in first] == [o.token_ids for o in two.generate(ROWS[:3], params)]
        assert all(o.stats.nfe > 0 for o in first)
    finally:
        two.close()

