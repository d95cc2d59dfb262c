"""Checkpoints that carry the real models' config keys load and serve: fake checkpoints written with
the fixtures' tiny random models, with config.json / generation_config.json / tokenizer files edited
the way the released LLaDA-8B, Dream-v0-7B, SDAR and LLaDA2.0-mini ones are (notes/model_families.md,
notes/llada2.md)."""
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from dllm_engine import LLM, SamplingParams
from dllm_engine.methods import FULL_ATTENTION_METHODS
from dllm_engine.models import load_model, read_config, save_model
from dllm_engine.resolve import resolve_params
from fixtures import random_model, write_checkpoint, write_llada2_checkpoint

SMALL = SamplingParams(max_new_tokens=8, block_length=8)
DROP = object()  # edit_json: remove the key


def edit_json(file: Path, **changes) -> dict:
    """Set keys of a JSON file (created when absent); a key set to ``DROP`` is removed."""
    value = json.loads(file.read_text()) if file.is_file() else {}
    for key, v in changes.items():
        if v is DROP:
            value.pop(key, None)
        else:
            value[key] = v
    file.write_text(json.dumps(value, indent=2))
    return value


def edit_tensors(folder: Path, fn) -> None:
    tensors = load_file(str(folder / "model.safetensors"))
    fn(tensors)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})


# -- a Qwen2-style byte-level BPE tokenizer, as Dream's vocab.json + merges.txt -------------------
DREAM_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|beginoftext|>", "<|mask|>"]
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
REMOTE_CODE = "from pathlib import Path\nPath(__file__).with_suffix('.ran').write_text('ran')\nraise SystemExit\n"


def write_bpe_tokenizer(folder: Path, specials: list[str], tokenizer_class: str = "DreamTokenizer",
                        remote_code: bool = True, tokenizer_json: bool = False, **config) -> dict[str, int]:
    """vocab.json + merges.txt of a tiny byte-level BPE (all 256 bytes, a few merges), the special
    tokens after it, and a tokenizer_config.json naming ``tokenizer_class`` (with Dream's auto_map
    and a tokenization_dream.py that leaves a marker if anything ever runs it). Returns the
    special tokens' ids."""
    from tokenizers import AddedToken, Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import BPE

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    merges = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "s"), ("Ġ", "c"), ("a", "t")]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    ids = {s: len(vocab) + i for i, s in enumerate(specials)}
    (folder / "vocab.json").write_text(json.dumps(vocab))
    (folder / "merges.txt").write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges))
    added = {str(i): {"content": s, "lstrip": False, "normalized": False, "rstrip": False,
                      "single_word": False, "special": True} for s, i in ids.items()}
    tok_config = {"added_tokens_decoder": added, "tokenizer_class": tokenizer_class,
                  "clean_up_tokenization_spaces": False, "model_max_length": 131072, **config}
    if remote_code:
        tok_config["auto_map"] = {"AutoTokenizer": ["tokenization_dream.DreamTokenizer", None]}
        (folder / "tokenization_dream.py").write_text(REMOTE_CODE)
    (folder / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2))
    if tokenizer_json:  # a byte-level BPE over the same vocabulary and merges
        backend = Tokenizer(BPE(vocab=dict(vocab), merges=merges))
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        backend.decoder = decoders.ByteLevel()
        backend.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
        backend.save(str(folder / "tokenizer.json"))
    return ids


def tokenizer_vocab(ids: dict[str, int]) -> int:
    return max(ids.values()) + 8  # the embedding has spare rows, as the real ones do


