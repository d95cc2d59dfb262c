"""LLaDA-MoE (llada_moe): logits parity with transformers' Qwen3Moe, the released checkpoint layout
and config keys, the router math, and every full-attention decoder and strategy on it.

Parity reference: ``transformers.Qwen3MoeForCausalLM``, not ``OlmoeForCausalLM``. LLaDA-MoE's
released modeling file (``modeling_lladamoe.py``; read in ``inclusionAI/dInfer
tools/modeling_fused_lladamoe.py`` and ``ZHZisZZ/dllm-trainer .../modeling_lladamoe.py``) is an
OLMoE copy with changes, and equivalence was established by comparing the two forwards term by
term: q/k RMSNorm over each head's head_dim before RoPE (OLMoE normalises the whole projection;
Qwen3-MoE, like LLaDA-MoE, per head), full-width rotate-half RoPE, softmax router in fp32 with
top-k and no renormalisation (Qwen3-MoE with ``norm_topk_prob=False``), no shared expert, dense
MLP layers where ``moe_layer_freq`` is 0 (Qwen3-MoE's ``mlp_only_layers``), pre-norm residual
blocks, final RMSNorm, untied head. Differences, and how the test handles them:

- attention: LLaDA-MoE is bidirectional (its forward sets ``attention_mask`` and ``is_causal``
  off); Qwen3-MoE is causal unless given a 4-D mask, which transformers >= 4.53 uses as given
  (SDPA gets ``is_causal`` only without a mask). The reference runs with an all-True 4-D bool
  mask, or with a key-padding mask for left-padded rows (the released forward ignores padding
  altogether; the engine masks padding keys, so padded rows are compared against a reference
  that does too, and unpadded rows against the unmasked one);
- ``expert_bias`` (``moe_router_enable_expert_bias``; absent from the release): Qwen3-MoE has
  none, so the parity checkpoint has none and the biased router is checked against a per-token
  transcription of the released forward (``test_expert_bias_...``);
- weights: the experts are stacked into Qwen3-MoE's fused ``gate_up_proj`` [E, 2I, H] (gate
  first: its forward ``chunk(2)``s) and ``down_proj`` [E, H, I]; every other name is the same.
"""
import dataclasses
import json

import pytest
import torch
import transformers
from safetensors import safe_open

from dllm_engine import LLM, SamplingParams
from dllm_engine.config import MoEConfig
from dllm_engine.models import family_of, get_family, load_model, read_config
from dllm_engine.models.layers import MoE
from fixtures import left_padded_batch, tiny_config, tiny_llada_moe_config, write_llada_moe_checkpoint
from test_decoders import PROMPTS, llada_reference


# -- parity with transformers ---------------------------------------------------------------------
def qwen3_moe_state(folder, cfg):
    """The checkpoint's tensors under Qwen3-MoE names: the experts stacked, the rest unchanged."""
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        t = {name: f.get_tensor(name) for name in f.keys()}
    for i in range(cfg.moe.first_k_dense_replace, cfg.num_layers):
        mlp, experts = f"model.layers.{i}.mlp.", range(cfg.moe.num_experts)
        expert = [{w: t.pop(f"{mlp}experts.{e}.{w}_proj.weight") for w in ("gate", "up", "down")}
                  for e in experts]
        t[mlp + "experts.gate_up_proj"] = torch.stack([torch.cat([x["gate"], x["up"]]) for x in expert])
        t[mlp + "experts.down_proj"] = torch.stack([x["down"] for x in expert])
    return t


def qwen3_moe_reference(folder, cfg):
    m = cfg.moe
    hf_cfg = transformers.Qwen3MoeConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads, rms_norm_eps=cfg.rms_norm_eps, attention_bias=False,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
        moe_intermediate_size=m.moe_intermediate_size, num_experts=m.num_experts,
        num_experts_per_tok=m.num_experts_per_tok, norm_topk_prob=False, decoder_sparse_step=1,
        mlp_only_layers=list(range(m.first_k_dense_replace)), tie_word_embeddings=False,
        max_position_embeddings=256, attn_implementation="sdpa")
    ref = transformers.Qwen3MoeForCausalLM(hf_cfg)
    missing, unexpected = ref.load_state_dict(qwen3_moe_state(folder, cfg), strict=False)
    assert not unexpected and all("rotary" in name for name in missing), (missing, unexpected)
    return ref.eval()


