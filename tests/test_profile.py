"""`dllm profile`: the host-sync counter, the floor replay and the command (speed is never asserted)."""
import time

import numpy as np
import pytest
import torch

from dllm_engine import LLM
from dllm_engine.bench import profile
from dllm_engine.bench.profile import (DispatchSyncs, FloorRecorder, ListSyncs, ShapeLog, SyncCount,
                                       count_syncs, profile_one)
from dllm_engine.cli import main
from dllm_engine.decoding.decoders import StepPlan
from dllm_engine.spec import parse_spec
from fixtures import write_checkpoint

pytestmark = pytest.mark.slow  # profiling runs

PROMPTS = [[5, 6, 7, 8, 9], [11, 12, 13]]


@pytest.fixture(scope="module")
def llada(tmp_path_factory):
    return LLM(write_checkpoint(tmp_path_factory.mktemp("llada"), "llada"))


def counted(fn) -> SyncCount:
    count = SyncCount()
    with torch.inference_mode(), ListSyncs(count), DispatchSyncs(count):
        fn()
    return count


def test_sync_counter_counts_host_reads_and_data_sized_outputs():
    x = torch.arange(6.0)
    assert counted(lambda: (x * 2 + 1).sum(0)).total == 0
    assert counted(lambda: x.sum().item()).total == 1
    assert counted(lambda: int(x.max())).total == 1
    assert counted(lambda: bool((x > 2).any())).total == 1
    assert counted(lambda: x.tolist()).total == 1
    assert counted(lambda: x.numpy()).total == 1
    assert counted(lambda: x[x > 2]).total == 1  # boolean indexing sizes its output from data
    assert counted(lambda: (x > 2).nonzero()).total == 1
    assert counted(lambda: x[torch.tensor([0, 2])]).total == 0  # integer indexing does not
    assert counted(lambda: (x * 2 + 1).sum(0)).ops == 3  # every aten op, synchronising or not
    rows = [torch.arange(n) for n in range(1, 9)]  # on a GPU: a fill and a copy per row
    assert counted(lambda: torch.nn.utils.rnn.pad_sequence(rows, batch_first=True)).ops == 9


def test_syncs_inside_the_layer_loop_are_counted_apart(llada):
    params = parse_spec("dual-cache:threshold=0.9", max_new_tokens=16, block_length=8)
    def read_back(module, args) -> None:
        args[0].sum().item()
    baseline = count_syncs(llada, params, PROMPTS, 2)  # also the warm-up: one-time work (tables) done
    baseline = count_syncs(llada, params, PROMPTS, 2)
    llada.model.layers[0].register_forward_pre_hook(read_back)
    try:
        count = count_syncs(llada, params, PROMPTS, 2)
    finally:
        llada.model.layers[0]._forward_pre_hooks.clear()
    # same prompts, same steps: the hook's syncs (one per forward) all land in the layer loop, and
    # its ops (sum, item: two per forward) too
    assert count.in_layers - baseline.in_layers == count.total - baseline.total > 0
    assert count.layer_ops - baseline.layer_ops == count.ops - baseline.ops == 2 * (count.total - baseline.total)


def test_floor_replay_leaves_outputs_and_cache_unchanged(llada):
    params = parse_spec("dual-cache+focus:threshold=0.9", max_new_tokens=16, block_length=8)
    plain = [o.token_ids for o in llada.generate(PROMPTS, params)]
    ticks = iter(range(10**6))  # a clock that advances by one per read
    recorder = FloorRecorder(llada.model, clock=lambda: next(ticks))
    try:
        llada.engine.add(llada.make_sequence(PROMPTS[0], params))
        llada.engine.add(llada.make_sequence(PROMPTS[1], params))
        done = []
        while llada.engine.has_work():
            done += llada.engine.step()
            num_calls, before = len(recorder.calls), recorder.seconds
            recorder.replay()
            assert num_calls == llada.model.config.num_layers + 3 and not recorder.calls
            assert recorder.seconds == before + 1  # one clock read before the replay, one after
    finally:
        recorder.remove()
    assert [s.output_ids() for s in sorted(done, key=lambda s: s.seq_id)] == plain


def test_profile_one_reports_floor_overhead_and_syncs(llada):
    params = parse_spec("dual-cache:threshold=0.9", max_new_tokens=16, block_length=8)
    r = profile_one(llada, "dual-cache", params, PROMPTS, 4)
    assert r.batch_size == 4 and r.steps > 0
    assert 0 < r.floor_ms and 0 < r.step_ms
    assert 0 < r.syncs_per_step <= 3 and r.layer_syncs_per_step == 0  # the step's reads: one to three
    assert 0 < r.ops_per_step <= 200 and r.layer_ops_per_step > 0  # docs/performance.md: ~110 for dual-cache


