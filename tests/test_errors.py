"""Bad input gets a clear error that says what was wrong."""
import json
import re

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from dllm_engine import LLM, SamplingParams
from dllm_engine.errors import UserError
from dllm_engine.models import load_model
from fixtures import write_checkpoint


@pytest.fixture(scope="module")
def llada(tmp_path_factory):
    return LLM(write_checkpoint(tmp_path_factory.mktemp("llada"), "llada"))


def test_missing_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_model(tmp_path / "nope")


def test_missing_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_model(tmp_path)


def test_missing_weights(tmp_path):
    write_checkpoint(tmp_path, "llada", tokenizer=False)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"no \*.safetensors"):
        load_model(tmp_path)


def test_missing_shard(tmp_path):
    write_checkpoint(tmp_path, "sdar", tokenizer=False, shard_bytes=20_000)
    next(tmp_path.glob("model-*.safetensors")).unlink()
    with pytest.raises(FileNotFoundError, match="missing shards"):
        load_model(tmp_path)


def test_unknown_model_type(tmp_path):
    write_checkpoint(tmp_path, "llada", tokenizer=False)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["model_type"] = "gpt2"
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UserError, match="unknown model_type 'gpt2'.*llada"):
        load_model(tmp_path)


def edit_tensors(folder, fn):
    tensors = load_file(str(folder / "model.safetensors"))
    fn(tensors)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})


def test_missing_and_extra_tensors_are_named(tmp_path):
    write_checkpoint(tmp_path, "llada", tokenizer=False)

    def rename(t):
        t["model.transformer.blocks.0.q_proj.weigh"] = t.pop("model.transformer.blocks.0.q_proj.weight")
    edit_tensors(tmp_path, rename)
    with pytest.raises(UserError, match=r"missing tensors \['model.transformer.blocks.0.q_proj.weight'\]"
                                         r".*unexpected tensors \['model.transformer.blocks.0.q_proj.weigh'\]"):
        load_model(tmp_path)


def test_wrong_shape_is_named(tmp_path):
    write_checkpoint(tmp_path, "sdar", tokenizer=False)

    def shrink(t):
        t["model.layers.1.mlp.up_proj.weight"] = torch.zeros(3, 3)
    edit_tensors(tmp_path, shrink)
    with pytest.raises(UserError, match=r"model.layers.1.mlp.up_proj.weight has shape \(3, 3\)"):
        load_model(tmp_path)


def test_bad_dtype(tmp_path):
    write_checkpoint(tmp_path, "llada", tokenizer=False)
    with pytest.raises(UserError, match="dtype 'float8'"):
        load_model(tmp_path, dtype="float8")


@pytest.mark.parametrize("prompt", ["", "   ", []])
def test_empty_prompt(llada, prompt):
    with pytest.raises(UserError, match="prompt is empty"):
        llada.generate([prompt], SamplingParams(max_new_tokens=8, block_length=8))


def test_out_of_vocab_prompt(llada):
    with pytest.raises(UserError, match=r"outside \[0, 96\)"):
        llada.generate([[1, 999]], SamplingParams(max_new_tokens=8, block_length=8))


def test_prompt_beyond_context(llada):
    with pytest.raises(UserError, match=r"max_new_tokens \(128, 128 canvas slots.*exceed the model's context of 4096"):
        llada.generate([[1] * 4000], SamplingParams(max_new_tokens=128, block_length=32))


def test_any_max_new_tokens_rounds_the_canvas_up_and_cuts_the_answer(llada):
    params = SamplingParams(method="dual-cache", max_new_tokens=10, block_length=8, stop_at_eos=False)
    seq = llada.make_sequence([1, 2], params)
    assert seq.canvas_len == 2 + 16 and seq.blocks == [(2, 10), (10, 18)]
    out = llada.generate([[1, 2]], params)[0]
    assert len(out.token_ids) <= 10 and out.stats.decoded_tokens == 16
    assert out.finish_reason == ("length" if len(out.token_ids) == 10 else "stop")