def write_dream(folder: Path, tokenizer_json: bool = False, **overrides) -> tuple[Path, dict[str, int]]:
    """A Dream-v0-Instruct-7B-shaped checkpoint: Qwen2 config keys, DreamTokenizer (remote code)
    over vocab.json + merges.txt, and Dream's own generation_config.json."""
    folder.mkdir(parents=True, exist_ok=True)
    ids = write_bpe_tokenizer(folder, DREAM_SPECIALS, tokenizer_json=tokenizer_json,
                              bos_token="<|beginoftext|>", eos_token="<|endoftext|>",
                              pad_token="<|endoftext|>", mask_token="<|mask|>", unk_token=None,
                              chat_template=CHATML, add_bos_token=False)
    write_checkpoint(folder, "Dream", tokenizer=False, vocab_size=tokenizer_vocab(ids),
                     mask_token_id=ids["<|mask|>"], eos_token_id=ids["<|endoftext|>"],
                     pad_token_id=ids["<|endoftext|>"], bos_token_id=ids["<|endoftext|>"], **overrides)
    edit_json(folder / "config.json", sliding_window=None, use_sliding_window=False, rope_scaling=None,
              max_window_layers=28, attention_dropout=0.0, transformers_version="4.46.2")
    # Dream-org/Dream-v0-Instruct-7B's generation_config.json
    (folder / "generation_config.json").write_text(json.dumps({
        "_from_model_config": True, "alg": "origin", "alg_temp": None, "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": ids["<|endoftext|>"], "eps": 0.001, "mask_token_id": None, "output_history": False,
        "pad_token_id": ids["<|endoftext|>"], "steps": 512, "temperature": 0.0, "top_k": None,
        "top_p": None, "transformers_version": "4.46.2"}, indent=2))
    return folder, ids


# -- 1. Dream's generation_config.json: steps 512 over the whole answer, mask_token_id null ----------
def test_dream_generation_config_steps_and_null_mask_do_not_stop_the_model(tmp_path):
    folder, ids = write_dream(tmp_path / "dream")
    # serve's front resolves the defaults on the meta device before anything else
    assert LLM(folder, device="meta").resolve().steps == 32  # = block_length: Dream's 512 is ignored
    llm = LLM(folder)
    assert llm.token_ids.mask_id == ids["<|mask|>"]
    p = llm.resolve()
    assert (p.steps, p.block_length, p.temperature) == (32, 32, 0.0)
    out = llm.generate([[ids["<|im_start|>"], 70, 71, 72]], SMALL)
    assert len(out[0].token_ids) <= 8


def test_a_null_mask_id_everywhere_falls_back_to_the_tokenizer(tmp_path):
    folder = write_checkpoint(tmp_path, "Dream")  # the project tokenizer: <|mdm_mask|> = 4
    edit_json(folder / "config.json", mask_token_id=None, eos_token_id=None)
    edit_json(folder / "generation_config.json", mask_token_id=None, eos_token_id=[None, 3])
    llm = LLM(folder)
    assert (llm.token_ids.mask_id, llm.token_ids.eos_id) == (4, 3)


def test_generation_config_steps_count_only_beside_block_length():
    """The engine's own exports write block_length with steps (train/trainer.py): steps per block."""
    assert resolve_params(SamplingParams(method="reference"), FULL_ATTENTION_METHODS,
                          {"steps": 512}).steps == 32
    assert resolve_params(SamplingParams(method="reference"), FULL_ATTENTION_METHODS,
                          {"steps": 8, "block_length": 16}).steps == 8
    with pytest.raises(ValueError, match="steps 64 must be <= block_length 16"):
        resolve_params(SamplingParams(method="reference"), FULL_ATTENTION_METHODS,
                       {"steps": 64, "block_length": 16})


# -- 2. Dream's tokenizer: DreamTokenizer + auto_map (remote code) -----------------------------------
@pytest.mark.slow  # over 2 s on 2 busy cores
@pytest.mark.parametrize("tokenizer_json", [False, True], ids=["vocab+merges", "tokenizer.json"])
def test_dream_tokenizer_loads_without_its_remote_code(tmp_path, tokenizer_json):
    folder, ids = write_dream(tmp_path / "dream", tokenizer_json=tokenizer_json)
    llm = LLM(folder)
    tok = llm.tokenizer
    assert tok is not None
    assert not (folder / "tokenization_dream.ran").exists()  # the remote code never ran
    assert (tok.mask_token_id, tok.eos_token_id, tok.pad_token_id) == (
        ids["<|mask|>"], ids["<|endoftext|>"], ids["<|endoftext|>"])
    assert tok.convert_tokens_to_ids("<|im_end|>") == ids["<|im_end|>"]
    text = "the cat is here"
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    assert tok.encode(" the", add_special_tokens=False) == [json.loads((folder / "vocab.json").read_text())["Ġthe"]]
    prompt = llm.apply_chat_template([{"role": "user", "content": "hi"}])
    assert tok.decode(prompt) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert ids["<|im_end|>"] in llm.token_ids.stop_ids  # Dream's end of turn
    out = llm.chat([{"role": "user", "content": "the cat"}], SMALL)
    assert out[0].text == tok.decode(out[0].token_ids, skip_special_tokens=True)
    # a text prompt is its encoding: the same tokens as the token-id prompt
    assert llm.generate("the cat", SMALL)[0].token_ids == llm.generate([llm.encode("the cat")], SMALL)[0].token_ids


