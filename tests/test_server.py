"""``dllm serve``: a live OpenAI-compatible server on 127.0.0.1, driven by the official client.

Every text the server returns is checked against offline ``LLM.generate`` on a second LLM loaded
from the same checkpoint (the engine is batch-invariant, so continuous batching must not change a
request's tokens)."""
import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from dllm_engine import LLM, SamplingParams
from dllm_engine.bench.serve import percentile
from dllm_engine.cli import main
from dllm_engine.engine.host_memory import resident_bytes
from dllm_engine.seeds import SeedStream
from dllm_engine.server import EngineLoop, create_app, shutdown_timeouts
from dllm_engine.server.loop import Job, held_back
from dllm_engine.server.protocol import ApiError
from dllm_lab.tasks import load_split
from fixtures import serving, write_checkpoint

pytestmark = pytest.mark.slow  # live servers

NAME = "tiny"
DEFAULTS = SamplingParams(method="dual-cache", threshold=0.9, max_new_tokens=16, block_length=8)
PROMPTS = [e.prompt for e in load_split(limit=6)][:32]  # held-out task prompts, varied lengths
# ~2000 fixed steps over a 2000-token canvas: runs far longer than any test waits, so it is
# always still running when the test cancels it
LONG = {"model": NAME, "prompt": "sort : c b a", "max_tokens": 2048, "block_length": 2048,
        "method": "reference", "threshold": None}
SHORT = {"model": NAME, "prompt": "sort : c b a", "max_tokens": 8}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("llada"), "llada")


@pytest.fixture(scope="module")
def offline(ckpt):
    return LLM(ckpt)


@pytest.fixture(scope="module")
def live(ckpt):
    with serving(LLM(ckpt, max_num_seqs=64), defaults=DEFAULTS) as (url, app):
        yield url, app


@pytest.fixture(scope="module")
def small(ckpt):
    """One running slot and one waiting slot: for queue overflow and cancellation."""
    with serving(LLM(ckpt, max_num_seqs=1), defaults=DEFAULTS, max_queue=1) as (url, app):
        yield url, app


@pytest.fixture(scope="module")
def client(live):
    return openai.OpenAI(base_url=live[0] + "/v1", api_key="test", max_retries=0, timeout=60)


def expected(offline, prompt, **overrides):
    return offline.generate([prompt], DEFAULTS.replace(**overrides))[0]


def expected_chat(offline, content, **overrides):
    return offline.chat([[{"role": "user", "content": content}]], DEFAULTS.replace(**overrides))[0]


def metric(url: str, name: str, labels: str = "") -> float:
    text = httpx.get(url + "/metrics").text
    found = re.search(rf"^dllm_{name}{re.escape(labels)} (\S+)$", text, re.M)
    return float(found.group(1)) if found else 0.0


async def wait_for_metric(client: httpx.AsyncClient, name: str, value: float, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while True:
        text = (await client.get("/metrics")).text
        found = re.search(rf"^dllm_{name} (\S+)$", text, re.M)
        if found and float(found.group(1)) == value:
            return
        assert time.monotonic() < deadline, f"dllm_{name} never reached {value}:\n{text}"
        await asyncio.sleep(0.02)


# -- answers equal offline generation ------------------------------------------------------------
def test_completion_text_and_usage_match_offline(client, offline):
    want = expected(offline, PROMPTS[0])
    got = client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=16)
    assert got.object == "text_completion" and got.model == NAME
    assert got.choices[0].text == want.text
    assert got.choices[0].finish_reason == want.finish_reason
    u, s = got.usage, want.stats
    assert u.prompt_tokens == len(want.prompt_token_ids)
    assert u.completion_tokens == len(want.token_ids)
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens
    extra = u.model_extra
    assert (extra["nfe"], extra["decoded_tokens"], extra["prefill_tokens"]) == \
        (s.nfe, s.decoded_tokens, s.prefill_tokens)
    assert extra["processed_tokens"] == pytest.approx(s.processed_tokens)
    assert extra["redundancy"] == pytest.approx(s.redundancy, abs=1e-4)


def test_chat_uses_the_chat_template_and_matches_offline(client, offline):
    want = expected_chat(offline, PROMPTS[1], max_new_tokens=24)
    got = client.chat.completions.create(model=NAME, max_tokens=24,
                                         messages=[{"role": "user", "content": PROMPTS[1]}])
    assert got.object == "chat.completion"
    assert got.choices[0].message.role == "assistant"
    assert got.choices[0].message.content == want.text
    assert got.usage.prompt_tokens == len(want.prompt_token_ids)


def test_token_id_prompt_and_several_prompts_give_one_choice_each(client, offline):
    ids = offline.encode(PROMPTS[2])
    got = client.completions.create(model=NAME, prompt=[PROMPTS[3], PROMPTS[4], PROMPTS[2]], max_tokens=16)
    assert [c.index for c in got.choices] == [0, 1, 2]
    assert [c.text for c in got.choices] == [expected(offline, p).text for p in PROMPTS[3:5] + PROMPTS[2:3]]
    by_ids = client.completions.create(model=NAME, prompt=ids, max_tokens=16)
    assert by_ids.choices[0].text == got.choices[2].text


def long_output_prompt(offline) -> str:
    """A prompt whose 32-token answer spans several 8-token blocks (so streaming has >1 chunk)."""
    for p in PROMPTS:
        if len(expected(offline, p, max_new_tokens=32).token_ids) > 16:
            return p
    raise AssertionError("no prompt gives a long answer on the fixture model")


