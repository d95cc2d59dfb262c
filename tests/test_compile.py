"""``LLM(..., compile=True)``: compiled norms and MLPs give eager's tokens on the fixtures.

The compiled kernels are not bit-exact (inductor's fused reduction and activation differ in the
last bits), so what is checked is what a user gets: the greedy tokens, against eager, on the
test fixtures, plus a bound on the logits. One compilation (dynamic shapes) serves every layer
and step; it takes ~20 s on a busy 2-core machine, paid once per test process.
"""
import pytest
import torch

from dllm_engine import LLM, SamplingParams
from dllm_engine.models.compiled import compile_model, is_compiled, uncompile_model
from fixtures import write_checkpoint

pytestmark = pytest.mark.slow  # torch.compile

PROMPTS = [[42, 13, 14, 15, 16, 17, 18], [20, 21, 22], [30, 31, 32, 33, 34]]


@pytest.fixture(scope="module")
def llms(tmp_path_factory):
    return {t: LLM(write_checkpoint(tmp_path_factory.mktemp(t), t)) for t in ("llada", "sdar")}


def test_compile_is_off_by_default_and_undone_by_uncompile(llms):
    model = llms["llada"].model
    assert not is_compiled(model)
    compile_model(model)
    assert is_compiled(model) and "forward" in model.layers[0].mlp.__dict__
    uncompile_model(model)
    assert not is_compiled(model)


@pytest.mark.parametrize("model_type,method", [("sdar", "block"), ("llada", "dual-cache"),
                                               ("llada", "dual-cache+focus")])
def test_compiled_tokens_equal_eager_tokens(llms, model_type, method):
    llm = llms[model_type]
    params = SamplingParams(method=method, max_new_tokens=16, block_length=8, threshold=0.7)
    eager = [o.token_ids for o in llm.generate(PROMPTS, params)]
    compile_model(llm.model)
    try:
        compiled = [o.token_ids for o in llm.generate(PROMPTS, params)]
    finally:
        uncompile_model(llm.model)
    assert compiled == eager


def test_compiled_logits_are_close_not_bit_exact(llms):
    model = llms["llada"].model
    ids = torch.tensor([PROMPTS[0] + [4] * 9])
    with torch.inference_mode():
        eager = model(ids)
        compile_model(model)
        try:
            compiled = model(ids)
        finally:
            uncompile_model(model)
    assert (compiled - eager).abs().max() < 1e-4
    assert torch.equal(compiled.argmax(-1), eager.argmax(-1))


def test_bench_runs_each_spec_eager_then_compiled(llms, tmp_path):
    from dllm_engine.bench import run_bench
    from dllm_engine.bench.offline import table
    from dllm_lab.tasks import load_split
    llm = llms["llada"]
    records = run_bench(llm, ["dual-cache:threshold=0.9"], [2], load_split(["sort"], limit=2), tmp_path,
                        defaults={"max_new_tokens": 16}, progress=lambda row: None, compare_compiled=True)
    assert [r.method for r in records] == ["dual-cache:threshold=0.9", "dual-cache:threshold=0.9 [compiled]"]
    assert records[0].output_tokens == records[1].output_tokens and not is_compiled(llm.model)
    ratio = records[1].throughput / records[0].throughput
    assert f"{ratio:.2f}×" in table(records).splitlines()[-1]  # over the same spec eager