def test_the_breakdown_sums_op_time_by_kind(llada, capsys, tmp_path):
    from types import SimpleNamespace
    from dllm_engine.bench.profile import KINDS, breakdown_table, kind_totals, op_kind
    assert [op_kind(f"aten::{op}") for op in ("mm", "_scaled_dot_product_flash_attention_for_cpu", "mul",
                                               "index_put_", "transpose", "_foreach_norm")] == [*KINDS]
    # self time in microseconds over the run -> ms per step; only aten ops; CPU or device time
    events = [SimpleNamespace(key=k, self_cpu_time_total=c, self_device_time_total=d)
              for k, c, d in (("aten::mm", 3000.0, 30.0), ("aten::addmm", 1000.0, 10.0), ("aten::mul", 500.0, 5.0),
                              ("ProfilerStep", 9e9, 9e9))]
    assert kind_totals(events, steps=4) == {**dict.fromkeys(KINDS, 0.0), "matmul": 1.0, "elementwise": 0.125}
    assert kind_totals(events, steps=4, cuda=True)["matmul"] == 0.01
    params = parse_spec("dual-cache:threshold=0.9", max_new_tokens=16, block_length=8)
    r = profile_one(llada, "dual-cache", params, PROMPTS, 4, breakdown=True)
    assert set(r.breakdown) == set(KINDS)
    # a forward is mostly its matmuls and attention; the rest of the engine's work is all there too
    assert r.breakdown["matmul"] > 0 and r.breakdown["attention"] > 0 and r.breakdown["data movement"] > 0
    assert breakdown_table([r]).splitlines()[2].startswith("| `dual-cache` | 4 | ")
    assert profile_one(llada, "dual-cache", params, PROMPTS, 4).breakdown is None  # only when asked
    ckpt = write_checkpoint(tmp_path / "ckpt", "sdar", block_size=8)
    assert main(["profile", "--model", str(ckpt), "--methods", "block:threshold=0.9", "--batch-sizes", "1",
                 "--limit", "1", "--max-new-tokens", "8", "--tasks", "sort", "--breakdown"]) == 0
    out = capsys.readouterr().out
    assert "op time by kind" in out and "| method | batch | matmul | attention |" in out


