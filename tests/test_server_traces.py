"""The server's ``steps`` extension field: ``"record_steps": true`` in a request body returns each
choice's trace (non-streaming: in the choice; streaming: in the choice's final chunk)."""
import json

import httpx
import pytest

from dllm_engine import LLM, SamplingParams
from dllm_engine.engine.trace import record_from_dict, replay, without_time
from fixtures import write_checkpoint
from test_server import serving

NAME = "tiny"
DEFAULTS = SamplingParams(method="dual-cache", max_new_tokens=16, block_length=8, steps=8, seed=0)
PROMPT = "sort : c b a"


@pytest.fixture(scope="module")
def offline(tmp_path_factory):
    return LLM(write_checkpoint(tmp_path_factory.mktemp("llada"), "llada"))


@pytest.fixture(scope="module")
def url(offline):
    with serving(offline, defaults=DEFAULTS) as (base, _):
        yield base


def offline_steps(offline, method: str, chat: bool) -> tuple[list[dict], object]:
    params = DEFAULTS.replace(method=method, record_steps=True)
    out = (offline.chat([[{"role": "user", "content": PROMPT}]], params) if chat
           else offline.generate([PROMPT], params))[0]
    return [r.as_dict() for r in out.steps], out


@pytest.mark.parametrize("method", ["dual-cache", "dual-cache+jump-share"])
def test_completion_returns_the_offline_trace(url, offline, method):
    body = {"model": NAME, "prompt": PROMPT, "record_steps": True, "method": method, "seed": 0}
    got = httpx.post(url + "/v1/completions", json=body, timeout=60).json()
    want, out = offline_steps(offline, method, chat=False)
    assert without_time(got["choices"][0]["steps"]) == without_time(want)
    records = [record_from_dict(d) for d in got["choices"][0]["steps"]]
    assert replay(records, len(out.prompt_token_ids), 16, offline.token_ids.stop_ids) == out.token_ids
    plain = httpx.post(url + "/v1/completions", json={**body, "record_steps": False}, timeout=60).json()
    assert "steps" not in plain["choices"][0] and plain["choices"][0]["text"] == got["choices"][0]["text"]


def test_streamed_chat_carries_the_trace_on_its_final_chunk(url, offline):
    body = {"model": NAME, "messages": [{"role": "user", "content": PROMPT}], "record_steps": True,
            "stream": True, "seed": 0}
    chunks = []
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[len("data: "):]))
    with_steps = [c for c in chunks if "steps" in c["choices"][0]]
    assert len(with_steps) == 1 and with_steps[0]["choices"][0]["finish_reason"] is not None
    want, _ = offline_steps(offline, "dual-cache", chat=True)
    assert without_time(with_steps[0]["choices"][0]["steps"]) == without_time(want)


def test_record_steps_must_be_a_boolean(url):
    got = httpx.post(url + "/v1/completions", json={"model": NAME, "prompt": PROMPT, "record_steps": "maybe"},
                     timeout=60)
    assert got.status_code == 400 and got.json()["error"]["param"] == "record_steps"