def test_streaming_sends_blocks_that_concatenate_to_the_full_text(client, offline):
    prompt = long_output_prompt(offline)
    want = expected(offline, prompt, max_new_tokens=32)
    chunks = list(client.completions.create(model=NAME, prompt=prompt, max_tokens=32, stream=True,
                                            stream_options={"include_usage": True}))
    texts = [c.choices[0].text for c in chunks if c.choices and c.choices[0].text]
    assert len(texts) >= 2  # block by block, not one piece at the end
    assert "".join(texts) == want.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == want.finish_reason
    assert chunks[-1].usage.completion_tokens == len(want.token_ids)

    want = expected_chat(offline, prompt, max_new_tokens=32)
    chunks = list(client.chat.completions.create(model=NAME, max_tokens=32, stream=True,
                                                 messages=[{"role": "user", "content": prompt}]))
    assert chunks[0].choices[0].delta.role == "assistant"
    texts = [c.choices[0].delta.content for c in chunks if c.choices[0].delta.content]
    assert len(texts) >= 2 and "".join(texts) == want.text


def test_stop_strings_cut_the_text_and_end_the_request(client, offline):
    prompt = long_output_prompt(offline)
    full = expected(offline, prompt, max_new_tokens=32).text
    words = full.split(" ")
    stop = " " + words[len(words) // 2]
    cut = full[: full.find(stop)]
    got = client.completions.create(model=NAME, prompt=prompt, max_tokens=32, stop=[stop, "never here"])
    assert got.choices[0].text == cut and got.choices[0].finish_reason == "stop"
    assert 0 < got.usage.completion_tokens <= len(expected(offline, prompt, max_new_tokens=32).token_ids)
    chunks = client.completions.create(model=NAME, prompt=prompt, max_tokens=32, stop=stop, stream=True)
    assert "".join(c.choices[0].text for c in chunks) == cut


def test_held_back_keeps_a_possible_stop_prefix():
    assert held_back("a b st", ["stop"]) == "a b "
    assert held_back("a b c", ["stop"]) == "a b c"
    assert held_back("x \ufffd", []) == "x "


def test_32_concurrent_requests_with_mixed_options_match_offline(live, offline):
    """Different prompts, lengths, methods and sampling, all in one continuous batch."""
    cases = []
    for i, prompt in enumerate(PROMPTS):
        opts = {"max_new_tokens": 8 * (1 + i % 4)}
        if i % 3 == 0:
            opts.update(method="reference", threshold=None)
        if i % 5 == 0:
            opts.update(temperature=1.0, seed=i)
        cases.append((prompt, opts))

    async def one(c, prompt, opts):
        body = {k: v for k, v in opts.items() if k != "max_new_tokens"}
        return await c.completions.create(model=NAME, prompt=prompt, max_tokens=opts["max_new_tokens"],
                                          temperature=opts.get("temperature", 0.0),
                                          extra_body={k: v for k, v in body.items() if k != "temperature"})

    async def run_all():
        c = openai.AsyncOpenAI(base_url=live[0] + "/v1", api_key="test", max_retries=0, timeout=60)
        return await asyncio.gather(*(one(c, p, o) for p, o in cases))

    results = asyncio.run(run_all())
    assert len(results) == 32
    for (prompt, opts), got in zip(cases, results):
        assert got.choices[0].text == expected(offline, prompt, **opts).text, (prompt, opts)


def test_strategies_are_chosen_per_request_and_match_offline(live, offline):
    """Every acceleration, composed with its base decoders, side by side in one batch."""
    methods = ["dual-cache+early-skip", "dual-cache+focus", "prefix-cache+jump-share",
               "dual-cache+adaptive-length", "reference+adaptive-length"]
    cases = [(m, p) for m in methods for p in PROMPTS[6:8]]

    async def run_all():
        c = openai.AsyncOpenAI(base_url=live[0] + "/v1", api_key="test", max_retries=0, timeout=60)
        return await asyncio.gather(*(c.completions.create(model=NAME, prompt=p, max_tokens=16,
                                                           extra_body={"method": m}) for m, p in cases))

    for (method, prompt), got in zip(cases, asyncio.run(run_all())):
        assert got.choices[0].text == expected(offline, prompt, method=method).text, method


# -- discovery and monitoring ------------------------------------------------------------------
def test_models_and_health(client, live):
    models = client.models.list().data
    assert [m.id for m in models] == [NAME]
    assert models[0].model_extra["default_method"] == "dual-cache"
    # what a request without a seed gets: no fixed seed among the defaults
    assert "seed=" not in models[0].model_extra["defaults"]
    assert models[0].model_extra["seed"] == SeedStream(0).describe()  # LLM(ckpt)'s stream
    assert client.models.retrieve(NAME).id == NAME  # GET /v1/models/{model}
    r = httpx.get(live[0] + "/v1/models/other")
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    r = httpx.get(live[0] + "/health")
    assert r.status_code == 200 and r.json() == {"status": "ok"}


def test_metrics_count_requests_tokens_and_latency(client, live):
    url = live[0]
    before = {n: metric(url, n) for n in ("output_tokens_total", "nfe_total", "request_latency_seconds_count")}
    ok = metric(url, "requests_total", '{status="200"}')
    bad = metric(url, "requests_total", '{status="400"}')
    got = client.completions.create(model=NAME, prompt=PROMPTS[5], max_tokens=16)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=NAME, prompt=PROMPTS[5], max_tokens=16, extra_body={"threshold": 5})
    assert metric(url, "requests_total", '{status="200"}') == ok + 1
    assert metric(url, "requests_total", '{status="400"}') == bad + 1
    assert metric(url, "output_tokens_total") == before["output_tokens_total"] + got.usage.completion_tokens
    assert metric(url, "nfe_total") == before["nfe_total"] + got.usage.model_extra["nfe"]
    assert metric(url, "request_latency_seconds_count") == before["request_latency_seconds_count"] + 1
    text = httpx.get(url + "/metrics").text
    for name in ("queue_depth", "running_sequences", "redundancy"):
        assert f"# TYPE dllm_{name} gauge" in text
    assert '# TYPE dllm_time_to_first_chunk_seconds histogram' in text
    assert re.search(r'^dllm_request_latency_seconds_bucket\{le="\+Inf"\} \d+$', text, re.M)
    for line in text.splitlines():  # every sample line is `name{labels} number`
        assert line.startswith("# ") or re.fullmatch(r'dllm_\w+(\{[^}]*\})? [-+.\deE]+|.*Inf"\} \d+', line)