def full_mask(valid):
    """4-D bool mask (True = attend): every query sees every real key; pad rows see themselves."""
    t = valid.shape[1]
    return valid[:, None, None, :].expand(-1, 1, t, -1) | torch.eye(t, dtype=torch.bool)[None, None]


@pytest.fixture(scope="module")
def parity(tmp_path_factory):
    folder = write_llada_moe_checkpoint(tmp_path_factory.mktemp("parity"), tokenizer=False)
    model = load_model(folder)
    return model, qwen3_moe_reference(folder, model.config)


def test_logits_match_transformers_qwen3moe_run_bidirectionally(parity):
    model, ref = parity
    ids = torch.randint(11, 95, (2, 13), generator=torch.Generator().manual_seed(1))
    everything = torch.ones(2, 13, dtype=torch.bool)
    with torch.no_grad():
        ours = model(ids)
        theirs = ref(input_ids=ids, attention_mask=full_mask(everything)).logits
        causal = ref(input_ids=ids).logits
    assert (ours - theirs).abs().max().item() < 1e-4
    assert ours.std() > 0.1  # not a degenerate comparison
    assert (ours - causal)[:, :-1].abs().max() > 1e-2  # the mask is what makes it bidirectional


def test_logits_match_with_left_padding(parity):
    model, ref = parity
    ids, valid, pos = left_padded_batch(seed=2)
    with torch.no_grad():
        ours = model(ids, attention_mask=valid.long())
        theirs = ref(input_ids=ids, attention_mask=full_mask(valid), position_ids=pos).logits
    assert (ours - theirs)[valid].abs().max().item() < 1e-4


# -- router: the released forward, token by token -------------------------------------------------
def released_moe(block, x):
    """LLaDA-MoE's ``LLaDAMoESparseMoeBlock.forward`` as plain per-token code: softmax over the
    experts in fp32, the expert bias added to the probabilities, top-k of the sums, each chosen
    expert weighted by its biased probability, no renormalisation."""
    out = []
    for h in x:
        probs = torch.softmax(block.gate.weight @ h, -1) + block.gate.expert_bias
        top = probs.topk(block.gate.moe.num_experts_per_tok)
        out.append(sum(w * block.experts[int(e)](h) for w, e in zip(top.values, top.indices)))
    return torch.stack(out)


@pytest.mark.parametrize("bias", [0.0, 0.2])
def test_expert_bias_router_equals_the_released_forward(bias):
    moe = MoEConfig(num_experts=8, num_experts_per_tok=3, moe_intermediate_size=6, norm_topk_prob=False,
                    score_function="softmax", expert_bias=True, bias_weights=True)
    torch.manual_seed(0)
    block = MoE(10, moe)
    with torch.no_grad():
        block.gate.weight.normal_(0.0, 1.0)
        block.gate.expert_bias.uniform_(0.0, bias)
        x = torch.randn(20, 10)
        got, want = block(x[None])[0], released_moe(block, x)
        weights, experts = block.gate(x)
    assert torch.allclose(got, want, atol=1e-5)
    assert len(set(experts.flatten().tolist())) > 3  # several experts really ran
    probs = torch.softmax(x @ block.gate.weight.T, -1)  # the weights are the biased probabilities
    assert torch.allclose(weights, probs.gather(1, experts) + block.gate.expert_bias[experts], atol=1e-6)


