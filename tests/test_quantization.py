"""Weight-only quantization on load (``LLM(..., quantization="int8")``, ``models/quantize.py``):
every linear layer of every family, MoE experts included, is quantized from the checkpoint's own
weights and the LM head is not; the weights shrink; the answers stay close to the unquantized
model's; what cannot run (int4 off CUDA, an unknown name, no torchao) is refused before the
weights are read; a bench variant puts the original weights back exactly."""
import sys

import pytest
import torch

from dllm_engine import LLM, SamplingParams
from dllm_engine.errors import UserError
from dllm_engine.models import load_model
from dllm_engine.models.quantize import (QuantizeReport, check_quantization, linears, quantize_reversibly,
                                         storage_bytes, weight_bytes)
from fixtures import write_checkpoint, write_llada2_checkpoint, write_llada_moe_checkpoint

pytest.importorskip("torchao")

CHECKPOINTS = "checkpoints"
PROMPTS = [[5, 6, 7, 8, 9, 11, 12, 13], [14, 15, 16], [20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30]]


def quantized_share(model) -> float:
    """The share of the linear layers (LM head aside) whose weight is a quantized tensor."""
    found = linears(model).values()
    return sum(type(m.weight) is not torch.nn.Parameter for m in found) / len(found)


@pytest.mark.parametrize("write", [write_llada2_checkpoint, write_llada_moe_checkpoint,
                                   lambda folder: write_checkpoint(folder, "Dream")],
                         ids=["llada2_moe", "llada_moe", "Dream"])
def test_every_linear_layer_but_the_head_is_quantized(tmp_path, write):
    folder = write(tmp_path)
    plain, model = load_model(folder), load_model(folder, quantization="int8")
    assert model.quantization == QuantizeReport("int8", len(linears(model)), 0)
    assert quantized_share(model) == 1.0
    assert type(model.lm_head.weight) is torch.nn.Parameter  # the head keeps the logits' precision
    experts = [m for name, m in model.named_modules() if ".experts." in name and hasattr(m, "up_proj")]
    if model.config.moe is not None:  # every routed expert, on the MoE layers
        assert experts and all(type(m.up_proj.weight) is not torch.nn.Parameter for m in experts)
    ids = torch.tensor([PROMPTS[2]])
    with torch.inference_mode():
        want, got = plain(ids), model(ids)
    # int8 per output row: each weight within half a step (max |w| / 127 / 2) of its value
    assert (got - want).abs().max() < 0.1 * want.abs().max()
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.9


def test_int8_shrinks_the_linear_weights_to_a_quarter_of_float32():
    plain = load_model(f"{CHECKPOINTS}/tiny-sdar")
    model = load_model(f"{CHECKPOINTS}/tiny-sdar", quantization="int8")
    linear = sum(m.weight.numel() for m in linears(plain).values())
    rest = weight_bytes(plain) - 4 * linear
    # one byte a weight, plus a scale (fp32) and a zero point (int8) per output row
    scales = sum(storage_bytes(m.weight) - m.weight.numel() for m in linears(model).values())
    assert scales == 5 * sum(m.out_features for m in linears(model).values())
    assert weight_bytes(model) == rest + linear + scales
    assert weight_bytes(model) < 0.35 * weight_bytes(plain)


@pytest.mark.parametrize("checkpoint", ["tiny-llada", "tiny-sdar"])
def test_int8_answers_agree_with_float32(checkpoint):
    """The embedded checkpoints' held-out answers, greedy: nearly every token as float32's."""
    from dllm_lab.tasks import load_split
    examples = load_split("worked", limit=2)
    plain, quantized = LLM(f"{CHECKPOINTS}/{checkpoint}"), LLM(f"{CHECKPOINTS}/{checkpoint}", quantization="int8")
    assert quantized.model.quantization.quantized == len(linears(quantized.model))
    params = SamplingParams(max_new_tokens=64)
    want = plain.chat([e.chat() for e in examples], params)
    got = quantized.chat([e.chat() for e in examples], params)
    same = sum(a == b for x, y in zip(got, want) for a, b in zip(x.token_ids, y.token_ids))
    total = sum(max(len(x.token_ids), len(y.token_ids)) for x, y in zip(got, want))
    assert total > 0 and same / total >= 0.9