# -- bad input ------------------------------------------------------------------------------------
BAD_COMPLETIONS = [
    ({"bogus": 1}, "bogus", "unknown field 'bogus'"),
    ({"threshold": 2}, "threshold", r"threshold must be in \(0, 1\]"),
    ({"threshold": "high"}, "threshold", "valid number"),
    ({"temperature": -1}, "temperature", "greater than or equal to 0"),
    ({"max_tokens": 0}, "max_tokens", "greater than or equal to 1"),
    ({"method": "block"}, "method", "'block' cannot run on this model"),
    ({"method": "turbo"}, "method", "unknown method 'turbo'"),
    ({"method": "dual-cache+warp"}, "method", "unknown strategy 'warp'"),
    ({"steps": 9}, "steps", "steps 9 must be <= block_length 8"),
    ({"remasking": "psychic"}, "remasking", "remasking must be one of"),
    ({"focus_alpha": None}, "focus_alpha", "valid number"),
    ({"factor": 1.0, "threshold": 0.5}, "threshold", "either threshold or factor"),
    ({"prompt": ""}, "prompt", "prompt is empty"),
    ({"prompt": []}, "prompt", "prompt list is empty"),
    ({"prompt": [999]}, "prompt", r"outside \[0, 96\)"),
    ({"max_tokens": 4096}, "max_tokens", "exceed the model's context of 4096 tokens"),
    ({"n": 17}, "n", "less than or equal to 16"),
    ({"temperature": float("nan")}, "temperature", "finite number"),
    ({"threshold": float("inf")}, "threshold", "finite number"),
    ({"factor": float("nan"), "threshold": None}, "factor", "finite number"),
    ({"cfg_scale": float("nan")}, "cfg_scale", "finite number"),
    ({"eos_threshold": float("nan")}, "eos_threshold", "finite number"),
    ({"seed": 2**70}, "seed", "less than 9223372036854775808"),
    ({"max_tokens": 10**9}, "max_tokens", "exceed the model's context of 4096 tokens"),
    ({"top_p": 0}, "top_p", "greater than 0"),
    ({"top_k": -1}, "top_k", "top_k must be an integer >= 0"),
    ({"logprobs": 6}, "logprobs", "less than or equal to 5"),
    ({"logprobs": 1, "method": "dual-cache+jump-share"}, "logprobs", "not recorded by jump-share"),
    ({"stop": ["", "x"]}, "stop", "non-empty"),
    ({"stream_options": {"include_usage": True, "extra": 1}}, "stream_options.extra", "unknown field"),
    ({"prompt": 5}, "prompt", "valid string"),
    ({"echo": True}, "echo", "echo is not supported"),
    ({"stop_token_ids": [96]}, "stop_token_ids", r"ids in \[0, 96\)"),
    ({"stop_token_ids": [10**30]}, "stop_token_ids", "fit in 64 bits"),
    ({"min_length": 10**30, "method": "dual-cache+adaptive-length"}, "min_length", "fit in 64 bits"),
]