def test_a_tokenizer_that_cannot_load_leaves_token_prompts_working(tmp_path):
    folder, ids = write_dream(tmp_path / "dream")
    (folder / "vocab.json").unlink()  # DreamTokenizer with nothing to build it from
    with pytest.warns(UserWarning, match="the tokenizer cannot be loaded.*continuing without one"):
        llm = LLM(folder)
    assert llm.tokenizer is None
    assert not (folder / "tokenization_dream.ran").exists()
    assert llm.token_ids.mask_id == ids["<|mask|>"]
    assert len(llm.generate([[5, 6, 7]], SMALL)[0].token_ids) <= 8
    with pytest.raises(ValueError, match="has no tokenizer; pass token-id prompts"):
        llm.generate("the cat", SMALL)


def test_a_broken_tokenizer_json_warns_once(tmp_path):
    folder = write_checkpoint(tmp_path, "llada")
    (folder / "tokenizer.json").write_text("{not json")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        llm = LLM(folder)
    assert llm.tokenizer is None
    assert len([w for w in caught if "tokenizer cannot be loaded" in str(w.message)]) == 1


# -- 3. LLaDA2.0-mini: no mask id in config.json / generation_config.json / tokenizer_config --------
LLADA2_SPECIALS = ["<|endoftext|>", "<role>", "</role>", "<|role_end|>", "<|mask|>"]


def test_llada2_mask_and_end_of_turn_come_from_the_tokens_names(tmp_path):
    folder = tmp_path / "llada2"
    folder.mkdir()
    ids = write_bpe_tokenizer(folder, LLADA2_SPECIALS, tokenizer_class="PreTrainedTokenizerFast",
                              remote_code=False, tokenizer_json=True, eos_token="<|endoftext|>",
                              pad_token="<|endoftext|>")
    write_llada2_checkpoint(folder, tokenizer=False, vocab_size=tokenizer_vocab(ids))
    # the released config.json: pad only (156892), no eos / mask / bos
    edit_json(folder / "config.json", mask_token_id=DROP, eos_token_id=DROP, bos_token_id=DROP,
              pad_token_id=ids["<|endoftext|>"])
    llm = LLM(folder)
    assert llm.tokenizer.mask_token_id is None  # nothing declares it
    assert llm.token_ids.mask_id == ids["<|mask|>"]
    assert llm.token_ids.eos_id == ids["<|endoftext|>"]
    assert llm.token_ids.stop_ids == {ids["<|endoftext|>"], ids["<|role_end|>"]}
    assert len(llm.generate([[70, 71, 72]], SamplingParams(max_new_tokens=8))[0].token_ids) <= 8


def test_an_unknown_mask_token_is_not_taken_for_the_unknown_token(tmp_path):
    folder = write_checkpoint(tmp_path, "llada2_moe")  # word tokenizer with an <|unk|> token, no <|mask|>
    edit_json(folder / "config.json", mask_token_id=DROP)
    edit_json(folder / "tokenizer_config.json", mask_token=DROP)
    edit_json(folder / "special_tokens_map.json", mask_token=DROP)
    with pytest.raises(ValueError, match=r"no mask_token_id .* \(nor a <\|mask\|> token\)"):
        LLM(folder)


# -- 4. dtype: "auto" is the checkpoint's; the model is built in it, read tensor by tensor ---------
def write_bf16(folder: Path, model_type: str = "llada2_moe", **config) -> dict:
    """A bf16 checkpoint (as every released model's weights) with ``config`` set in config.json."""
    if model_type == "llada2_moe":
        write_llada2_checkpoint(folder, tokenizer=False)
        model = load_model(folder)
    else:
        model = random_model(model_type)
    save_model(model.to(torch.bfloat16), folder, model.family)
    edit_json(folder / "config.json", **config)
    return load_file(str(folder / "model.safetensors"))


