"""LLaDA2.0 (llada2_moe): logits parity with transformers' Glm4Moe, checkpoint layout, router math,
MoE dispatch, and block decoding."""
import json

import pytest
import torch
import transformers
from safetensors import safe_open

from dllm_engine import LLM, SamplingParams
from dllm_engine.config import MoEConfig
from dllm_engine.models import load_model, read_config
from dllm_engine.models.layers import MoE, Router, apply_rope, rope_cos_sin
from fixtures import left_padded_batch, random_llada2_model, tiny_llada2_config, write_llada2_checkpoint
from test_decoders import PROMPTS, check_block_cache_is_exact


# -- parity with transformers -----------------------------------------------------------------
def glm4_state(folder, cfg):
    """The checkpoint's LLaDA2 tensors under Glm4Moe names (the renames of notes/llada2.md)."""
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        t = {name: f.get_tensor(name) for name in f.keys()}
    sizes = [cfg.num_heads * cfg.head_dim] + [cfg.num_kv_heads * cfg.head_dim] * 2
    state = {"model.embed_tokens.weight": t.pop("model.word_embeddings.weight")}
    for i in range(cfg.num_layers):
        pre, attn, mlp = f"model.layers.{i}.", f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        q, k, v = t.pop(pre + "attention.query_key_value.weight").split(sizes)
        state.update({attn + "q_proj.weight": q, attn + "k_proj.weight": k, attn + "v_proj.weight": v})
        state[attn + "o_proj.weight"] = t.pop(pre + "attention.dense.weight")
        state[attn + "q_norm.weight"] = t.pop(pre + "attention.query_layernorm.weight")
        state[attn + "k_norm.weight"] = t.pop(pre + "attention.key_layernorm.weight")
        if i >= cfg.moe.first_k_dense_replace:
            state[mlp + "gate.e_score_correction_bias"] = t.pop(mlp + "gate.expert_bias")
            experts = range(cfg.moe.num_experts)
            gate_up = [torch.cat([t.pop(f"{mlp}experts.{e}.gate_proj.weight"),
                                  t.pop(f"{mlp}experts.{e}.up_proj.weight")]) for e in experts]
            state[mlp + "experts.gate_up_proj"] = torch.stack(gate_up)  # [E, 2I, H], gate first
            state[mlp + "experts.down_proj"] = torch.stack(
                [t.pop(f"{mlp}experts.{e}.down_proj.weight") for e in experts])  # [E, H, I]
    state.update(t)  # unchanged: layernorms, router weight, shared experts, dense MLP, norm, head
    return state


def glm4_reference(folder, cfg):
    m = cfg.moe
    hf_cfg = transformers.Glm4MoeConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.num_heads * cfg.head_dim,
        intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
        rms_norm_eps=cfg.rms_norm_eps, attention_bias=False, use_qk_norm=True,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta,
                         "partial_rotary_factor": cfg.rotary_dim / cfg.head_dim},
        moe_intermediate_size=m.moe_intermediate_size, num_experts_per_tok=m.num_experts_per_tok,
        n_shared_experts=m.num_shared_experts, n_routed_experts=m.num_experts,
        routed_scaling_factor=m.routed_scaling_factor, n_group=m.n_group, topk_group=m.topk_group,
        first_k_dense_replace=m.first_k_dense_replace, norm_topk_prob=m.norm_topk_prob,
        tie_word_embeddings=False, max_position_embeddings=256, attn_implementation="sdpa")
    ref = transformers.Glm4MoeForCausalLM(hf_cfg)
    missing, unexpected = ref.load_state_dict(glm4_state(folder, cfg), strict=False)
    assert not unexpected and all("rotary" in name for name in missing), (missing, unexpected)
    return ref.eval()


def block_causal_mask(valid, block_size):
    """4-D bool mask (True = attend): block-causal over each row's own positions, no padding."""
    b, t = valid.shape
    pos = (valid.long().cumsum(1) - 1).clamp(min=0)
    blk = pos // block_size
    mask = valid[:, None, None, :] & (blk[:, None, None, :] <= blk[:, None, :, None])
    return mask | torch.eye(t, dtype=torch.bool)[None, None]  # pad rows attend to themselves


@pytest.mark.slow  # over 2 s on 2 busy cores
def test_logits_match_transformers_glm4moe_with_left_padding(tmp_path):
    folder = write_llada2_checkpoint(tmp_path, tokenizer=False)
    model = load_model(folder)
    cfg = model.config
    ref = glm4_reference(folder, cfg)
    ids, valid, pos = left_padded_batch()
    with torch.no_grad():
        ours = model(ids, attention_mask=valid.long())
        theirs = ref(input_ids=ids, attention_mask=block_causal_mask(valid, cfg.block_size),
                     position_ids=pos).logits
    diff = (ours - theirs)[valid].abs().max().item()
    assert diff < 1e-4, diff
    assert ours[valid].std() > 0.1  # not a degenerate comparison