@pytest.mark.parametrize("patch,param,message", BAD_COMPLETIONS)
def test_bad_completion_requests_answer_400_naming_the_field(live, patch, param, message):
    # json.dumps writes NaN / Infinity as Python does (httpx's json= refuses them)
    r = httpx.post(live[0] + "/v1/completions", content=json.dumps({**SHORT, **patch}),
                   headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and re.search(message, err["message"]), err


@pytest.mark.parametrize("patch,param,message", [
    ({"messages": []}, "messages", "at least 1 item"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role", "'system', 'developer', 'user'"),
    # OpenAI's 400 for a turn without content (an assistant turn with tool_calls may omit it)
    ({"messages": [{"role": "user"}]}, "messages.0.content", r"^Missing required parameter: 'messages\[0\]\.content'\.$"),
    ({"messages": [{"role": "user", "content": "sort : b a"}, {"role": "assistant", "content": None},
                   {"role": "user", "content": "again"}]}, "messages.1.content", "Missing required parameter"),
    ({"logprobs": False, "top_logprobs": 2}, "top_logprobs", "needs \"logprobs\": true"),
    ({"max_tokens": 8, "max_completion_tokens": 8}, "max_tokens", "not both"),
    ({"top_p": 0.5, "sparkle": 1}, "sparkle", "unknown field 'sparkle'"),
])
def test_bad_chat_requests_answer_400_naming_the_field(live, patch, param, message):
    body = {"model": NAME, "messages": [{"role": "user", "content": "sort : b a"}], **patch}
    r = httpx.post(live[0] + "/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and re.search(message, err["message"]), err


def test_unknown_model_missing_field_and_broken_json(live, client):
    with pytest.raises(openai.NotFoundError, match="'gpt-4' is not served here"):
        client.completions.create(model="gpt-4", prompt="sort : b a", max_tokens=8)
    r = httpx.post(live[0] + "/v1/completions", json={"model": NAME})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    r = httpx.post(live[0] + "/v1/completions", content=b"{nope", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]


# -- what OpenAI clients send -----------------------------------------------------------------------
def test_fields_openai_clients_send_are_accepted(live, offline):
    """LangChain and the like send these; the no-ops change nothing, developer is a system turn."""
    messages = [{"role": "developer", "content": "be brief"}, {"role": "user", "content": "sort : c b a"},
                {"role": "assistant", "content": None, "tool_calls": [{"id": "1", "type": "function"}]},
                {"role": "tool", "content": "ok", "tool_call_id": "1"}, {"role": "user", "content": "sort : b a"}]
    body = {"model": NAME, "messages": messages, "top_p": 1, "presence_penalty": 0, "frequency_penalty": 0,
            "logprobs": False, "user": "u1", "n": 1, "stream_options": {"include_usage": True}, "tools": [],
            "tool_choice": "none", "response_format": {"type": "text"}, "logit_bias": {}, "store": False,
            "metadata": {"a": "b"}, "service_tier": "auto", "parallel_tool_calls": False}
    r = httpx.post(live[0] + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    as_template = [{"role": "system", "content": "be brief"}, messages[1],
                   {"role": "assistant", "content": ""}, {"role": "tool", "content": "ok"}, messages[4]]
    want = offline.chat([as_template], DEFAULTS)[0].text
    assert r.json()["choices"][0]["message"]["content"] == want
    r = httpx.post(live[0] + "/v1/completions", json={**SHORT, "echo": False, "suffix": None, "best_of": 1})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("sampling", [{"top_k": 1}, {"top_p": 1e-9}])
def test_top_k_1_or_a_tiny_top_p_sample_the_greedy_answer(client, offline, sampling):
    got = client.completions.create(model=NAME, prompt=PROMPTS[1], max_tokens=16, temperature=5.0,
                                    seed=3, extra_body=sampling)
    assert got.choices[0].text == expected(offline, PROMPTS[1]).text
    free = client.completions.create(model=NAME, prompt=PROMPTS[1], max_tokens=16, temperature=5.0, seed=3)
    assert free.choices[0].text != got.choices[0].text  # temperature 5 alone does not give it


def test_logprobs_of_the_committed_tokens(client, offline):
    got = client.completions.create(model=NAME, prompt=PROMPTS[2], max_tokens=16, logprobs=2)
    lp = got.choices[0].logprobs
    want = offline.generate([PROMPTS[2]], DEFAULTS.replace(logprobs=2))[0]
    assert len(lp.tokens) == got.usage.completion_tokens == len(want.logprobs)
    assert lp.token_logprobs == pytest.approx([x[0] for x in want.logprobs])
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert len(top) == 2 and chosen == pytest.approx(max(top.values()))  # greedy: the argmax
    # each token's text is what it adds to the answer (spaces included): they join to the text
    assert "".join(lp.tokens) == got.choices[0].text and len(set(lp.tokens)) > 1
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    assert all(t in top for t, top in zip(lp.tokens, lp.top_logprobs))  # the chosen one is the top
    chat = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "sort : c b a"}],
                                          logprobs=True, top_logprobs=1, max_tokens=16)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert "".join(c.token for c in content) == chat.choices[0].message.content
    assert all(c.bytes == list(c.token.encode()) and c.logprob <= 0 and len(c.top_logprobs) == 1
               for c in content)
    assert client.completions.create(model=NAME, prompt=PROMPTS[2], max_tokens=16).choices[0].logprobs is None
    # streamed (an answer of two blocks): each chunk carries the logprobs of the tokens its text completes
    lp = client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=16, logprobs=2).choices[0].logprobs
    chunks = list(client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=16, logprobs=2, stream=True))
    parts = [c.choices[0].logprobs for c in chunks if c.choices[0].logprobs]
    assert [t for p in parts for t in p.tokens] == lp.tokens
    assert [o for p in parts for o in p.text_offset] == lp.text_offset
    assert [x for p in parts for x in p.token_logprobs] == pytest.approx(lp.token_logprobs)
    with_text = [c for c in chunks if c.choices[0].text]
    assert len(with_text) > 1 and all(c.choices[0].logprobs for c in with_text)
    for c in with_text:
        assert "".join(c.choices[0].logprobs.tokens) == c.choices[0].text
    chat_chunks = list(client.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": "sort : c b a"}], logprobs=True, top_logprobs=1,
        max_tokens=16, stream=True))
    streamed = [e.token for c in chat_chunks if c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert streamed == [e.token for e in content]


def test_n_choices_are_n_sequences_with_consecutive_seeds(client, offline):
    got = client.completions.create(model=NAME, prompt=[PROMPTS[0], PROMPTS[3]], max_tokens=16, n=3,
                                    temperature=1.0, seed=7)
    assert [c.index for c in got.choices] == list(range(6))
    for c in got.choices:
        prompt, j = [PROMPTS[0], PROMPTS[3]][c.index // 3], c.index % 3
        assert c.text == expected(offline, prompt, temperature=1.0, seed=7 + j).text
    assert len({c.text for c in got.choices[:3]}) > 1  # different seeds, different samples
    # each prompt's tokens count once, however many choices sample it (as OpenAI counts them)
    prompt_tokens = sum(len(offline.encode(p)) for p in (PROMPTS[0], PROMPTS[3]))
    assert got.usage.prompt_tokens == prompt_tokens
    assert got.usage.total_tokens == prompt_tokens + got.usage.completion_tokens
    streamed = list(client.completions.create(model=NAME, prompt=[PROMPTS[0], PROMPTS[3]], max_tokens=16,
                                              n=3, temperature=1.0, seed=7, stream=True,
                                              stream_options={"include_usage": True}))
    assert streamed[-1].usage.prompt_tokens == prompt_tokens


def test_a_request_without_a_seed_samples_with_a_fresh_one(client, offline, monkeypatch):
    """As OpenAI: unseeded requests are independent samples (the server's LLM draws each a seed
    from its stream, fresh without --seed); a seeded one is reproducible; ``resolve`` fixes no
    seed (offline, the LLM's stream seeded 0 gives one to each request)."""
    from dllm_engine import seeds
    drawn = iter([11, 12])
    monkeypatch.setattr(seeds.SeedStream, "next", lambda self: next(drawn))
    texts = [client.completions.create(model=NAME, prompt=PROMPTS[1], max_tokens=16, temperature=5.0)
             .choices[0].text for _ in range(2)]
    assert texts == [expected(offline, PROMPTS[1], temperature=5.0, seed=s).text for s in (11, 12)]
    assert texts[0] != texts[1]
    assert offline.resolve(SamplingParams()).seed is None


def test_max_tokens_need_not_divide_by_the_block_length(client, offline):
    got = client.completions.create(model=NAME, prompt=PROMPTS[4], max_tokens=12)  # blocks of 8
    want = expected(offline, PROMPTS[4], max_new_tokens=12)
    assert got.choices[0].text == want.text and got.usage.completion_tokens == len(want.token_ids) <= 12
    assert got.choices[0].finish_reason == ("length" if len(want.token_ids) == 12 else "stop")
    assert got.usage.model_extra["decoded_tokens"] == 16  # two whole blocks were decoded


@pytest.mark.parametrize("verb,path,status,message", [
    ("get", "/v1/completions", 405, "GET /v1/completions: method not allowed"),
    ("post", "/v1/embeddings", 404, "no route POST /v1/embeddings")])
def test_unknown_routes_answer_in_the_openai_error_format(live, verb, path, status, message):
    r = getattr(httpx, verb)(live[0] + path)
    assert r.status_code == status
    assert r.json()["error"]["message"].startswith(message) and r.json()["error"]["code"] == status


def test_api_key_is_checked_on_the_api_routes(ckpt):
    from fastapi.testclient import TestClient
    with TestClient(create_app(LLM(ckpt), DEFAULTS, NAME, api_key="s3cret")) as c:
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            r = c.post("/v1/completions", json=SHORT, headers=headers)
            assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        assert c.get("/health").status_code == 200  # probes need no key
        r = c.post("/v1/completions", json=SHORT, headers={"Authorization": "Bearer s3cret"})
        assert r.status_code == 200 and r.json()["choices"][0]["text"]


def test_a_user_error_is_a_400_and_a_bug_a_500(ckpt, monkeypatch):
    """Bad input (a UserError) names itself in a 400; any other exception in a handler is a bug:
    a 500 in the OpenAI error format, raised on so that the server logs its traceback."""
    from fastapi.testclient import TestClient
    llm = LLM(ckpt)
    with TestClient(create_app(llm, DEFAULTS, NAME), raise_server_exceptions=False) as c:
        r = c.post("/v1/completions", json={**SHORT, "temperature": -1})
        assert r.status_code == 400 and "temperature" in r.json()["error"]["message"]

        def broken(*args, **kwargs):
            raise ValueError("an internal invariant broke")

        monkeypatch.setattr(llm, "resolve_for_prompt", broken)
        r = c.post("/v1/completions", json=SHORT)
        assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
        assert "ValueError: an internal invariant broke" in r.json()["error"]["message"]
    with TestClient(create_app(llm, DEFAULTS, NAME)) as c, pytest.raises(ValueError, match="invariant"):
        c.post("/v1/completions", json=SHORT)  # not swallowed: the server's log gets it


def test_with_an_api_key_an_abandoned_request_is_still_cancelled(ckpt):
    """The key check must not hide the client's disconnect from the handler (Starlette's
    function middleware does): a non-streaming request whose client goes away is cancelled."""
    key = {"Authorization": "Bearer s3cret"}
    with serving(LLM(ckpt, max_num_seqs=1), defaults=DEFAULTS, api_key="s3cret") as (url, _):
        async def scenario():
            async with httpx.AsyncClient(base_url=url, timeout=60) as c:
                running = asyncio.create_task(c.post("/v1/completions", json=LONG, headers=key))
                await wait_for_metric(c, "running_sequences", 1)
                running.cancel()  # the client goes away: its connection closes
                await wait_for_metric(c, "running_sequences", 0)
                r = await c.post("/v1/completions", json=SHORT, headers=key)
                assert r.status_code == 200 and r.json()["choices"][0]["text"]

        asyncio.run(scenario())
        assert metric(url, "requests_total", '{status="cancelled"}') == 1


# -- limits and faults ----------------------------------------------------------------------------
def test_full_queue_answers_429_and_cancelled_requests_free_their_slot(small):
    url, _ = small

    async def scenario():
        async with httpx.AsyncClient(base_url=url, timeout=60) as c:
            running = asyncio.create_task(c.post("/v1/completions", json=LONG))
            await wait_for_metric(c, "running_sequences", 1)
            waiting = asyncio.create_task(c.post("/v1/completions", json=LONG))
            await wait_for_metric(c, "queue_depth", 1)
            r = await c.post("/v1/completions", json=SHORT)
            assert r.status_code == 429 and r.headers["retry-after"] == "1"
            assert r.json()["error"]["type"] == "rate_limit_error"
            # the numbers in the message are the ones that decided: 2 in flight, the limit 1 + 1
            assert ("2 sequences in flight, this request needs 1 more, the limit is 2 "
                    "(--max-num-seqs 1 + --max-queue 1)") in r.json()["error"]["message"]
            r = await c.post("/v1/completions", json={**SHORT, "prompt": ["sort : b a"] * 3})
            assert r.status_code == 400 and "at most 2 sequences" in r.json()["error"]["message"]
            running.cancel()  # the client goes away: its connection closes
            waiting.cancel()
            await wait_for_metric(c, "running_sequences", 0)
            await wait_for_metric(c, "queue_depth", 0)
            r = await c.post("/v1/completions", json=SHORT)  # the freed slot serves the next one
            assert r.status_code == 200 and r.json()["choices"][0]["text"]

    cancelled = metric(url, "requests_total", '{status="cancelled"}')
    asyncio.run(scenario())
    assert metric(url, "requests_total", '{status="cancelled"}') == cancelled + 2
    assert metric(url, "requests_total", '{status="429"}') >= 1


def test_a_streaming_client_that_disconnects_is_cancelled(small, offline):
    url, _ = small

    async def scenario():
        async with httpx.AsyncClient(base_url=url, timeout=60) as c:
            async with c.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as r:
                assert r.status_code == 200
                await wait_for_metric(c, "running_sequences", 1)
            await wait_for_metric(c, "running_sequences", 0)
            r = await c.post("/v1/completions", json=SHORT)
            return r.json()["choices"][0]["text"]

    assert asyncio.run(scenario()) == expected(offline, SHORT["prompt"], max_new_tokens=8).text


def test_an_exception_in_one_request_fails_only_that_request(live, offline, monkeypatch):
    from dllm_engine.engine.sequence import Sequence
    engine = live[1].state.server.llm.engine
    commit = Sequence.commit  # every commit path writes through it (the engine decides greedy
    # threshold commits for the whole batch at once, then writes each sequence's)

    def faulty(seq, *args, **kwargs):
        if seq.params.seed == 666:
            raise RuntimeError("boom")
        return commit(seq, *args, **kwargs)

    monkeypatch.setattr(Sequence, "commit", faulty)

    async def scenario():
        c = openai.AsyncOpenAI(base_url=live[0] + "/v1", api_key="test", max_retries=0, timeout=60)
        async def streamed():  # the error arrives inside the stream, after the 200 headers
            stream = await c.completions.create(model=NAME, prompt=PROMPTS[4], max_tokens=16, seed=666,
                                                stream=True)
            return [chunk async for chunk in stream]

        calls = [c.completions.create(model=NAME, prompt=p, max_tokens=16, seed=666 if i == 1 else 0)
                 for i, p in enumerate(PROMPTS[:4])]
        return await asyncio.gather(*calls, streamed(), return_exceptions=True)

    results = asyncio.run(scenario())
    assert isinstance(results[1], openai.InternalServerError) and "boom" in str(results[1])
    assert isinstance(results[4], openai.APIError) and "boom" in str(results[4])
    for i in (0, 2, 3):
        assert results[i].choices[0].text == expected(offline, PROMPTS[i]).text
    assert httpx.get(live[0] + "/health").status_code == 200  # the loop survived
    assert engine.running == [] and not engine.waiting


def test_a_sequence_that_raises_after_its_counters_moved_fails_its_request(live, offline, monkeypatch):
    """A sequence whose own advance raises once its step counter has moved looks advanced to
    the replay; the engine marks it, so its request fails (not a request left open for ever,
    its step failing again at every later one) and the others finish."""
    from dllm_engine.engine.sequence import Sequence
    stop_array = Sequence.stop_array  # read when a block is complete, after `step += 1`

    def faulty(seq):
        if seq.params.seed == 666:
            raise RuntimeError("stop ids broken")
        return stop_array(seq)

    monkeypatch.setattr(Sequence, "stop_array", faulty)

    async def scenario():
        async with httpx.AsyncClient(base_url=live[0], timeout=30) as c:
            calls = [c.post("/v1/completions", json={"model": NAME, "prompt": p, "max_tokens": 16,
                                                     "seed": 666 if i == 1 else 0})
                     for i, p in enumerate(PROMPTS[:3])]
            return await asyncio.gather(*calls)

    results = asyncio.run(scenario())
    assert results[1].status_code == 500 and "stop ids broken" in results[1].json()["error"]["message"]
    for i in (0, 2):
        assert results[i].json()["choices"][0]["text"] == expected(offline, PROMPTS[i]).text
    engine = live[1].state.server.llm.engine
    assert engine.running == [] and not engine.waiting


def test_an_engine_error_outside_any_request_fails_in_flight_requests_not_the_loop(live, offline,
                                                                                   client, monkeypatch):
    engine = live[1].state.server.llm.engine
    release_finished, calls = engine.release_finished, []

    def broken():
        calls.append(1)
        if len(calls) <= 2:  # the step and its recovery both fail
            raise RuntimeError("cache corrupted")
        return release_finished()

    monkeypatch.setattr(engine, "release_finished", broken)
    with pytest.raises(openai.InternalServerError, match="cache corrupted"):
        client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=16)
    assert engine.running == [] and not engine.waiting
    got = client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=16)
    assert got.choices[0].text == expected(offline, PROMPTS[0]).text