@pytest.mark.slow  # over 2 s on 2 busy cores
@pytest.mark.parametrize("key", ["torch_dtype", "dtype"])  # transformers 4 / 5
def test_auto_dtype_is_the_configs(tmp_path, key):
    stored = write_bf16(tmp_path, **{"torch_dtype": DROP, key: "bfloat16"})
    llm = LLM(tmp_path)  # the default is "auto"
    model = llm.model
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    bias = model.layers[1].mlp.gate.expert_bias
    assert bias.dtype == torch.float32  # the router's bias stays fp32, as in SGLang
    assert torch.equal(bias, stored["model.layers.1.mlp.gate.expert_bias"].float())
    assert torch.equal(model.embed_tokens.weight, stored["model.word_embeddings.weight"])
    assert len(llm.generate([[5, 6, 7]], SamplingParams(max_new_tokens=8))[0].token_ids) <= 8
    # an explicit dtype still wins
    assert {p.dtype for p in load_model(tmp_path, dtype="float32").parameters()} == {torch.float32}


def test_auto_dtype_without_a_config_key_is_the_stored_one(tmp_path):
    """LLaDA-8B's config.json has no torch_dtype ("precision": "amp_bf16"); its weights are bf16."""
    write_bf16(tmp_path, "llada", torch_dtype=DROP, precision="amp_bf16")
    assert {p.dtype for p in LLM(tmp_path).model.parameters()} == {torch.bfloat16}


def test_embedded_checkpoints_stay_float32():
    root = Path(__file__).resolve().parents[1] / "checkpoints"
    for name in ("tiny-llada", "tiny-sdar"):
        assert {p.dtype for p in LLM(root / name, device="meta").model.parameters()} == {torch.float32}


def test_cli_dtype_defaults_to_auto():
    import argparse

    from dllm_engine.cli.common import add_model_args
    parser = argparse.ArgumentParser()
    add_model_args(parser)
    assert parser.parse_args([]).dtype == "auto"


PEAK_SCRIPT = """
import sys
import torch
from dllm_engine.models import load_model
def status(key):  # kB; VmHWM: this process's peak resident memory (ru_maxrss would count the parent's)
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))
load_model(sys.argv[1], device="meta")  # the code's own first-use costs (torch's meta kernels), no weights
before = status("VmRSS")
model = load_model(sys.argv[1], dtype="bfloat16")
assert next(model.parameters()).dtype == torch.bfloat16
print(status("VmHWM") - before)
"""


@pytest.mark.slow  # a full-size load
def test_loading_holds_about_one_copy_of_the_weights(tmp_path):
    """Peak memory of a bf16 load: the bf16 model plus one shard, not the checkpoint read whole,
    an fp32 model and its bf16 cast (3.4x the checkpoint before)."""
    model = random_model("llada", hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=8,
                         intermediate_size=1536).to(torch.bfloat16)
    save_model(model, tmp_path, model.family, max_shard_bytes=6_000_000)
    size = sum(p.numel() * 2 for p in model.parameters())
    del model
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-c", PEAK_SCRIPT, str(tmp_path)], capture_output=True,
                         text=True, timeout=300, env=env, cwd=root)
    assert out.returncode == 0, out.stderr
    peak = int(out.stdout.split()[-1])
    assert peak < 1.5 * size, f"peak {peak / 2**20:.0f} MiB for a {size / 2**20:.0f} MiB checkpoint"


# -- 5. generation_config.json sampling keys honour do_sample -------------------------------------
QWEN3_SAMPLING = {"temperature": 0.6, "top_p": 0.95, "top_k": 20}


@pytest.mark.parametrize("do_sample", [None, False])
def test_sampling_keys_without_do_sample_are_ignored(tmp_path, do_sample):
    folder = write_checkpoint(tmp_path, "sdar")
    gen = {"bos_token_id": 2, "eos_token_id": [3, 9], **QWEN3_SAMPLING}
    if do_sample is not None:
        gen["do_sample"] = do_sample
    (folder / "generation_config.json").write_text(json.dumps(gen))
    p = LLM(folder).resolve()
    assert (p.temperature, p.top_p, p.top_k) == (0.0, 1.0, 0)