@pytest.mark.parametrize("steps,msg", [(0, "steps must be a positive integer"), (9, "steps 9 must be <= block_length 8")])
def test_steps_bounds(llada, steps, msg):
    with pytest.raises(UserError, match=msg):
        llada.generate([[1, 2]], SamplingParams(max_new_tokens=8, block_length=8, steps=steps))


@pytest.mark.parametrize("field,value,msg", [
    ("threshold", 0.0, r"threshold must be in \(0, 1\]"),
    ("threshold", 1.5, r"threshold must be in \(0, 1\]"),
    ("temperature", -0.1, "temperature must be >= 0"),
    ("method", "fast", "unknown method 'fast'"),
    ("remasking", "best", "remasking must be one of"),
    ("max_new_tokens", 0, "max_new_tokens must be a positive integer"),
    ("factor", -1.0, "factor must be > 0"),
])
def test_bad_sampling_params(field, value, msg):
    with pytest.raises(UserError, match=msg):
        SamplingParams(**{field: value})


@pytest.mark.parametrize("field,value,msg", [
    ("threshold", "0.5", "threshold must be a number, got '0.5'"),
    ("cfg_scale", None, r"cfg_scale must not be None \(a number\)"),
    ("max_new_tokens", True, "max_new_tokens must be an integer, got True"),
    ("min_length", 1.5, "min_length must be an integer, got 1.5"),
    ("stop_at_eos", "no", "stop_at_eos must be true or false, got 'no'"),
    ("delay_eos", "no", "delay_eos must be true or false"),
    ("logprobs", True, "logprobs must be an integer"),
    ("stop_token_ids", 5, "stop_token_ids must be a list of integers, got 5"),
    ("stop_token_ids", [-5], "stop_token_ids must be token ids >= 0"),
    ("stop_token_ids", [2**64], r"stop_token_ids must fit in 64 bits"),
    ("min_length", 10**30, r"min_length must fit in 64 bits"),
    ("keep_fractions", ("a",), "keep_fractions must be a list of numbers"),
    ("method", 3, "method must be a string"),
])
def test_values_of_the_wrong_type_are_refused_by_name(field, value, msg):
    with pytest.raises(UserError, match=msg) as err:
        SamplingParams(**{field: value})
    assert err.value.param == field


def test_numpy_integers_are_integers(llada):
    params = SamplingParams(max_new_tokens=np.int64(8), block_length=8, seed=np.int32(3),
                            stop_token_ids=[np.int64(7)])
    assert type(params.seed) is int and params.stop_token_ids == [7] and type(params.stop_token_ids[0]) is int
    ids = [np.int64(5), np.int64(6), 7]
    assert llada.generate([ids], params)[0].token_ids == llada.generate([[5, 6, 7]], params)[0].token_ids


@pytest.mark.parametrize("prompts,msg", [
    ([b"sort : a"], "a prompt is a string or a list of token ids, got bytes"),
    (None, "prompts are a string, a list of token ids, or a list of those; got NoneType"),
    ([[1, 2.5]], "a token-id prompt holds integers only, got float, int"),
    ([np.array([1, 2])], r"got ndarray \(pass .tolist\(\)\)"),
    (torch.tensor([1, 2]), r"got Tensor \(pass .tolist\(\)\)"),
])
def test_prompts_of_the_wrong_type_are_refused(llada, prompts, msg):
    with pytest.raises(UserError, match=msg):
        llada.generate(prompts, SamplingParams(max_new_tokens=8, block_length=8))


def test_a_prompt_holding_the_mask_token_is_refused(llada):
    """Block diffusion would fill a mask in the prompt's last block (and count it decoded)."""
    mask = llada.token_ids.mask_id
    with pytest.raises(UserError, match=rf"prompt holds the mask token \(id {mask}\)"):
        llada.generate([[5, mask, 6]], SamplingParams(max_new_tokens=8, block_length=8))
    assert not llada.engine.has_work()


