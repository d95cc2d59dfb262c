"""Fixed-shape steps (``fixed_shapes``, ``engine/shapes.py``) and the compiled step on top.

Bucketing pads rows, tokens and keys and masks the padding, so greedy tokens must equal the
dynamic engine's for every decoder and strategy, in a ragged batch whose rows are padded; the
forward shapes collapse to one per bucket; the compiled step (``compile_step``) gives eager's
tokens and compiles nothing new for shapes it has seen."""
import pytest
import torch

from dllm_engine import LLM, SamplingParams
from dllm_engine.bench.profile import ShapeLog
from dllm_engine.engine.kv_cache import KVCache
from dllm_engine.engine.shapes import bucket, pad_to
from dllm_engine.models.compiled import check_compile
from fixtures import write_checkpoint, write_llada2_checkpoint

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [14, 15, 16], [20, 21, 22, 23, 24, 25, 26]]
FULL = ["reference", "prefix-cache", "dual-cache", "dual-cache+focus", "dual-cache+early-skip",
        "dual-cache+adaptive-length", "dual-cache+jump-share"]
METHODS = {"llada": FULL, "Dream": ["dual-cache", "dual-cache+focus"],
           "sdar": ["block", "block+focus", "block+adaptive-length"]}


@pytest.fixture(scope="module")
def llms(tmp_path_factory):
    """Per family, the same checkpoint loaded dynamic and with fixed shapes."""
    out = {}
    for family in METHODS:
        folder = write_checkpoint(tmp_path_factory.mktemp(family), family)
        out[family] = LLM(folder), LLM(folder, fixed_shapes=True)
    return out


def params(method: str, **kw) -> SamplingParams:
    return SamplingParams(**{"method": method, "max_new_tokens": 16, "block_length": 8, "threshold": 0.7, **kw})


def test_bucket_pads_at_most_a_quarter_and_never_past_the_power_of_two():
    assert [bucket(n) for n in (1, 2, 3, 5, 8, 9, 17, 100, 128, 129)] == [1, 2, 4, 8, 8, 10, 20, 112, 128, 160]
    for n in range(1, 3000):
        b = bucket(n)
        assert n <= b <= 1 << (n - 1).bit_length() and (b <= 8 or b <= 1.25 * n)
        assert bucket(b) == b  # a bucket is its own bucket: a padded step pads no further
    x = pad_to(torch.ones(2, 3, dtype=torch.long), 4, 5, 7)
    assert x.shape == (4, 5) and x[:2, :3].eq(1).all() and x[2:].eq(7).all() and x[:, 3:].eq(7).all()


@pytest.mark.parametrize("family,method", [(f, m) for f, ms in METHODS.items() for m in ms])
def test_fixed_shapes_give_the_dynamic_tokens(llms, family, method):
    """Three prompts of different lengths: rows padded 3 -> 4, tokens and keys to buckets."""
    dynamic, fixed = llms[family]
    a, b = dynamic.generate(PROMPTS, params(method)), fixed.generate(PROMPTS, params(method))
    assert [o.token_ids for o in b] == [o.token_ids for o in a]
    assert (b.stats.nfe, b.stats.decoded_tokens) == (a.stats.nfe, a.stats.decoded_tokens)
    assert b.stats.processed_tokens == pytest.approx(a.stats.processed_tokens)  # padding is not work


@pytest.mark.slow  # over 2 s on 2 busy cores
def test_fixed_shapes_with_guidance_and_a_prompt_alone(llms):
    """Classifier-free guidance (an explicit key mask per row) and batch invariance: a prompt
    alone (one row) and inside the padded batch get the same tokens."""
    dynamic, fixed = llms["llada"]
    cfg = params("reference", cfg_scale=1.0)
    assert [o.token_ids for o in fixed.generate(PROMPTS, cfg)] == [o.token_ids for o in dynamic.generate(PROMPTS, cfg)]
    together = fixed.generate(PROMPTS, params("dual-cache"))
    assert fixed.generate(PROMPTS[1:2], params("dual-cache"))[0].token_ids == together[1].token_ids


def signatures(llm: LLM, method: str, prompts: list[list[int]]) -> set[tuple]:
    with ShapeLog(llm.model) as log:
        llm.generate(prompts, params(method, max_new_tokens=32))
    return log.signatures


@pytest.mark.slow  # over 2 s on 2 busy cores
def test_fixed_shapes_collapse_the_forward_shapes(llms):
    """dual-cache over prompts of 9 and 13 tokens (canvases 41 and 45, one bucket: 48): one
    canvas step and one block step, masked, each prompt alone or both together (where dynamic
    steps have four shapes alone); block: its keys take bucket values only."""
    dynamic, fixed = llms["llada"]
    layers = fixed.model.config.num_layers
    prompts = [PROMPTS[0], list(range(30, 43))]
    alone = set().union(*(signatures(fixed, "dual-cache", [p]) for p in prompts))
    assert alone == {((1, 48, 48, True),) * layers, ((1, 8, 48, True),) * layers}
    assert len(set().union(*(signatures(dynamic, "dual-cache", [p]) for p in prompts))) == 4
    together = signatures(fixed, "dual-cache", prompts)
    assert together == {((2, 48, 48, True),) * layers, ((2, 8, 48, True),) * layers}
    keys = {entry[2] for sig in signatures(llms["sdar"][1], "block", PROMPTS) for entry in sig}
    assert len(keys) > 1 and all(bucket(k) == k for k in keys)