def test_sampling_keys_with_do_sample_apply():
    p = resolve_params(SamplingParams(), FULL_ATTENTION_METHODS, {"do_sample": True, **QWEN3_SAMPLING})
    assert (p.temperature, p.top_p, p.top_k) == (0.6, 0.95, 20)
    p = resolve_params(SamplingParams(), FULL_ATTENTION_METHODS, {"do_sample": True})
    assert p.temperature == 1.0  # transformers' default temperature when sampling
    p = resolve_params(SamplingParams(temperature=0.0), FULL_ATTENTION_METHODS, {"do_sample": True, **QWEN3_SAMPLING})
    assert p.temperature == 0.0  # the request wins


# -- 6. RoPE and other config options the engine does not implement -------------------------------
def test_rope_parameters_of_transformers_5_give_rope_theta(tmp_path):
    folder = write_checkpoint(tmp_path, "sdar", tokenizer=False)
    edit_json(folder / "config.json", rope_theta=DROP,
              rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    _, _, cfg = read_config(folder)
    assert cfg.rope_theta == 1000000.0
    folder = write_checkpoint(tmp_path / "llada2", "llada2_moe", tokenizer=False, rotary_dim=4)
    edit_json(folder / "config.json", rope_theta=DROP, partial_rotary_factor=DROP, rotary_dim=DROP,
              rope_parameters={"rope_type": "default", "rope_theta": 600000.0, "partial_rotary_factor": 0.5})
    _, _, cfg = read_config(folder)
    assert (cfg.rope_theta, cfg.rotary_dim) == (600000.0, 4)


YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}