def run_job(llm, loop, prompt_ids, params, shutdown_timeout):
    """Submit one job to a started EngineLoop, shut the loop down, return the job's first event."""
    async def scenario():
        job = Job([llm.make_sequence(prompt_ids, params)], [], stream=False)
        loop.submit(job)
        await asyncio.to_thread(loop.shutdown, shutdown_timeout)
        return await asyncio.wait_for(job.events.get(), 10)
    return asyncio.run(scenario())


def test_graceful_shutdown_finishes_in_flight_requests(ckpt, offline):
    llm = LLM(ckpt)
    loop = EngineLoop(llm)
    loop.start()
    params = DEFAULTS.replace(max_new_tokens=16)
    event = run_job(llm, loop, offline.encode(PROMPTS[0]), params, shutdown_timeout=60)
    assert event.result is not None and event.result.text == expected(offline, PROMPTS[0]).text
    assert not loop.thread.is_alive()


def test_shutdown_timeout_cancels_what_is_left_and_refuses_new_requests(ckpt):
    llm = LLM(ckpt)
    loop = EngineLoop(llm)
    loop.start()
    params = SamplingParams(method="reference", max_new_tokens=2048, block_length=2048)
    event = run_job(llm, loop, [42, 13, 14], params, shutdown_timeout=0.2)
    assert event.error is not None and event.error.status == 503
    assert not loop.thread.is_alive() and not llm.engine.has_work()

    async def late():
        loop.submit(Job([llm.make_sequence([42], DEFAULTS)], [], stream=False))
    with pytest.raises(ApiError, match="shutting down"):
        asyncio.run(late())