def test_profile_command_prints_the_table(tmp_path, capsys):
    ckpt = write_checkpoint(tmp_path / "ckpt", "sdar", block_size=8)
    assert main(["profile", "--model", str(ckpt), "--methods", "block:threshold=0.9",
                 "--batch-sizes", "1,2", "--limit", "1", "--max-new-tokens", "8"]) == 0
    out = capsys.readouterr().out
    assert "| `block:threshold=0.9` | 1 |" in out and "| `block:threshold=0.9` | 2 |" in out
    assert "prompts: 6  tasks: sort,reverse,spell,lookup,dedup,count  " in out  # the copy suite by default
    assert main(["profile", "--model", str(ckpt), "--methods", "block:threshold=0.9", "--tasks", "sort,count",
                 "--batch-sizes", "1", "--limit", "1", "--max-new-tokens", "8"]) == 0
    assert "prompts: 2  tasks: sort,count  " in capsys.readouterr().out
    # this random checkpoint's 96 ids predate the worked words: refused by name, not an IndexError
    assert main(["profile", "--model", str(ckpt), "--methods", "block", "--tasks", "sum", "--limit", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: a prompt of task sum: prompt has token ids outside [0, 96)"), err
    assert main(["profile", "--model", str(ckpt), "--methods", "block:threshold=2", "--limit", "1"]) == 2
    assert capsys.readouterr().err.startswith("error: spec 'block:threshold=2': ")
    assert main(["profile", "--model", str(ckpt / "missing"), "--methods", "block", "--tasks", "nope"]) == 2
    assert "unknown task" in capsys.readouterr().err  # before the (missing) model is looked for


def test_profile_refuses_no_prompts(sdar):
    from dllm_engine.bench.profile import run_profile
    with pytest.raises(ValueError, match="no prompts to profile"):  # was a ZeroDivisionError
        run_profile(sdar, ["block"], [1], [])


@pytest.fixture(scope="module")
def sdar(tmp_path_factory):
    return LLM(write_checkpoint(tmp_path_factory.mktemp("sdar"), "sdar", block_size=8))


@pytest.mark.parametrize("spec", ["reference:threshold=0.9", "prefix-cache:threshold=0.9",
                                  "dual-cache:threshold=0.9", "dual-cache+early-skip:threshold=0.5",
                                  "dual-cache+jump-share:threshold=0.9", "block:threshold=0.9"])
def test_no_host_sync_inside_the_layer_loop(llada, sdar, spec):
    llm = sdar if spec.startswith("block") else llada
    count = count_syncs(llm, parse_spec(spec, max_new_tokens=16, block_length=8), PROMPTS, 2)
    assert count.total > 0 and count.in_layers == 0


def test_focus_reads_the_device_once_per_evicting_forward(llada):
    """The kept width is data-dependent: one host read sizes the shrunk set, nothing else."""
    params = parse_spec("dual-cache+focus:threshold=0.9", max_new_tokens=16, block_length=8)
    evicting = []
    hook = llada.model.layers[1].self_attn.register_forward_hook(
        lambda m, a, out: evicting.append(out[1] is not None))
    try:
        count = count_syncs(llada, params, PROMPTS, 2)
    finally:
        hook.remove()
    assert any(evicting) and count.in_layers == sum(evicting)


def test_runner_sends_no_mask_when_every_query_sees_every_key(llada):
    """A full canvas of one sequence: SDPA runs maskless (its fused kernels); a ragged batch
    gets one [B, 1, T, S] mask for the step."""
    from dllm_engine.decoding.decoders import plan_step
    seqs = [llada.make_sequence(p, parse_spec("reference", max_new_tokens=8, block_length=8))
            for p in PROMPTS]
    plans = [plan_step(s, 0).finalize(s, 0) for s in seqs]
    runner = llada.engine.runner
    limit = torch.nn.utils.rnn.pad_sequence([p.key_limit for p in plans], batch_first=True, padding_value=1)
    valid = torch.arange(limit.shape[1])[None] < torch.tensor([len(p) for p in plans])[:, None]
    assert runner.attention_keys(plans[:1], limit[:1], valid[:1]) == (len(plans[0]), None, None)
    num_keys, mask, span = runner.attention_keys(plans, limit, valid)
    assert num_keys == 13 and mask.shape == (2, 1, 13, 13) and span is None
    assert mask[1, 0, :11].sum(1).tolist() == [11] * 11  # the short row sees its own 11 keys


def test_runner_writes_a_contiguous_slot_range_as_one_slice(llada):
    """Rows that all write slots [lo, hi) in order, none padded, get ``span``; anything else
    (a gap, rows starting apart) goes through the indexed write; both store the same K/V."""
    from dllm_engine.engine.kv_cache import KVCache
    from types import SimpleNamespace
    runner = llada.engine.runner
    plans = [SimpleNamespace(key_mask=None, host_limit=None, host_key_mask=None)] * 2  # built on the device: read
    limit = torch.full((2, 4), 9)
    valid = torch.ones(2, 4, dtype=torch.bool)
    slots = torch.arange(3, 7).expand(2, 4)
    assert runner.attention_keys(plans, limit, valid, slots)[2] == (3, 7)
    assert runner.attention_keys(plans, limit, valid, slots + torch.tensor([[0], [1]]))[2] is None
    assert runner.attention_keys(plans, limit, valid, torch.tensor([[3, 4, 6, 7]] * 2))[2] is None
    # plans built on the host give the same facts from their host arrays
    def host_plan(at):
        plan = StepPlan(torch.tensor(at), torch.full((4,), 9), torch.tensor(at), host_positions=np.array(at),
                        host_limit=np.full(4, 9))
        plan.slots = plan.positions
        return plan
    same, apart = [host_plan([3, 4, 5, 6])] * 2, [host_plan([3, 4, 5, 6]), host_plan([4, 5, 6, 7])]
    assert runner.attention_keys(same, limit, valid, slots) == (9, None, (3, 7))
    assert runner.attention_keys(apart, limit, valid, slots + torch.tensor([[0], [1]])) == (9, None, None)
    gap = [host_plan([3, 4, 6, 7])] * 2
    assert runner.attention_keys(gap, limit, valid, torch.tensor([[3, 4, 6, 7]] * 2))[2] is None
    k, v = torch.randn(2, 2, 2, 4, 5), torch.randn(2, 2, 2, 4, 5)  # two writes of [B, Hkv, T, D]
    caches = [KVCache(1, 2, 5, torch.float32, "cpu") for _ in range(2)]
    for cache in caches:
        cache.arrange([0, 1], 8)
    caches[0].write(0, k[0], v[0], slots, valid, span=(3, 7))
    caches[1].write(0, k[0], v[0], slots, valid)
    assert torch.equal(caches[0].k[0], caches[1].k[0]) and torch.equal(caches[0].v[0], caches[1].v[0])
    ragged = valid.clone()
    ragged[1, 3] = False  # padding goes to the sink column, never into a real slot
    caches[1].write(0, k[1], v[1], slots, ragged)
    assert torch.equal(caches[1].k[0][1, :, 6], k[0][1, :, 3]) and torch.equal(caches[1].k[0][0, :, 3:7], k[1][0])


def test_profile_repeats_keep_the_fastest_pass(llada, monkeypatch):
    """Timed and floor passes get scripted durations: each keeps its own minimum."""
    params = parse_spec("dual-cache:threshold=0.9", max_new_tokens=16, block_length=8)
    real = profile.run_batches
    timed, floors = iter([0.3, 0.1, 0.2]), iter([0.05, 0.02, 0.04])

    def scripted(llm, params, prompts, batch_size, after_step=None, clock=None):
        steps, seconds, tokens = real(llm, params, prompts, batch_size, after_step)
        return (steps, next(timed), tokens) if clock is profile.CLOCKS["wall"] else (steps, seconds, tokens)
    monkeypatch.setattr(profile, "run_batches", scripted)
    monkeypatch.setattr(profile, "floor_seconds", lambda *args: next(floors))
    r = profile_one(llada, "dual-cache", params, PROMPTS, 2, repeats=3)
    one = count_syncs(llada, params, PROMPTS, 2)
    assert r.steps > 0 and r.syncs_per_step == round(one.total / r.steps, 2)
    assert r.step_ms == round(1e3 * 0.1 / r.steps, 3) and r.floor_ms == round(1e3 * 0.02 / r.steps, 3)
    assert r.overhead == pytest.approx(0.8)


def test_profile_on_the_cpu_clock(llada, monkeypatch):
    """``clock="cpu"`` times both passes on ``CLOCKS["cpu"]``, never on the wall clock."""
    params = parse_spec("dual-cache:threshold=0.9", max_new_tokens=16, block_length=8)
    reads = []

    def cpu() -> float:
        reads.append(1)
        return time.thread_time()

    def wall() -> float:
        raise AssertionError("the wall clock was read")
    monkeypatch.setitem(profile.CLOCKS, "cpu", cpu)
    monkeypatch.setitem(profile.CLOCKS, "wall", wall)
    r = profile_one(llada, "dual-cache", params, PROMPTS, 2, clock="cpu")
    # per step, two reads in the timed pass; in the floor pass two around the step and two
    # around its replay
    assert r.steps > 0 and len(reads) == 6 * r.steps
    assert 0 < r.floor_ms and r.throughput > 0


def test_profile_counts_the_distinct_forward_shapes(llada, sdar):
    """What a captured step would need: one capture per forward signature (per layer: rows,
    tokens, keys, masked). dual-cache has two (a whole canvas, one block over the same keys);
    block diffusion one per block end (its keys grow with the canvas); FOCUS shrinks the token
    set inside the forward, by data."""
    def signatures(llm, spec, prompts, batch):
        params = parse_spec(spec, max_new_tokens=32, block_length=8)
        with ShapeLog(llm.model) as log:
            count_syncs(llm, params, prompts, batch)
        return log.signatures

    layers = llada.model.config.num_layers
    dual = signatures(llada, "dual-cache:threshold=0.9", PROMPTS[:1], 1)
    canvas = len(PROMPTS[0]) + 32
    assert dual == {((1, canvas, canvas, False),) * layers, ((1, 8, canvas, False),) * layers}
    assert len(signatures(llada, "reference:threshold=0.9", PROMPTS[:1], 1)) == 1
    block = signatures(sdar, "block:threshold=0.9", PROMPTS[:1], 1)
    assert {sig[0][2] for sig in block if sig[0][1] == 8} == {8, 16, 24, 32, 40}  # every block end
    focus = signatures(llada, "dual-cache+focus:threshold=0.9", PROMPTS[:1], 1)
    assert any(len({entry[1] for entry in sig}) > 1 for sig in focus)  # tokens evicted mid-forward