@pytest.mark.parametrize("model_type,changes,message", [
    ("Dream", {"rope_scaling": YARN}, "rope_scaling .* is not supported for Dream"),
    ("sdar", {"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_scaling .* is not supported for sdar"),
    ("sdar", {"rope_parameters": {**YARN, "rope_theta": 1e6}}, "rope_parameters .* is not supported for sdar"),
    ("llada", {"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "rope_scaling .* is not supported for llada"),
    ("llada2_moe", {"rope_scaling": YARN}, "rope_scaling .* is not supported for llada2_moe"),
    ("Dream", {"use_sliding_window": True, "sliding_window": 4096}, "use_sliding_window=True is not supported"),
    ("sdar", {"use_sliding_window": True}, "use_sliding_window=True is not supported"),
    ("llada", {"attention_layer_norm": True}, "attention_layer_norm=True is not supported for llada"),
    ("llada", {"scale_logits": True}, "scale_logits=True is not supported for llada"),
    ("llada", {"clip_qkv": 8.0}, "clip_qkv=8.0 is not supported for llada"),
    ("llada", {"block_type": "sequential"}, "block_type='sequential' is not supported for llada"),
    ("llada2_moe", {"norm_head": True}, "norm_head=True is not supported for llada2_moe"),
])
def test_unimplemented_config_options_are_refused(tmp_path, model_type, changes, message):
    folder = write_checkpoint(tmp_path, model_type, tokenizer=False)
    edit_json(folder / "config.json", **changes)
    with pytest.raises(ValueError, match="config.json: " + message):
        load_model(folder)


@pytest.mark.parametrize("model_type", ["llada", "Dream", "sdar"])
def test_default_rope_settings_still_load(tmp_path, model_type):
    folder = write_checkpoint(tmp_path, model_type, tokenizer=False)
    want = load_model(folder)(torch.tensor([[5, 6, 7, 8]]))
    edit_json(folder / "config.json", rope_scaling={"rope_type": "default"}, use_sliding_window=False,
              sliding_window=131072, clip_qkv=None)
    assert torch.equal(load_model(folder)(torch.tensor([[5, 6, 7, 8]])), want)


# -- 7. end-of-turn tokens stop generation -------------------------------------------------------
@pytest.mark.parametrize("model_type,end_of_turn", [("llada", 7), ("Dream", 9), ("sdar", 9)])
def test_the_familys_end_of_turn_token_is_a_stop_id(tmp_path, model_type, end_of_turn):
    folder = write_checkpoint(tmp_path, model_type)  # no generation_config.json: eos 3 alone before
    assert LLM(folder).token_ids.stop_ids == {3, end_of_turn}


def test_embedded_checkpoints_stop_ids_are_unchanged():
    root = Path(__file__).resolve().parents[1] / "checkpoints"
    assert LLM(root / "tiny-llada", device="meta").token_ids.stop_ids == {3, 7}
    assert LLM(root / "tiny-sdar", device="meta").token_ids.stop_ids == {3, 9}


# -- 8. tied heads stored anyway, stray inv_freq ------------------------------------------------
@pytest.mark.parametrize("model_type,head", [("sdar", "lm_head.weight"),
                                             ("llada", "model.transformer.ff_out.weight")])
def test_a_tied_checkpoint_that_stores_its_head_loads(tmp_path, model_type, head):
    folder = write_checkpoint(tmp_path, model_type, tokenizer=False, tie_word_embeddings=True)
    want = load_model(folder)(torch.tensor([[5, 6, 7, 8]]))

    def add(t):
        embedding = t["model.embed_tokens.weight" if model_type == "sdar" else "model.transformer.wte.weight"]
        t[head] = embedding.clone()  # SDAR-1.7B (tied, from Qwen3-1.7B) stores both
        t["model.rotary_emb.inv_freq"] = torch.ones(4)
        t["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(4)
    edit_tensors(folder, add)
    model = load_model(folder)
    assert model.lm_head.weight is model.embed_tokens.weight
    assert torch.equal(model(torch.tensor([[5, 6, 7, 8]])), want)


def test_an_untied_checkpoint_still_refuses_stray_tensors(tmp_path):
    folder = write_checkpoint(tmp_path, "sdar", tokenizer=False)
    edit_tensors(folder, lambda t: t.update({"model.extra.weight": torch.ones(2)}))
    with pytest.raises(ValueError, match=r"unexpected tensors \['model.extra.weight'\]"):
        load_model(folder)


# -- all of it at once: a Dream-shaped checkpoint as downloaded --------------------------------
def test_a_dream_shaped_download_serves_with_default_arguments(tmp_path):
    folder, ids = write_dream(tmp_path / "dream")
    stored = load_model(folder)
    save_model(stored.to(torch.bfloat16), folder, stored.family)
    edit_json(folder / "config.json", torch_dtype="bfloat16", use_sliding_window=False, sliding_window=None,
              rope_scaling=None)
    llm = LLM(folder)
    assert next(llm.model.parameters()).dtype == torch.bfloat16
    assert llm.tokenizer is not None and llm.token_ids.mask_id == ids["<|mask|>"]
    out = llm.chat([{"role": "user", "content": "the cat"}], SMALL)
    assert out[0].finish_reason in ("stop", "length")


# -- 7. LLaDA-MoE-7B-A1B-Instruct: model_type "llada" with MoE keys; mask id absent, found by name ---
# NOT a verbatim copy: the released config.json (inclusionAI/LLaDA-MoE-7B-A1B-Instruct, 64 lines) is
# not stored where this project can read it. Every key below is one the released config class
# reads (inclusionAI/dInfer tools/configuration_lladamoe.py); the values are those the sources
# agree on:
# - model_type "llada" + LLaDAMoEModelLM: ZHZisZZ/dllm README ("set model_type to lladamoe" in
#   place of the released "llada"), llama.cpp convert_hf_to_gguf.py (LLaDAMoEModelLM);
# - 16 layers, d 2048, 16 heads x 128 without GQA, 64 experts of 1024 top-8, no shared expert,
#   every layer MoE, eos / pad 156892: a CPU meta-load of the release reported in a public
#   project's notes (found in the code index) and an LLaDA-MoE vLLM port's notes (dense 8192,
#   rope_theta 50000, max_position_embeddings 8192, qk_layernorm true, router_aux_loss_coef 0.01);
#   llama.cpp's llada-moe.cpp (16 layers = A1.7B, q/k norms, head rotated whole, untied output,
#   no expert-bias or shared-expert tensor);
# - vocab_size 157184: assumed LLaDA2.0's (same tokenizer: mask 156895, eos 156892);
# - rms_norm_eps 1e-05: the config class's default (the value was not found).
LLADA_MOE_INSTRUCT_CONFIG = {
    "architectures": ["LLaDAMoEModelLM"],
    "auto_map": {"AutoConfig": "configuration_lladamoe.LLaDAConfig",
                 "AutoModel": "modeling_lladamoe.LLaDAMoEModelLM",
                 "AutoModelForCausalLM": "modeling_lladamoe.LLaDAMoEModelLM"},
    "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": None, "clip_qkv": None,
    "dense_intermediate_size": 8192, "eos_token_id": 156892, "expert_intermediate_size": 1024,
    "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02, "max_position_embeddings": 8192,
    "model_type": "llada", "moe_layer_freq": [1] * 16, "moe_router_enable_expert_bias": None,
    "moe_router_score_function": None, "norm_topk_prob": None, "num_attention_heads": 16,
    "num_experts": 64, "num_experts_per_tok": 8, "num_hidden_layers": 16, "num_key_value_heads": 16,
    "output_router_logits": False, "pad_token_id": 156892, "partial_rotary_factor": 1,
    "qk_layernorm": True, "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 50000,
    "router_aux_loss_coef": 0.01, "shared_expert_intermediate_size": None, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "transformers_version": "4.46.2", "use_cache": False, "vocab_size": 157184,
}
# the release's special tokens at their ids (<|role_end|> 156900: a public project's notes)
LLADA_MOE_SPECIALS = {"<|endoftext|>": 156892, "<|mask|>": 156895, "<|role_end|>": 156900}


def write_llada_moe_release(folder: Path, **changes) -> Path:
    """The release's config.json (``changes`` applied) and a word-level tokenizer holding its
    special tokens at their ids (no weights: load it on the meta device)."""
    from tokenizers import AddedToken, Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({**LLADA_MOE_INSTRUCT_CONFIG, **changes}, indent=2))
    tok = Tokenizer(WordLevel({"<|unk|>": 0, "hello": 1, **LLADA_MOE_SPECIALS}, unk_token="<|unk|>"))
    tok.pre_tokenizer = WhitespaceSplit()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in LLADA_MOE_SPECIALS])
    tok.save(str(folder / "tokenizer.json"))
    edit_json(folder / "tokenizer_config.json", tokenizer_class="PreTrainedTokenizerFast",
              eos_token="<|endoftext|>", pad_token="<|endoftext|>", unk_token="<|unk|>")
    return folder


def test_llada_moe_release_config_loads_with_its_shapes_and_ids(tmp_path):
    _, family, cfg = read_config(write_llada_moe_release(tmp_path / "llada-moe"))
    assert family.model_type == "llada_moe" and family.methods == FULL_ATTENTION_METHODS
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (
        16, 2048, 16, 16, 128)
    assert (cfg.vocab_size, cfg.rope_theta, cfg.rotary_dim, cfg.max_position_embeddings) == (
        157184, 50000, 128, 8192)
    assert cfg.qk_norm and not cfg.tie_word_embeddings and not cfg.is_block_causal and cfg.logit_shift == 0
    moe = cfg.moe
    assert (moe.num_experts, moe.num_experts_per_tok, moe.moe_intermediate_size) == (64, 8, 1024)
    assert (moe.first_k_dense_replace, moe.num_shared_experts, moe.expert_bias) == (0, 0, False)
    assert (moe.score_function, moe.norm_topk_prob) == ("softmax", False)


def test_llada_moe_release_ids_dtype_and_size_on_the_meta_device(tmp_path):
    """One layer of the release (building 16 takes seconds): the ids, the dtype, and the size
    the 16 layers add up to (7.36B, as reported for the release)."""
    folder = write_llada_moe_release(tmp_path / "llada-moe", num_hidden_layers=1, moe_layer_freq=[1])
    llm = LLM(folder, device="meta")  # no weights
    assert llm.model.lm_head.weight.shape == (157184, 2048) and len(llm.model.layers[0].mlp.experts) == 64
    layer = sum(p.numel() for p in llm.model.layers[0].parameters())
    assert sum(p.numel() for p in llm.model.parameters()) + 15 * layer == pytest.approx(7.36e9, rel=1e-3)
    assert llm.token_ids.mask_id == 156895  # config.json has none: the tokenizer's <|mask|>
    assert (llm.token_ids.eos_id, llm.token_ids.stop_ids) == (156892, {156892, 156900})
    assert llm.resolve().method == "dual-cache"
    assert next(llm.model.parameters()).dtype == torch.bfloat16  # "auto": the config's torch_dtype