def test_params_must_be_sampling_params_and_stop_ids_in_the_vocabulary(llada):
    with pytest.raises(UserError, match=r"params must be a SamplingParams, got dict \(SamplingParams\(\*\*params\)\)"):
        llada.generate([[1, 2]], {"max_new_tokens": 8})
    vocab = llada.model.config.vocab_size
    with pytest.raises(UserError, match=rf"stop_token_ids must be ids in \[0, {vocab}\)") as err:
        llada.generate([[1, 2]], SamplingParams(max_new_tokens=8, block_length=8, stop_token_ids=[vocab]))
    assert err.value.param == "stop_token_ids"
    assert not llada.engine.has_work()


def test_method_the_family_cannot_run(llada):
    with pytest.raises(UserError, match="method 'block' cannot run on this model's attention pattern"):
        llada.generate([[1, 2]], SamplingParams(method="block", max_new_tokens=8, block_length=8))


def test_chat_needs_a_conversation(llada):
    with pytest.raises(UserError, match="conversation is empty"):
        llada.chat([[]])
    with pytest.raises(UserError, match="a conversation is a list of messages"):
        llada.chat("hello")


@pytest.mark.parametrize("field,value", [
    ("temperature", float("nan")), ("temperature", float("inf")), ("threshold", float("nan")),
    ("factor", float("nan")), ("cfg_scale", float("nan")), ("eos_threshold", float("nan")),
    ("focus_alpha", float("inf")), ("skip_alpha", float("nan")), ("top_p", float("nan")),
    ("keep_fractions", (1.0, float("nan"), 0.25))])
def test_non_finite_numbers_are_refused_by_name(field, value):
    with pytest.raises(UserError, match=f"{field} must be a finite number"):
        SamplingParams(**{field: value})


@pytest.mark.parametrize("seed", [-1, 2**63, 2**70])
def test_seed_out_of_range_names_the_field(seed):
    with pytest.raises(UserError, match=r"seed must be an integer in \[0, 2\*\*63\)") as err:
        SamplingParams(seed=seed)
    assert err.value.param == "seed"


def test_a_long_prompt_gets_the_engines_error_not_a_tokenizer_warning(llada, capfd):
    with pytest.raises(UserError, match="exceed the model's context of 4096"):
        llada.generate(["sort : " + "a " * 5000], SamplingParams(max_new_tokens=8, block_length=8))
    captured = capfd.readouterr()
    assert "longer than the specified maximum" not in captured.err + captured.out


@pytest.mark.parametrize("name,text,message", [
    ("config.json", "[1, 2]", "config.json: expected a JSON object of model settings, got a JSON list"),
    ("config.json", '{"model_type": "llada"', "config.json: invalid JSON at line 1"),
    ("generation_config.json", "[]", "generation_config.json: expected a JSON object"),
    ("model.safetensors", "", "model.safetensors: not a readable safetensors file"),
    ("model.safetensors.index.json", '{"weight_map": 3}', "no \"weight_map\" object")])
def test_malformed_checkpoint_files_are_named(tmp_path, name, text, message):
    write_checkpoint(tmp_path, "llada")
    (tmp_path / name).write_text(text)
    with pytest.raises(UserError, match=re.escape(f"{tmp_path / name}") + ".*" + re.escape(message.split(": ", 1)[-1])):
        LLM(tmp_path)


def test_config_missing_a_key_is_named(tmp_path):
    write_checkpoint(tmp_path, "sdar", tokenizer=False)
    cfg = json.loads((tmp_path / "config.json").read_text())
    del cfg["hidden_size"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UserError, match=r"config.json: missing key 'hidden_size' \(needed by model_type 'sdar'\)"):
        load_model(tmp_path)


@pytest.mark.parametrize("device,message", [("tpu", "is not a device name"), ("cuda", "is not available"),
                                            ("cuda:7", "is not available")])
def test_devices_this_build_cannot_use(tmp_path, device, message):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    write_checkpoint(tmp_path, "llada", tokenizer=False)
    with pytest.raises(UserError, match=f"device '{device}' {message}"):
        LLM(tmp_path, device=device)