# -- checkpoint layout ------------------------------------------------------------------------
def test_checkpoint_uses_the_real_llada2_names_and_config_keys(tmp_path):
    folder = write_llada2_checkpoint(tmp_path, tokenizer=False)
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        qkv = f.get_tensor("model.layers.0.attention.query_key_value.weight")
    cfg = tiny_llada2_config()
    assert qkv.shape == ((cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim, cfg.hidden_size)
    for name in ("model.word_embeddings.weight", "model.layers.0.attention.dense.weight",
                 "model.layers.0.attention.query_layernorm.weight", "model.layers.0.mlp.gate_proj.weight",
                 "model.layers.1.mlp.gate.weight", "model.layers.1.mlp.gate.expert_bias",
                 "model.layers.1.mlp.experts.7.down_proj.weight",
                 "model.layers.1.mlp.shared_experts.up_proj.weight", "model.norm.weight", "lm_head.weight"):
        assert name in names, name
    assert "model.layers.0.mlp.gate.weight" not in names  # layer 0 is dense
    hf = json.loads((folder / "config.json").read_text())
    assert hf["model_type"] == "llada2_moe" and hf["architectures"] == ["LLaDA2MoeModelLM"]
    assert hf["partial_rotary_factor"] == 0.5 and hf["num_experts"] == 8 and hf["n_group"] == 4
    _, family, loaded = read_config(folder)
    assert family.methods == ("block",) and loaded.moe == cfg.moe and loaded.rotary_dim == 4


def test_sharded_checkpoint_loads_the_same(tmp_path):
    single = write_llada2_checkpoint(tmp_path / "single", tokenizer=False)
    sharded = write_llada2_checkpoint(tmp_path / "sharded", shard_bytes=20_000, tokenizer=False)
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("model-*.safetensors"))) > 1
    a_model, b_model = load_model(single), load_model(sharded)
    bias = b_model.layers[1].mlp.gate.expert_bias
    assert bias.min() > 0 and torch.equal(bias, random_llada2_model().layers[1].mlp.gate.expert_bias)
    ids = torch.randint(11, 95, (2, 9))
    with torch.no_grad():
        assert torch.equal(a_model(ids), b_model(ids))


def test_real_config_without_optional_keys_reads_llada2_defaults():
    from dllm_engine.models.llada2 import config_from_hf
    hf = {"model_type": "llada2_moe", "vocab_size": 100, "hidden_size": 64, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 80,
          "partial_rotary_factor": 0.5, "num_experts": 8, "num_experts_per_tok": 2,
          "moe_intermediate_size": 8, "num_shared_experts": 1, "n_group": 2, "topk_group": 1,
          "first_k_dense_replace": 1, "rope_scaling": None}
    cfg = config_from_hf(hf)
    assert cfg.qk_norm and cfg.fused_qkv and cfg.is_block_causal and cfg.block_size == 32
    assert cfg.rotary_dim == 8 and cfg.moe.expert_bias and cfg.moe.routed_scaling_factor == 1.0
    with pytest.raises(ValueError, match="score_function 'softmax' is not supported"):
        config_from_hf({**hf, "score_function": "softmax"})
    with pytest.raises(ValueError, match="rope_scaling .* is not supported for llada2_moe"):
        config_from_hf({**hf, "rope_scaling": {"type": "linear", "factor": 2.0}})
    with pytest.raises(ValueError, match="num_experts 8 must be divisible by n_group 3"):
        config_from_hf({**hf, "n_group": 3})


# -- router and expert dispatch ---------------------------------------------------------------
def plain_route(x, weight, bias, moe):
    """Token by token, in plain Python: {expert: weight} per token (DeepSeek-V3 routing)."""
    per_group = moe.num_experts // moe.n_group
    routes = []
    for h in x:
        scores = torch.sigmoid(weight @ h).tolist()
        choice = [s + b for s, b in zip(scores, bias.tolist())]
        group_score = [sum(sorted(choice[g * per_group:(g + 1) * per_group])[-2:])
                       for g in range(moe.n_group)]
        groups = sorted(range(moe.n_group), key=lambda g: -group_score[g])[: moe.topk_group]
        allowed = [e for g in groups for e in range(g * per_group, (g + 1) * per_group)]
        chosen = sorted(allowed, key=lambda e: -choice[e])[: moe.num_experts_per_tok]
        total = sum(scores[e] for e in chosen)
        routes.append({e: scores[e] / total * moe.routed_scaling_factor for e in chosen})
    return routes