def test_a_reversible_quantization_puts_the_weights_back_exactly():
    model = load_model(f"{CHECKPOINTS}/tiny-llada")
    ids = torch.tensor([PROMPTS[0]])
    with torch.inference_mode():
        before = model(ids)
        restore = quantize_reversibly(model, "int8")
        assert model.quantization.method == "int8" and quantized_share(model) == 1.0
        during = model(ids)
        restore()
        after = model(ids)
    assert not torch.equal(during, before)
    assert torch.equal(after, before) and model.quantization is None and quantized_share(model) == 0.0


@pytest.mark.parametrize("method, device, dtype, message", [
    ("int3", "cpu", torch.float32, "quantization 'int3' is not supported; use one of int8, int4"),
    ("int4", "cpu", torch.float32, "int4 runs on CUDA only"),
    ("int4", "cuda", torch.float32, "int4 needs dtype bfloat16"),
])
def test_what_cannot_run_is_refused_naming_why(method, device, dtype, message):
    with pytest.raises(UserError, match=message):
        check_quantization(method, torch.device(device), dtype)


def test_a_refused_quantization_reads_no_weights(tmp_path, monkeypatch):
    from dllm_engine.models import loader
    monkeypatch.setattr(loader, "read_weights", lambda *a: pytest.fail("weights were read"))
    with pytest.raises(UserError, match="int4 runs on CUDA only"):
        LLM(f"{CHECKPOINTS}/tiny-llada", quantization="int4")
    with pytest.raises(UserError, match="not supported"):
        LLM("org/never-downloaded", quantization="fp3")  # before any download


def test_without_torchao_the_error_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao", None)  # import torchao raises ImportError
    with pytest.raises(UserError, match=r"pip install 'dllm-engine\[quant\]'"):
        check_quantization("int8", torch.device("cpu"), torch.float32)


def test_the_bench_compares_quantized_weights_with_agreement_and_size(tmp_path):
    from dllm_engine.bench.offline import run_bench
    from dllm_engine.bench.report import table
    from dllm_lab.tasks import load_split
    llm = LLM(f"{CHECKPOINTS}/tiny-llada")
    records = run_bench(llm, ["dual-cache"], [2], load_split("worked", limit=1), tmp_path,
                        {"max_new_tokens": 32}, progress=lambda line: None, variants=["int8"])
    plain, quantized = records
    assert (plain.method, quantized.method) == ("dual-cache", "dual-cache [int8]")
    assert plain.agreement is None and 0.9 <= quantized.agreement <= 1.0
    assert quantized.weight_mb < 0.35 * plain.weight_mb
    assert quantized_share(llm.model) == 0.0  # put back after its row
    text = table([r.as_row() for r in records])
    assert "| token agreement |" in text and "| weights MB |" in text
    assert "outputs" not in (tmp_path / "results.json").read_text()


@pytest.mark.slow  # a two-rank process group
def test_tensor_parallel_ranks_quantize_their_own_slices(tmp_path):
    """Each rank quantizes the slices it holds: a row-parallel slice's rows get their own scales,
    so the logits differ from one process's int8 by far less than int8 differs from float32."""
    folder = write_checkpoint(tmp_path, "llada", vocab_size=95)
    plain, one = LLM(folder), LLM(folder, quantization="int8")
    ids = torch.tensor([PROMPTS[0]])
    with LLM(folder, tensor_parallel_size=2, quantization="int8") as two:
        assert two.model.quantization.method == "int8" and quantized_share(two.model) == 1.0
        got = two.parallel.forward(ids, torch.ones_like(ids))
        tokens = two.generate(PROMPTS, SamplingParams(max_new_tokens=8))
    with torch.inference_mode():
        want, unquantized = one.model(ids), plain.model(ids)
    assert (got - want).abs().max() < 0.5 * (want - unquantized).abs().max()
    assert all(len(t.token_ids) > 0 for t in tokens)
