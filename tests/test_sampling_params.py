"""One resolution of defaults: the request's value, then generation_config.json, then the
documented default, the same for the Python API, the CLI and the server."""
import json
import re

import pytest
from fastapi.testclient import TestClient

from dllm_engine import LLM, SamplingParams
from dllm_engine.cli import main
from dllm_engine.methods import BLOCK_METHODS, FULL_ATTENTION_METHODS
from dllm_engine.resolve import resolve_params
from dllm_engine.server import create_app
from fixtures import write_checkpoint

FULL = FULL_ATTENTION_METHODS


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    return LLM(write_checkpoint(tmp_path_factory.mktemp("llada"), "llada"))


@pytest.mark.parametrize("method,rule", [
    (None, ("dual-cache", 0.9, None, 32)), ("reference", ("reference", None, None, 32)),
    ("prefix-cache", ("prefix-cache", 0.9, None, 32)), ("dual-cache+early-skip", ("dual-cache+early-skip", 0.9, None, 32))])
def test_documented_defaults(method, rule):
    p = resolve_params(SamplingParams(method=method), FULL)
    assert (p.method, p.threshold, p.factor, p.steps) == rule
    assert (p.max_new_tokens, p.block_length, p.temperature, p.top_p, p.top_k) == (128, 32, 0.0, 1.0, 0)


def test_block_defaults_to_dynamic_threshold_and_steps_to_static():
    p = resolve_params(SamplingParams(), BLOCK_METHODS)
    assert (p.method, p.unmasking, p.threshold) == ("block", "low_confidence_dynamic", 0.9)
    p = resolve_params(SamplingParams(steps=8), BLOCK_METHODS)
    assert (p.unmasking, p.threshold, p.steps) == ("low_confidence_static", None, 8)
    p = resolve_params(SamplingParams(unmasking="low_confidence_dynamic", steps=8), BLOCK_METHODS)
    assert (p.unmasking, p.threshold) == ("low_confidence_dynamic", 0.9)


def test_the_commit_rule_is_chosen_as_a_whole():
    # steps alone asks for fixed steps: no default threshold sneaks in beside it
    assert resolve_params(SamplingParams(method="dual-cache", steps=8), FULL).threshold is None
    p = resolve_params(SamplingParams(method="dual-cache", factor=1.0), FULL, {"threshold": 0.7})
    assert (p.factor, p.threshold) == (1.0, None)


def test_generation_config_comes_between_the_request_and_the_defaults():
    gen = {"max_new_tokens": 64, "block_length": 16, "threshold": 0.7, "temperature": 0.5, "do_sample": True,
           "eos_token_id": 3, "transformers_version": "4.53"}  # keys that are not options are ignored
    p = resolve_params(SamplingParams(), FULL, gen)
    assert (p.max_new_tokens, p.block_length, p.threshold, p.temperature) == (64, 16, 0.7, 0.5)
    p = resolve_params(SamplingParams(max_new_tokens=32, threshold=0.95, temperature=0.0), FULL, gen)
    assert (p.max_new_tokens, p.block_length, p.threshold, p.temperature) == (32, 16, 0.95, 0.0)
    assert resolve_params(SamplingParams(method="reference"), FULL, {"steps": 4, "block_length": 32}).steps == 4


def test_a_bad_generation_config_value_names_the_file():
    with pytest.raises(ValueError, match=r"generation_config.json: threshold must be in \(0, 1\]"):
        resolve_params(SamplingParams(), FULL, {"threshold": 3})


def test_describe_prints_what_will_run():
    p = resolve_params(SamplingParams(method="dual-cache+focus", temperature=0.7), FULL)
    text = p.describe()
    assert text.startswith("dual-cache+focus max_new_tokens=128 block_length=32 ")
    for part in ("threshold=0.9", "temperature=0.7", "top_p=1.0", "focus_alpha=1.5", "stop_at_eos=True"):
        assert part in text.split(" "), text
    assert "steps=" not in text  # the threshold rule ignores steps: not printed
    assert "steps=32" in resolve_params(SamplingParams(method="reference"), FULL).describe()


def cli_nfe(capsys, ckpt, *args) -> tuple[str, int]:
    assert main(["generate", "--model", str(ckpt), "--prompt", "sort : c b a", "--max-new-tokens", "16",
                 "--block-length", "8", *args]) == 0
    out = capsys.readouterr().out
    return re.search(r"^method: (.*)$", out, re.M).group(1), int(re.search(r"nfe=(\d+)", out).group(1))


@pytest.mark.parametrize("method", ["reference", "dual-cache"])
def test_api_cli_and_server_give_a_method_the_same_meaning(llm, capsys, method):
    params = SamplingParams(method=method, max_new_tokens=16, block_length=8)
    offline = llm.generate(["sort : c b a"], params)[0]
    described, nfe = cli_nfe(capsys, llm.path, "--method", method)
    assert described == llm.resolve(params).describe() and nfe == offline.stats.nfe
    # a server whose default is the family's (dual-cache, threshold 0.9) must not lend its
    # threshold to a request that asks for `reference`
    with TestClient(create_app(llm, SamplingParams(max_new_tokens=16, block_length=8))) as client:
        r = client.post("/v1/completions", json={"prompt": "sort : c b a", "method": method})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["nfe"] == offline.stats.nfe
        assert r.json()["choices"][0]["text"] == offline.text


def test_no_method_means_the_family_default_everywhere(llm, capsys):
    described, _ = cli_nfe(capsys, llm.path)
    assert described.startswith("dual-cache ") and "threshold=0.9" in described.split(" ")
    with TestClient(create_app(llm)) as client:
        model = client.get("/v1/models").json()["data"][0]
        assert model["default_method"] == "dual-cache"
        assert model["defaults"] == llm.resolve(SamplingParams()).describe()


def test_server_refuses_a_default_it_cannot_run(llm):
    with pytest.raises(ValueError, match="method 'block' cannot run on this model"):
        create_app(llm, SamplingParams(method="block"))


def test_checkpoint_generation_config_is_read(tmp_path):
    folder = write_checkpoint(tmp_path, "llada")
    (folder / "generation_config.json").write_text(json.dumps({"max_new_tokens": 24, "block_length": 8}))
    p = LLM(folder).resolve()
    assert (p.max_new_tokens, p.block_length) == (24, 8)