@pytest.mark.parametrize("family,method", [("sdar", "block+focus"), ("llada", "dual-cache+early-skip")])
def test_strategies_that_drop_tokens_take_bucket_shapes_too(llms, family, method):
    """FOCUS and early skipping shrink the token set inside the forward: with fixed shapes
    their hooks are padded to the step's buckets and the kept set is bucketed, so every layer
    of every forward has bucket rows, tokens and keys, and some layer runs fewer tokens than the
    first (the strategy did drop tokens)."""
    _, fixed = llms[family]
    prompts = PROMPTS * 2
    got = signatures(fixed, method, prompts)
    entries = [entry for sig in got for entry in sig]
    assert all(bucket(b) == b and bucket(t) == t and bucket(s) == s and masked for b, t, s, masked in entries)
    assert any(sig[-1][1] < sig[0][1] for sig in got)


def test_a_view_wider_than_its_pool_is_refused():
    cache = KVCache(1, 1, 4, torch.float32, "cpu")
    cache.arrange([7, 8, 9], 16, rows=4)
    assert cache.num_rows == 4 and cache.view(0, 3).widen(4).read(0, 16)[0].shape[0] == 4
    with pytest.raises(ValueError, match="the KV pool has 4 rows, a view from row 1 needs 4: arrange it with rows=4"):
        cache.view(1, 4).widen(4)


def test_a_static_pool_marks_its_storage_for_cuda_graphs():
    """A compiled step on CUDA uses static pools (the runner asks for them there only): every
    tensor they allocate, also after growing, is an unguarded static address."""
    cache = KVCache(2, 1, 4, torch.float32, "cpu", static=True)
    cache.arrange([1, 2], 8)
    cache.arrange([1, 2, 3], 32, rows=4)
    assert cache.num_rows == 4 and cache.capacity == 32
    assert all(getattr(t, "_dynamo_static_input_type", None) == "unguarded" for t in cache.k + cache.v)
    assert not hasattr(KVCache(1, 1, 4, torch.float32, "cpu").k[0], "_dynamo_static_input_type")


@pytest.mark.slow  # over 2 s on 2 busy cores
def test_compile_step_is_for_one_process_and_grouped_moe_layers(tmp_path, monkeypatch):
    """MoE layers are captured only where their experts run as grouped GEMMs in bfloat16 (the
    step is compiled on its first use: building the LLM compiles nothing)."""
    with pytest.raises(ValueError, match="compile_step is for one process"):
        check_compile(False, 2, compile_step=True)
    folder = write_llada2_checkpoint(tmp_path)
    with pytest.raises(ValueError, match="compile_step cannot capture these MoE layers: .*bfloat16.* Use fixed_shapes"):
        LLM(folder, compile_step=True)  # float32
    assert LLM(folder, compile_step=True, dtype="bfloat16").engine.runner.compiled_step is not None
    monkeypatch.setattr("dllm_engine.models.layers.grouped_mm_fits", lambda *a: False)
    with pytest.raises(ValueError, match="compile_step cannot capture these MoE layers"):
        LLM(folder, compile_step=True, dtype="bfloat16")


@pytest.mark.slow  # torch.compile
def test_compiled_step_gives_eager_tokens_and_reuses_its_graphs(llms, family="sdar", method="block"):
    """One graph per shape bucket, compiled on first use: a second run over the same shapes
    compiles nothing (dynamo's frame counter does not move). A fresh LLM: ``block`` reaches new
    positions block by block, so RoPE's table grows during the first run (outside the graphs).
    One prompt: each graph compiles for seconds on a CPU."""
    from torch._dynamo.utils import counters
    dynamic = llms[family][0]
    expected = [o.token_ids for o in dynamic.generate(PROMPTS[:1], params(method))]
    compiled = LLM(dynamic.path, compile_step=True)
    assert compiled.engine.runner.fixed_shapes and compiled.engine.runner.step_forward is not None
    assert [o.token_ids for o in compiled.generate(PROMPTS[:1], params(method))] == expected
    frames = counters["frames"]["ok"]
    assert frames >= 2  # at least a canvas or first-block step and a later one
    assert [o.token_ids for o in compiled.generate(PROMPTS[:1], params(method))] == expected
    assert counters["frames"]["ok"] == frames
    compiled.engine.runner.set_step_shapes(True)
    assert compiled.engine.runner.step_forward is None and compiled.engine.runner.fixed_shapes


@pytest.mark.slow  # a bench run
def test_bench_runs_each_spec_as_loaded_then_with_fixed_shapes(llms, tmp_path):
    from dllm_engine.bench import run_bench
    from dllm_engine.bench.offline import table
    from dllm_lab.tasks import load_split
    llm = llms["llada"][0]
    examples = load_split(["sort"], limit=2)
    records = run_bench(llm, ["dual-cache:threshold=0.9"], [2], examples, tmp_path, defaults={"max_new_tokens": 16},
                        progress=lambda row: None, variants=["fixed shapes"], repeats=2)
    assert [r.method for r in records] == ["dual-cache:threshold=0.9", "dual-cache:threshold=0.9 [fixed shapes]"]
    assert records[0].output_tokens == records[1].output_tokens and not llm.engine.runner.fixed_shapes
    assert [len(r.runs_seconds) for r in records] == [2, 2]  # each round: as loaded, then the variant
    ratio = records[1].throughput / records[0].throughput
    per_round = [(records[1].output_tokens / t) / (records[0].output_tokens / u)
                 for t, u in zip(records[1].runs_seconds, records[0].runs_seconds)]
    row = table(records).splitlines()[-1]  # over the same spec as loaded, round by round too
    assert f"| {ratio:.2f}× | {min(per_round):.2f}–{max(per_round):.2f}× |" in row
    with pytest.raises(ValueError, match="unknown bench variant 'captured'; choose from compiled, fixed shapes"):
        run_bench(llm, ["dual-cache"], [1], examples, tmp_path, variants=["captured"])
