"""LLaDA2.1's joint-threshold decoding (``commit_rule="joint-threshold"``, presets S / Q) on the
``block`` decoder: tokens, edits and forwards equal a plain sampler written here from SGLang's
``JointThreshold`` as docs/decoding/joint-threshold.md describes it (not from the engine's code),
with the prefix recomputed every step, so the engine's block cache is shown never to hold a token
an edit replaced; edits are counted, never streamed, and what cannot compose is refused."""
from pathlib import Path

import openai
import pytest
import torch

from dllm_engine import LLM, SamplingParams
from dllm_engine.engine.stop_strings import committed_end, committed_ids
from dllm_engine.methods import BLOCK_METHODS, FULL_ATTENTION_METHODS, JOINT_THRESHOLD_PRESETS
from dllm_engine.resolve import resolve_params
from dllm_engine.spec import parse_spec
from dllm_lab.tasks import load_split
from fixtures import write_checkpoint, write_llada2_checkpoint

CHECKPOINTS = Path(__file__).resolve().parents[1] / "checkpoints"
PROMPTS = [[42, 13, 14, 15, 16, 17, 18], [20, 21, 22], [30, 31, 32, 33, 34]]
CUSTOM = dict(threshold=0.3, edit_threshold=0.2, max_post_edit_steps=2)