@pytest.mark.parametrize("n_group,topk_group", [(4, 2), (1, 1), (8, 3)])
def test_router_selection_matches_a_plain_reference(n_group, topk_group):
    moe = MoEConfig(num_experts=16, num_experts_per_tok=3, moe_intermediate_size=4,
                    n_group=n_group, topk_group=topk_group, routed_scaling_factor=2.5)
    torch.manual_seed(0)
    router = Router(12, moe)
    with torch.no_grad():
        router.weight.normal_(0.0, 1.0)
        router.expert_bias.normal_(0.0, 0.5)  # negative values too: groups are masked with -inf
    x = torch.randn(64, 12)
    weights, experts = router(x)
    want = plain_route(x, router.weight.detach(), router.expert_bias, moe)
    for w, e, ref in zip(weights, experts, want):
        got = dict(zip(e.tolist(), w.tolist()))
        assert set(got) == set(ref)
        assert all(abs(got[i] - ref[i]) < 1e-5 for i in ref)


def test_expert_bias_changes_the_choice_but_not_the_weights():
    moe = MoEConfig(num_experts=4, num_experts_per_tok=1, moe_intermediate_size=4,
                    norm_topk_prob=False)
    router = Router(2, moe)
    with torch.no_grad():
        router.weight.copy_(torch.tensor([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0], [0.0, -1.0]]))
        router.expert_bias.copy_(torch.tensor([0.0, 0.0, 0.0, 0.9]))
    weights, experts = router(torch.tensor([[2.0, 0.0]]))
    # expert 0 scores sigmoid(2) = 0.881; expert 3 scores 0.5 + 0.9 and wins, weighted by its 0.5
    assert experts.tolist() == [[3]]
    assert weights.item() == pytest.approx(0.5)


def test_moe_dispatch_equals_a_per_token_loop():
    moe = MoEConfig(num_experts=8, num_experts_per_tok=3, moe_intermediate_size=6,
                    num_shared_experts=2, n_group=2, topk_group=1, routed_scaling_factor=1.5)
    torch.manual_seed(0)
    block = MoE(10, moe)
    x = torch.randn(2, 7, 10)
    with torch.no_grad():
        got = block(x)
        weights, experts = block.gate(x.reshape(-1, 10))
        want = []
        for h, w_row, e_row in zip(x.reshape(-1, 10), weights, experts):
            out = block.shared_experts(h)
            for w, e in zip(w_row, e_row):
                out = out + w * block.experts[int(e)](h)
            want.append(out)
    assert torch.allclose(got.reshape(-1, 10), torch.stack(want), atol=1e-5)
    assert len(set(experts.flatten().tolist())) > 2  # several experts really ran


def test_partial_rope_rotates_only_the_first_rotary_dims():
    x = torch.randn(1, 2, 5, 8)
    cos, sin = rope_cos_sin(torch.arange(5)[None], 4, 10000.0)
    out = apply_rope(x, cos, sin)
    assert torch.equal(out[..., 4:], x[..., 4:])
    assert torch.allclose(out[..., :4], apply_rope(x[..., :4], cos, sin))
    assert not torch.allclose(out[..., :4], x[..., :4])


# -- block decoding -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    return LLM(write_llada2_checkpoint(tmp_path_factory.mktemp("llada2")))


@pytest.mark.slow  # over 2 s on 2 busy cores
def test_block_decoder_with_cache_equals_recomputing_the_prefix(llm):
    check_block_cache_is_exact(llm)


@pytest.mark.slow  # over 2 s on 2 busy cores
@pytest.mark.parametrize("method", ["block", "block+focus"])
@pytest.mark.parametrize("threshold", [None, 0.5])
def test_batch_invariance(llm, method, threshold):
    params = SamplingParams(method=method, max_new_tokens=16, block_length=8, threshold=threshold)
    batched = llm.generate(PROMPTS, params)
    assert any(len(o.token_ids) > 2 for o in batched)  # the outputs are not all empty
    for prompt, out in zip(PROMPTS, batched):
        assert llm.generate([prompt], params)[0].token_ids == out.token_ids


@pytest.mark.slow  # over 2 s on 2 busy cores
def test_focus_evicts_tokens_on_the_moe_model(llm):
    params = SamplingParams(method="block", max_new_tokens=16, block_length=8, stop_at_eos=False)
    base = llm.generate(PROMPTS, params).stats
    focus = llm.generate(PROMPTS, params.replace(method="block+focus")).stats
    assert focus.decoded_tokens == base.decoded_tokens
    assert focus.processed_tokens < base.processed_tokens


def test_full_attention_methods_are_refused(llm):
    with pytest.raises(ValueError, match="block"):
        llm.generate([PROMPTS[0]], SamplingParams(method="dual-cache", max_new_tokens=8, block_length=4))