# -- checkpoint layout and config.json -------------------------------------------------------------
def test_checkpoint_uses_the_released_names_and_config_keys(tmp_path):
    folder = write_llada_moe_checkpoint(tmp_path, tokenizer=False, expert_bias=0.1)
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    for name in ("model.embed_tokens.weight", "model.layers.0.mlp.gate_proj.weight",
                 "model.layers.1.self_attn.q_norm.weight", "model.layers.1.self_attn.o_proj.weight",
                 "model.layers.1.mlp.gate.weight", "model.layers.1.mlp.expert_bias",
                 "model.layers.2.mlp.experts.7.down_proj.weight", "model.norm.weight", "lm_head.weight"):
        assert name in names, name
    assert not any("shared" in n or "gate.expert_bias" in n for n in names)
    hf = json.loads((folder / "config.json").read_text())
    assert (hf["model_type"], hf["architectures"]) == ("llada", ["LLaDAMoEModelLM"])
    assert hf["moe_layer_freq"] == [0, 1, 1] and hf["expert_intermediate_size"] == 16
    _, family, cfg = read_config(folder)
    assert family.model_type == "llada_moe" and family.methods == ("reference", "prefix-cache", "dual-cache")
    assert cfg.moe == dataclasses.replace(tiny_llada_moe_config().moe, expert_bias=True)
    assert cfg.qk_norm and not cfg.is_block_causal and cfg.rotary_dim == cfg.head_dim


def test_model_type_llada_is_told_apart_by_architecture_and_keys():
    dense = get_family("llada").config_to_hf(tiny_config("llada"))
    moe = get_family("llada_moe").config_to_hf(tiny_llada_moe_config())
    assert dense["model_type"] == moe["model_type"] == "llada"
    assert family_of(dense).model_type == "llada" and family_of(moe).model_type == "llada_moe"
    no_architecture = {k: v for k, v in moe.items() if k != "architectures"}
    assert family_of(no_architecture).model_type == "llada_moe"  # MoE keys, no d_model
    assert family_of({**moe, "model_type": "lladamoe"}).model_type == "llada_moe"  # dllm's rewrite


@pytest.mark.parametrize("changes,message", [
    ({"shared_expert_intermediate_size": 64}, "shared_expert_intermediate_size=64 is not supported"),
    ({"clip_qkv": 8.0}, "clip_qkv=8.0 is not supported"),
    ({"moe_layer_freq": [1, 0, 1]}, "dense layers only before the first MoE layer"),
    ({"moe_layer_freq": [1, 1]}, "must list 0 \\(dense\\) or 1 \\(MoE\\) for each of the 3 layers"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
     "rope_scaling .* is not supported for llada_moe"),
])
def test_unimplemented_options_are_refused(changes, message):
    hf = {**get_family("llada_moe").config_to_hf(tiny_llada_moe_config()), **changes}
    with pytest.raises(ValueError, match=message):
        family_of(hf).config_from_hf(hf)


def test_released_defaults_for_absent_and_ignored_keys():
    """Keys the released forward does not read change nothing: routing stays softmax top-k."""
    hf = get_family("llada_moe").config_to_hf(tiny_llada_moe_config())
    for key in ("moe_layer_freq", "dense_intermediate_size", "partial_rotary_factor", "num_key_value_heads"):
        hf.pop(key)
    hf.update(norm_topk_prob=True, moe_router_score_function="sigmoid", routed_scaling_factor=2.5)
    cfg = family_of(hf).config_from_hf(hf)
    assert cfg.moe.first_k_dense_replace == 0 and cfg.intermediate_size == 16
    moe = cfg.moe
    assert (moe.score_function, moe.norm_topk_prob, moe.routed_scaling_factor) == ("softmax", False, 1.0)
    assert cfg.num_kv_heads == cfg.num_heads and cfg.rotary_dim == cfg.head_dim


# -- decoders and strategies -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    return LLM(write_llada_moe_checkpoint(tmp_path_factory.mktemp("llada_moe")))


def test_reference_decoder_equals_the_plain_llada_sampler(llm):
    params = SamplingParams(method="reference", max_new_tokens=16, block_length=8, steps=4, stop_at_eos=False)
    for prompt in PROMPTS:
        want = llada_reference(llm.model, prompt, 16, 8, 4, llm.token_ids.mask_id)
        got = llm.generate([prompt], params)[0].token_ids
        assert want[: len(got)] == got
        assert len(got) == 16 or want[len(got)] in llm.token_ids.stop_ids