def plain_joint_threshold(model, prompt, gen_length, block_length, mask_id, stop_ids, threshold,
                          edit_threshold, max_post_edit_steps):
    """SGLang's JointThreshold over SDAR-style blocks, recomputing the prefix every step. Per step
    of a block: masks with confidence >= threshold commit (at least the most confident one; SGLang
    compares with >, the engine's block rule with >=); committed generated tokens whose prediction
    differs with confidence > edit_threshold are replaced. Once no mask is left, a step counts as a
    post-edit step; past max_post_edit_steps of them, or after one that changes nothing, the block
    is final. Returns (tokens up to the first stop, forwards, edits)."""
    total = -(-(len(prompt) + gen_length) // block_length) * block_length
    x = torch.tensor(prompt + [mask_id] * (total - len(prompt)))
    forwards = edits = 0
    for lo in range((len(prompt) // block_length) * block_length, total, block_length):
        hi, post = lo + block_length, 0
        generated = torch.arange(lo, hi) >= len(prompt)
        while True:
            masked = x[lo:hi] == mask_id
            if not masked.any():
                post += 1
                if post > max_post_edit_steps:
                    break
            with torch.no_grad():
                logits = model(x[None, :hi])[0, lo:hi].float()
            forwards += 1
            logits[:, mask_id] = -float("inf")
            x0 = logits.argmax(-1)
            p = torch.softmax(logits, -1).gather(-1, x0[:, None])[:, 0]
            m2t = masked & (p >= threshold)
            if masked.any() and not m2t.any():
                m2t[torch.where(masked, p, -1.0).argmax()] = True
            t2t = ~masked & generated & (x0 != x[lo:hi]) & (p > edit_threshold)
            if not (m2t | t2t).any():
                break
            edits += int(t2t.sum())
            x[lo:hi] = torch.where(m2t | t2t, x0, x[lo:hi])
        if any(t in stop_ids for t in x[max(lo, len(prompt)):hi].tolist()):
            break
    out = x[len(prompt):len(prompt) + gen_length].tolist()
    return out[: next((i for i, t in enumerate(out) if t in stop_ids), len(out))], forwards, edits


@pytest.fixture(scope="module")
def llms(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    return {"llada2": LLM(write_llada2_checkpoint(root / "llada2")), "sdar": LLM(write_checkpoint(root / "sdar", "sdar"))}


def rule_of(options: dict) -> dict:
    values = JOINT_THRESHOLD_PRESETS[options["preset"]] if "preset" in options else options
    return {k: values[k] for k in ("threshold", "edit_threshold", "max_post_edit_steps")}


def check_plain(llm, prompts, options, gen_length=16, block_length=4):
    params = SamplingParams(method="block", max_new_tokens=gen_length, block_length=block_length, **options)
    outs = llm.generate(prompts, params)
    for prompt, out in zip(prompts, outs):
        tokens, forwards, edits = plain_joint_threshold(llm.model, prompt, gen_length, block_length,
                                                        llm.token_ids.mask_id, llm.token_ids.stop_ids,
                                                        **rule_of(options))
        assert (out.token_ids, out.stats.nfe, out.stats.edits) == (tokens, forwards, edits)
    return outs


@pytest.mark.parametrize("model,options", [
    ("sdar", dict(preset="S")), ("sdar", dict(preset="Q")), ("llada2", dict(preset="Q")),
    ("sdar", CUSTOM), ("llada2", CUSTOM), ("llada2", dict(CUSTOM, max_post_edit_steps=0))])
def test_tokens_forwards_and_edits_equal_the_plain_sampler(llms, model, options):
    check_plain(llms[model], PROMPTS, options)  # (llada2, S): the next test


def test_the_speedy_mode_edits_and_counts_its_edits_apart(llms):
    """S mode (edit_threshold 0) edits on the random model; an edit is not a decoded token, and
    tokens per step still counts mask commits per forward (post-edit forwards included)."""
    outs = check_plain(llms["llada2"], PROMPTS[:2], dict(preset="S"))
    s = outs.stats
    assert s.edits > 0 and s.edits == sum(o.stats.edits for o in outs)
    for o in outs:
        assert o.stats.decoded_tokens <= 16 + 4 and o.stats.tokens_per_step == o.stats.decoded_tokens / o.stats.nfe
        assert sum(o.stats.step_commits.values()) == o.stats.nfe and o.stats.step_commits[0] > 0  # post-edit steps
    assert outs[0].stats.as_dict()["edits"] == outs[0].stats.edits


def test_batch_invariance(llms):
    llm = llms["llada2"]
    params = SamplingParams(method="block", max_new_tokens=16, block_length=4, **CUSTOM)
    batched = llm.generate(PROMPTS, params)
    assert batched.stats.edits > 0
    for prompt, out in zip(PROMPTS, batched):
        alone = llm.generate([prompt], params)[0]
        assert (alone.token_ids, alone.stats.edits) == (out.token_ids, out.stats.edits)


def test_the_embedded_tiny_sdar_equals_the_plain_sampler():
    llm = LLM(CHECKPOINTS / "tiny-sdar")
    prompts = [llm.apply_chat_template(e.chat()) for e in load_split(["copy"], limit=1)[:2]]
    for options in (dict(preset="S"), dict(preset="Q")):
        check_plain(llm, prompts, options, gen_length=32, block_length=32)


# -- streaming: an edited token is never streamed ---------------------------------------------------
def test_a_block_under_edit_is_not_final_text(llms):
    """While a block takes post-edit steps (``block_open``), the text the server streams
    (``committed_ids``) ends before it."""
    llm = llms["llada2"]
    params = llm.resolve(SamplingParams(method="block", max_new_tokens=16, block_length=4, preset="S"))
    seq = llm.make_sequence(PROMPTS[0], params)
    llm.engine.add(seq)
    seen_open = 0
    while not seq.finished:
        llm.engine.step()
        if seq.block_open:
            seen_open += 1
            assert committed_end(seq) <= max(seq.block[0], seq.prompt_len)  # the block's start
            assert len(committed_ids(seq)) <= max(seq.block[0] - seq.prompt_len, 0)
    assert seen_open > 0


def test_streamed_text_equals_the_final_text_with_edits(llms):
    from test_server import NAME, serving
    llm = llms["llada2"]
    prompt, options = "sort : c b a", dict(method="block", block_length=4, preset="S", max_post_edit_steps=2)
    want = llm.generate([prompt], SamplingParams(max_new_tokens=16, **options))[0]
    assert want.stats.edits > 0
    with serving(LLM(llm.path)) as (url, _):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
        chunks = list(client.completions.create(model=NAME, prompt=prompt, max_tokens=16, stream=True,
                                                extra_body=options))
    texts = [c.choices[0].text for c in chunks if c.choices and c.choices[0].text]
    assert "".join(texts) == want.text


# -- presets and options ------------------------------------------------------------------------
def test_presets_fill_what_the_request_left_unset():
    for preset, values in JOINT_THRESHOLD_PRESETS.items():
        p = resolve_params(SamplingParams(method="block", preset=preset), BLOCK_METHODS)
        assert (p.commit_rule, p.threshold, p.edit_threshold, p.max_post_edit_steps) == (
            "joint-threshold", values["threshold"], values["edit_threshold"], values["max_post_edit_steps"])
    assert JOINT_THRESHOLD_PRESETS == {"S": {"threshold": 0.5, "edit_threshold": 0.0, "max_post_edit_steps": 16},
                                       "Q": {"threshold": 0.7, "edit_threshold": 0.5, "max_post_edit_steps": 16}}
    p = resolve_params(SamplingParams(preset="S", threshold=0.6), BLOCK_METHODS)
    assert (p.method, p.threshold, p.edit_threshold) == ("block", 0.6, 0.0)  # the request's value wins
    p = resolve_params(SamplingParams(edit_threshold=0.3), BLOCK_METHODS)  # an option selects the rule
    assert (p.commit_rule, p.preset, p.threshold, p.edit_threshold, p.max_post_edit_steps) == (
        "joint-threshold", "Q", 0.7, 0.3, 16)
    p = resolve_params(parse_spec("block:preset=S"), BLOCK_METHODS, generation_config={"threshold": 0.95})
    assert p.threshold == 0.5  # the preset wins over the checkpoint's threshold
    assert "commit_rule=joint-threshold preset=S" in p.describe() and "edit_threshold=0.0" in p.describe()


@pytest.mark.parametrize("kwargs,param,message", [
    (dict(preset="X"), "preset", "preset must be one of S, Q"),
    (dict(edit_threshold=1.5), "edit_threshold", r"edit_threshold must be in \[0.0, 1.0\]"),
    (dict(max_post_edit_steps=-1), "max_post_edit_steps", "max_post_edit_steps must be >= 0"),
    (dict(commit_rule="credit", edit_threshold=0.5), "edit_threshold",
     "edit_threshold is an option of commit_rule 'joint-threshold', not of 'credit'"),
    (dict(commit_rule="fast"), "commit_rule", "unknown commit_rule 'fast'; available: credit, hierarchical"),
    (dict(method="dual-cache", preset="S"), "commit_rule", "commit_rule 'joint-threshold' runs on block, not on 'dual-cache'"),
    (dict(method="block+focus", preset="Q"), "commit_rule",
     "'focus' freezes committed block positions, which commit_rule 'joint-threshold' edits"),
    (dict(method="block+delayed-cache", preset="Q"), "commit_rule", "'delayed-cache' freezes committed"),
    (dict(preset="S", remasking="random"), "remasking", "reads the token's probability"),
    (dict(commit_rule="hierarchical", factor=1.0), "factor", "commits by threshold; drop factor"),
    (dict(commit_rule="credit", credit_beta=2.0), "credit_beta", r"credit_beta must be in \[0.0, 1.0\]"),
])
def test_bad_options_are_refused_naming_the_field(kwargs, param, message):
    with pytest.raises(ValueError, match=message) as e:
        SamplingParams(**kwargs)
    assert e.value.param == param


def test_a_full_attention_model_refuses_joint_threshold():
    with pytest.raises(ValueError, match="commit_rule 'joint-threshold' runs on block, not on 'dual-cache'"):
        resolve_params(SamplingParams(preset="S"), FULL_ATTENTION_METHODS)


def test_adaptive_length_composes(llms):
    llm = llms["llada2"]
    params = SamplingParams(method="block+adaptive-length", max_new_tokens=16, block_length=4,
                            eos_threshold=1.5, **CUSTOM)  # never cuts: the same tokens as without it
    plain = llm.generate(PROMPTS, params.replace(method="block"))
    got = llm.generate(PROMPTS, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in plain] and got.stats.edits > 0


def test_logprobs_follow_the_edited_tokens(llms):
    llm = llms["llada2"]
    out = llm.generate(PROMPTS[:1], SamplingParams(method="block", max_new_tokens=16, block_length=4,
                                                   preset="S", logprobs=2))[0]
    assert out.stats.edits > 0
    for tok, (_, top_ids, _) in zip(out.token_ids, out.logprobs):
        assert tok == top_ids[0]  # greedy: each kept token is the argmax of the step that wrote it


# -- the released LLaDA2.1-mini config loads -------------------------------------------------------
# inclusionAI/LLaDA2.1-mini config.json: the keys from "architectures" through
# "transformers_version" as the Hugging Face page shows them (huggingface.co/inclusionAI/
# LLaDA2.1-mini/blob/main/config.json, in the docs corpus); the page's excerpt ends there, so the
# last keys (use_bias, use_cache, use_qkv_bias, vocab_size) are those of Zigeng/DMax-Math-16B's
# config.json, a LLaDA2.0-mini fine-tune of the same architecture, and notes/llada2.md.
LLADA21_MINI_CONFIG = {
    "architectures": ["LLaDA2MoeModelLM"], "attention_dropout": 0.0,
    "auto_map": {"AutoConfig": "configuration_llada2_moe.LLaDA2MoeConfig",
                 "AutoModel": "modeling_llada2_moe.LLaDA2MoeModel",
                 "AutoModelForCausalLM": "modeling_llada2_moe.LLaDA2MoeModelLM"},
    "dtype": "bfloat16", "embedding_dropout": 0.0, "first_k_dense_replace": 1, "head_dim": 128,
    "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 5120,
    "max_position_embeddings": 32768, "max_window_layers": 28, "model_type": "llada2_moe",
    "moe_intermediate_size": 512, "moe_router_enable_expert_bias": True, "n_group": 8, "norm_head": False,
    "norm_softmax": False, "norm_topk_prob": True, "num_attention_heads": 16, "num_experts": 256,
    "num_experts_per_tok": 8, "num_hidden_layers": 20, "num_key_value_heads": 4, "num_shared_experts": 1,
    "output_dropout": 0.0, "output_router_logits": False, "pad_token_id": 156892, "partial_rotary_factor": 0.5,
    "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 600000, "rotary_dim": 64,
    "routed_scaling_factor": 2.5, "router_dtype": "fp32", "score_function": "sigmoid", "sliding_window": 4096,
    "tie_word_embeddings": False, "topk_group": 4, "transformers_version": "4.57.1",
    "use_bias": False, "use_cache": False, "use_qkv_bias": False, "vocab_size": 157184,
}
LLADA2_SPECIALS = {"<|endoftext|>": 156892, "<|mask|>": 156895, "<|role_end|>": 156900}


def write_llada21_release(folder: Path, **changes) -> Path:
    """The release's config.json (``changes`` applied) and a word-level tokenizer holding its
    special tokens at their ids; no weights (load it on the meta device)."""
    import json

    from tokenizers import AddedToken, Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({**LLADA21_MINI_CONFIG, **changes}))
    tok = Tokenizer(WordLevel({"<|unk|>": 0, "hello": 1, **LLADA2_SPECIALS}, unk_token="<|unk|>"))
    tok.pre_tokenizer = WhitespaceSplit()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in LLADA2_SPECIALS])
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>", "unk_token": "<|unk|>"}))
    return folder


def test_the_released_llada21_mini_config_loads_and_runs_its_modes(tmp_path):
    from dllm_engine.models import read_config
    _, family, cfg = read_config(write_llada21_release(tmp_path / "full"))
    assert family.model_type == "llada2_moe" and family.methods == BLOCK_METHODS
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rotary_dim) == (
        20, 2048, 16, 4, 128, 64)
    assert (cfg.vocab_size, cfg.max_position_embeddings, cfg.block_size) == (157184, 32768, 32)
    assert cfg.is_block_causal and cfg.qk_norm and cfg.moe.num_experts == 256 and cfg.moe.expert_bias
    llm = LLM(write_llada21_release(tmp_path / "one-layer", num_hidden_layers=2), device="meta")
    assert (llm.token_ids.mask_id, llm.token_ids.eos_id) == (156895, 156892)
    for preset, values in JOINT_THRESHOLD_PRESETS.items():
        p = llm.resolve(SamplingParams(preset=preset))
        assert (p.method, p.block_length, p.commit_rule, p.threshold, p.edit_threshold) == (
            "block", 32, "joint-threshold", values["threshold"], values["edit_threshold"])