# -- block diffusion --------------------------------------------------------------------------
def test_block_diffusion_server_streams_and_matches_offline(tmp_path):
    ckpt = write_checkpoint(tmp_path / "sdar", "sdar")
    sdar = LLM(ckpt)
    params = SamplingParams(method="block", max_new_tokens=16, block_length=4)
    with serving(LLM(ckpt), defaults=params) as (url, _):
        c = openai.OpenAI(base_url=url + "/v1", api_key="test", max_retries=0, timeout=60)
        assert c.models.list().data[0].model_extra["methods"] == ["block"]
        for prompt in PROMPTS[:3]:
            want = sdar.generate([prompt], params)[0].text
            assert c.completions.create(model=NAME, prompt=prompt).choices[0].text == want
            chunks = c.completions.create(model=NAME, prompt=prompt, stream=True)
            assert "".join(ch.choices[0].text for ch in chunks) == want
        with pytest.raises(openai.BadRequestError, match="cannot run on this model"):
            c.completions.create(model=NAME, prompt="sort : b a", extra_body={"method": "dual-cache"})


# -- the command line ------------------------------------------------------------------------------
def test_percentile_matches_numpy():
    import numpy as np
    xs = [0.3, 0.1, 0.7, 0.2, 0.9, 0.4]
    for q in (50, 95, 99):
        assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))
    assert percentile([], 50) is None