@pytest.mark.parametrize("method", ["prefix-cache", "dual-cache"])
def test_cached_decoders_match_reference_on_the_first_step_of_every_block(llm, method):
    params = SamplingParams(method="reference", max_new_tokens=16, block_length=4, steps=1)
    ref = llm.generate(PROMPTS, params)
    got = llm.generate(PROMPTS, params.replace(method=method))
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    assert any(len(o.token_ids) > 2 for o in got)


@pytest.mark.slow  # over 2 s on 2 busy cores
@pytest.mark.parametrize("method", ["reference", "prefix-cache", "dual-cache", "dual-cache+focus",
                                    "dual-cache+early-skip"])
@pytest.mark.parametrize("threshold", [None, 0.5])
def test_batch_invariance(llm, method, threshold):
    params = SamplingParams(method=method, max_new_tokens=16, block_length=8, threshold=threshold)
    batched = llm.generate(PROMPTS, params)
    for prompt, out in zip(PROMPTS, batched):
        assert llm.generate([prompt], params)[0].token_ids == out.token_ids


STRATEGIES = ["dual-cache+focus", "dual-cache+early-skip", "dual-cache+adaptive-length",
              "reference+adaptive-length", "prefix-cache+jump-share", "dual-cache+jump-share"]


@pytest.mark.slow  # over 2 s on 2 busy cores
def test_every_full_attention_strategy_runs(llm):
    """Each strategy that applies to full attention generates on the MoE model; FOCUS and early
    skipping compute fewer tokens than dual-cache for the same decoded ones."""
    params = SamplingParams(max_new_tokens=16, block_length=8, threshold=0.5, stop_at_eos=False)
    base = llm.generate(PROMPTS, params.replace(method="dual-cache"))
    for method in STRATEGIES:
        out = llm.generate(PROMPTS, params.replace(method=method))
        assert all(o.stats.decoded_tokens == 16 for o in out), method
        assert all(t != llm.token_ids.mask_id for o in out for t in o.token_ids), method
        if method in ("dual-cache+focus", "dual-cache+early-skip"):
            assert out.stats.processed_tokens < base.stats.processed_tokens, method


def test_block_decoding_is_refused(llm):
    with pytest.raises(ValueError, match="dual-cache"):
        llm.generate([PROMPTS[0]], SamplingParams(method="block", max_new_tokens=8, block_length=4))


def test_default_method_is_dual_cache(llm):
    assert llm.resolve().method == "dual-cache"


def generated(llm, params):
    out = llm.generate(PROMPTS, params)
    return [o.token_ids for o in out], [o.stats.nfe for o in out], out.stats.processed_tokens


@pytest.mark.slow  # over 2 s on 2 busy cores
@pytest.mark.parametrize("threshold", [None, 0.5])
def test_each_strategy_switched_off_gives_its_base_decoders_tokens(llm, threshold):
    """Early skipping keeping every token, adaptive length never confident enough to cut, and
    jump-share with one copy: the base decoder's tokens and forwards (the LLaDA tests' checks)."""
    base = SamplingParams(method="dual-cache", max_new_tokens=16, block_length=8, threshold=threshold,
                          stop_at_eos=False)
    want = generated(llm, base)
    skip_off = base.replace(method="dual-cache+early-skip", keep_fractions=(1.0, 1.0, 1.0),
                            skip_block_start="canvas", delay_eos=False)
    assert generated(llm, skip_off) == want
    for method in ("prefix-cache", "dual-cache"):
        plain = generated(llm, base.replace(method=method))[:2]
        assert generated(llm, base.replace(method=method + "+jump-share", max_copies=1))[:2] == plain
    stopping = base.replace(stop_token_ids=[25, 73], stop_at_eos=True)
    no_cut = stopping.replace(method="dual-cache+adaptive-length", eos_threshold=1.5)
    assert generated(llm, no_cut)[:2] == generated(llm, stopping)[:2]


@pytest.mark.slow  # over 2 s on 2 busy cores
def test_focus_without_eviction_equals_the_plain_delayed_cache_sampler(llm):
    from test_focus import check_eviction_off_equals_delayed_sampler
    check_eviction_off_equals_delayed_sampler(llm, max_new_tokens=16)
