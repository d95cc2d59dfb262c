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


def test_a_diffusion_gemma_model_compiles_its_norms_and_dense_mlps(tmp_path):
    """``LLM(..., compile=True)`` on DiffusionGemma: its Gemma RMSNorms and dense GeGLU MLPs run
    compiled, its experts eager; both passes' logits stay within 1e-4 of eager (sampled tokens
    can then differ: a draw near a boundary flips); ``dllm bench --compile`` runs the spec eager,
    then compiled, with its token agreement, and leaves the model eager."""
    from dllm_engine.bench import run_bench
    from dllm_engine.bench.prompts import PromptExample
    from dllm_engine.models.diffusion_gemma import GatedMLP, GemmaExperts, GemmaRMSNorm
    from tiny_diffusion_gemma import CANVAS, write_checkpoint as write_diffusion_gemma
    folder = write_diffusion_gemma(tmp_path)
    eager, compiled = LLM(folder), LLM(folder, compile=True)
    layer = compiled.model.layers[0]
    assert all("forward" in m.__dict__ for m in layer.modules() if isinstance(m, (GemmaRMSNorm, GatedMLP)))
    assert not any("forward" in m.__dict__ for m in layer.modules() if isinstance(m, GemmaExperts))
    prompt, canvas = torch.tensor([[5, 6, 7, 8, 9]]), torch.tensor([[10 + i for i in range(CANVAS)]])
    with torch.inference_mode():
        hidden, logits = [], []
        for model in (eager.model, compiled.model):
            cache = model.new_cache()
            hidden.append(model.encode(prompt, cache))
            first = model.decode(canvas, cache)
            logits += [first, model.decode(canvas, cache, first)]  # self-conditioned
    assert (hidden[0] - hidden[1]).abs().max() < 1e-4
    assert (logits[0] - logits[2]).abs().max() < 1e-4 and (logits[1] - logits[3]).abs().max() < 1e-4
    prompts = [PromptExample(prompt=r, task="prompt") for r in ("w5 w6 w7", "w8 w9", "w10 w11 w12 w13")]
    records = run_bench(eager, ["diffusion-gemma:seed=0"], [3], prompts, tmp_path / "bench",
                        progress=lambda row: None, compare_compiled=True)
    assert [r.method for r in records] == ["diffusion-gemma:seed=0", "diffusion-gemma:seed=0 [compiled]"]
    assert 0 <= records[1].agreement <= 1 and records[1].output_tokens > 0 and not is_compiled(eager.model)