def test_length_mix_spreads_each_length_over_the_run():
    from dllm_engine.bench.serve import parse_length_mix
    assert parse_length_mix("64x4,960x2") == [64, 960, 64, 64, 960, 64]
    for bad, msg in (("64", "expected TOKENSxCOUNT"), ("64x0", "positive"), ("", "empty")):
        with pytest.raises(ValueError, match=msg):
            parse_length_mix(bad)


def test_the_app_drains_before_uvicorn_gives_up():
    """uvicorn cancels handlers at its graceful timeout; the app must have answered 503 first."""
    for timeout in (0.0, 1.0, 30.0):
        drain, graceful = shutdown_timeouts(timeout)
        assert drain == timeout and graceful > drain


def test_dllm_serve_and_dllm_bench_serve(ckpt, tmp_path):
    """`dllm serve --model` in a subprocess, `dllm bench serve` against it, then SIGINT with a
    request in flight: the request is answered 503 with the documented message, clean exit."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-m", "dllm_engine.cli", "serve", "--model", str(ckpt),
                             "--port", str(port), "--max-new-tokens", "8", "--block-length", "8",
                             "--log-level", "warning", "--shutdown-timeout", "1"],
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, "dllm serve did not start"
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        out = tmp_path / "bench"
        assert main(["bench", "serve", "--url", url, "--concurrency", "1,4", "--length-mix", "8x3,16x1",
                     "--tasks", "sort,count", "--out", str(out)]) == 0
        report = json.loads((out / "serve_bench.json").read_text())
        assert report["model"] == ckpt.name
        assert [level["concurrency"] for level in report["levels"]] == [1, 4]
        for level in report["levels"]:
            assert level["num_requests"] == 4 and level["failures"] == 0, level
            assert level["latency_p50"] > 0 and level["nfe"] > 0
            assert level["peak_memory_mb"] > 100  # the server's resident memory, from its /metrics
        assert (out / "serve_bench.png").read_bytes()[:4] == b"\x89PNG"
        in_flight = ThreadPoolExecutor(1).submit(httpx.post, url + "/v1/completions",
                                                  json={**LONG, "model": ckpt.name}, timeout=60)
        deadline = time.monotonic() + 30
        while metric(url, "running_sequences") < 1:
            assert time.monotonic() < deadline and not in_flight.done(), "the long request never ran"
            time.sleep(0.05)
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0
    r = in_flight.result(timeout=30)
    assert r.status_code == 503 and r.json()["error"]["message"] == "server shut down before the request finished"


@pytest.mark.parametrize("argv,policy", [([], "seed: a request without a seed gets a fresh random one"),
                                         (["--seed", "5"], "takes the next of a stream seeded with 5")])
def test_dllm_serve_start_up_lines_state_the_seed_policy(ckpt, monkeypatch, capsys, argv, policy):
    """Without --seed a request that sets none samples with a fresh seed, with --seed N with the
    next of a stream seeded N (Server.make_request): the start-up lines say so, and the default
    method's line shows no seed."""
    import dllm_engine.server
    monkeypatch.setattr(dllm_engine.server, "run_server", lambda *args, **kw: None)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert main(["serve", "--model", str(ckpt), "--port", str(port), *argv]) == 0
    out = capsys.readouterr().out
    assert policy in out
    method = next(line for line in out.splitlines() if line.startswith("default method: "))
    assert "seed=" not in method


