"""The grouped-GEMM MoE dispatch (``models/kernels.grouped_mm_fits``): when it runs, it gives the
per-expert matmul chain's outputs, and a forward reads nothing on the host in its MoE layers
(DiffusionGemma's stacked experts; the masked families' experts, stacked on load)."""
import pytest
import torch

from dllm_engine.bench.profile import DispatchSyncs, ListSyncs, SyncCount
from dllm_engine.models import diffusion_gemma as dg, kernels, load_model
from dllm_engine.models.diffusion_gemma import DiffusionGemma, config_from_hf
from dllm_engine.models.layers import MoE
from dllm_engine.models.loader import save_model
from fixtures import randomize_diffusion_gemma, write_llada2_checkpoint, write_llada_moe_checkpoint
from tiny_diffusion_gemma import TEXT


def tiny_model(**text) -> DiffusionGemma:
    cfg = config_from_hf({"model_type": "diffusion_gemma", "text_config": {**TEXT, **text}, "canvas_length": 6})
    return randomize_diffusion_gemma(DiffusionGemma(cfg)).eval()


def test_grouped_mm_fits_only_aligned_plain_tensors_of_one_dtype(monkeypatch):
    w = torch.zeros(4, 16, 8)
    assert kernels.grouped_mm_fits(torch.zeros(5, 8), w)
    assert kernels.grouped_mm_fits(torch.zeros(5, 8, dtype=torch.bfloat16), w.bfloat16())
    assert not kernels.grouped_mm_fits(torch.zeros(5, 6), torch.zeros(4, 16, 6))  # 24-byte rows
    assert not kernels.grouped_mm_fits(torch.zeros(5, 8), torch.zeros(4, 6, 8))
    assert not kernels.grouped_mm_fits(torch.zeros(5, 8).double(), w.double())  # no float64 kernel
    assert not kernels.grouped_mm_fits(torch.zeros(5, 8), w.bfloat16())
    assert not kernels.grouped_mm_fits(torch.zeros(5, 9)[:, 1:], w)  # a base address off by 4 bytes
    monkeypatch.setattr(kernels, "GROUPED_MM_TORCH", (99, 0))
    assert not kernels.grouped_mm_fits(torch.zeros(5, 8), w)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_experts_equal_the_per_expert_chain(monkeypatch, dtype):
    """Random routing over 8 experts, one of them given no token: the two paths agree, and both
    equal each pair computed alone."""
    cfg = config_from_hf({"model_type": "diffusion_gemma", "canvas_length": 6, "text_config": {
        **TEXT, "hidden_size": 16, "moe_intermediate_size": 8, "num_experts": 8, "top_k_experts": 3}})
    experts = randomize_diffusion_gemma(dg.GemmaExperts(cfg)).to(dtype)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(20, 16, generator=g).to(dtype)
    routing = torch.stack([torch.randperm(7, generator=g)[:3] for _ in range(20)])  # expert 7 unused
    weights = torch.rand(20, 3, generator=g)
    assert kernels.grouped_mm_fits(x, experts.gate_up_proj, experts.down_proj)
    grouped = experts(x, weights, routing)
    monkeypatch.setattr(dg, "grouped_mm_fits", lambda *a: False)
    chain = experts(x, weights, routing)
    alone = sum(weights[:, j, None] * torch.stack([experts.expert(int(e), x[i:i + 1])[0].float()
                                                   for i, e in enumerate(routing[:, j])]) for j in range(3))
    tol = 0 if dtype == torch.float32 else 1e-2
    assert (grouped.float() - chain.float()).abs().max() <= tol
    assert torch.allclose(grouped.float(), alone, atol=1e-5 if dtype == torch.float32 else 5e-2)


def count_reads(fn) -> SyncCount:
    count = SyncCount()
    with DispatchSyncs(count), ListSyncs(count):
        fn()
    return count


def test_a_diffusion_gemma_forward_reads_nothing_on_the_host(monkeypatch):
    """Encoder and decoder passes (MoE in every layer, a left-padded batch): no host read with the
    grouped dispatch, one per layer and pass without it; the same op count at batch 2 and 8."""
    model = tiny_model()
    cfg = model.config

    def passes(batch: int):
        cache = model.new_cache()
        mask = torch.ones(batch, 5, dtype=torch.long)
        mask[0, :2] = 0
        model.encode(torch.randint(3, cfg.vocab_size, (batch, 5)), cache, attention_mask=mask)
        logits = model.decode(torch.randint(3, cfg.vocab_size, (batch, 6)), cache)
        model.decode(torch.randint(3, cfg.vocab_size, (batch, 6)), cache, self_conditioning_logits=logits)

    small, large = count_reads(lambda: passes(2)), count_reads(lambda: passes(8))
    assert small.total == large.total == 0
    assert small.ops == large.ops
    monkeypatch.setattr(dg, "grouped_mm_fits", lambda *a: False)
    assert count_reads(lambda: passes(2)).total == 3 * cfg.num_layers  # the chain's one read a layer


@pytest.mark.parametrize("write", [write_llada_moe_checkpoint, write_llada2_checkpoint])
def test_stacked_experts_run_grouped_with_the_chains_logits_and_save_as_released(tmp_path, write):
    """Loaded, every MoE layer's experts are views into two stacked tensors and run as grouped
    GEMMs: the logits equal the per-expert chain's, with one host read fewer per MoE layer;
    saved, the checkpoint holds one tensor per expert again and loads back to the same logits."""
    model = load_model(write(tmp_path / "ckpt"))
    moes = [m for m in model.modules() if isinstance(m, MoE)]
    assert moes and all(m.grouped for m in moes)
    first = moes[0].experts[moes[0].first]
    assert first.up_proj.weight.data_ptr() == moes[0].stacks[0][0, first.gate_proj.weight.shape[0]:].data_ptr()
    ids = torch.randint(5, 90, (3, 14), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        grouped, reads = model(ids), count_reads(lambda: model(ids)).total
        for m in moes:
            m.grouped = False
        chain, chain_reads = model(ids), count_reads(lambda: model(ids)).total
    assert torch.allclose(grouped, chain, atol=1e-5) and chain_reads == reads + len(moes)
    save_model(model, tmp_path / "saved", model.family)
    with torch.no_grad():
        assert torch.equal(load_model(tmp_path / "saved")(ids), grouped)


def test_quantized_experts_leave_their_stacks_and_get_them_back_when_put_back(tmp_path):
    pytest.importorskip("torchao")
    from dllm_engine.models.quantize import quantize_model, quantize_reversibly
    model = load_model(write_llada2_checkpoint(tmp_path / "a"))
    moes = [m for m in model.modules() if isinstance(m, MoE)]
    restore = quantize_reversibly(model, "int8")
    assert all(m.stacks is None and not m.grouped for m in moes)
    restore()
    assert all(m.grouped for m in moes)
    quantize_model(load_model(write_llada2_checkpoint(tmp_path / "b")), "int8")  # and a plain load's