# -- what one request may cost ----------------------------------------------------------------
def test_a_body_over_the_limit_is_refused_before_it_is_read(ckpt):
    """413 at once from a Content-Length over --max-request-bytes, and from a chunked body as
    soon as its bytes pass it; the server answers /health meanwhile and afterwards."""
    with serving(LLM(ckpt), defaults=DEFAULTS, max_request_bytes=4096) as (url, _):
        r = httpx.post(url + "/v1/completions", content=json.dumps({**SHORT, "prompt": "a " * 50_000}),
                       headers={"content-type": "application/json"}, timeout=30)
        assert r.status_code == 413 and r.json()["error"]["type"] == "invalid_request_error"
        assert "larger than 4,096 bytes" in r.json()["error"]["message"]

        def chunks():  # no Content-Length: the limit is counted as the body arrives
            yield b'{"prompt": "'
            for _ in range(100):
                yield b"a " * 500
            yield b'"}'
        r = httpx.post(url + "/v1/completions", content=chunks(), headers={"content-type": "application/json"},
                       timeout=30)
        assert r.status_code == 413 and "--max-request-bytes" in r.json()["error"]["message"]
        assert httpx.get(url + "/health", timeout=10).status_code == 200
        r = httpx.post(url + "/v1/completions", json=SHORT, timeout=60)  # under the limit: served
        assert r.status_code == 200 and r.json()["choices"][0]["text"]
        assert metric(url, "requests_total", '{status="413"}') == 2
        # 20 MB bodies (10 million words), five times: refused unread, the memory stays where it was
        body = json.dumps({**SHORT, "prompt": "a " * 10_000_000}).encode()
        before = resident_bytes()
        for _ in range(5):
            try:
                r = httpx.post(url + "/v1/completions", content=body, timeout=30,
                               headers={"content-type": "application/json"})
                assert r.status_code == 413
            except httpx.WriteError:  # the server answered and closed before the client had sent it all
                pass
        assert resident_bytes() < 1.1 * before
        assert metric(url, "requests_total", '{status="413"}') == 7  # each one refused by the server
        assert httpx.get(url + "/health", timeout=10).status_code == 200


def test_a_prompt_too_long_for_the_positions_is_refused_from_its_prefix(live, monkeypatch):
    """A text far past the model's positions is refused from a prefix: the tokenizer never sees
    it whole. A short one is tokenized whole as before."""
    llm = live[1].state.server.llm
    seen = []
    encode = llm.tokenizer.encode
    monkeypatch.setattr(llm.tokenizer, "encode", lambda text, **kw: seen.append(len(text)) or encode(text, **kw))
    huge = "sort : " + "b a " * 1_000_000  # 4 MB: under the body limit, ~2M tokens
    r = httpx.post(live[0] + "/v1/completions", json={**SHORT, "prompt": huge}, timeout=60)
    assert r.status_code == 400 and "longer than the model's" in r.json()["error"]["message"]
    r = httpx.post(live[0] + "/v1/chat/completions", json={"model": NAME, "messages": [
        {"role": "user", "content": huge}]}, timeout=60)
    assert r.status_code == 400 and "positions" in r.json()["error"]["message"]
    assert seen and max(seen) < len(huge) // 10  # prefixes only
    seen.clear()
    assert httpx.post(live[0] + "/v1/completions", json=SHORT, timeout=60).status_code == 200
    assert seen == [len(SHORT["prompt"])]


def test_tokenizing_runs_off_the_event_loop(live, monkeypatch):
    """While one request's prompt is being prepared (held here until /health has answered),
    /health answers (other prompts wait for the tokenizer, which one thread uses at a time)."""
    llm = live[1].state.server.llm
    release, entered = threading.Event(), threading.Event()
    encode = llm.encode

    def slow(prompt):
        if prompt == "sort : hold":
            entered.set()
            assert release.wait(30), "never released"
        return encode(prompt)
    monkeypatch.setattr(llm, "encode", slow)
    with ThreadPoolExecutor(1) as pool:
        held = pool.submit(httpx.post, live[0] + "/v1/completions", json={**SHORT, "prompt": "sort : hold"},
                           timeout=60)
        assert entered.wait(30)
        try:
            assert httpx.get(live[0] + "/health", timeout=10).json() == {"status": "ok"}
            assert httpx.get(live[0] + "/v1/models", timeout=10).status_code == 200
        finally:
            release.set()
        assert held.result().status_code == 200
