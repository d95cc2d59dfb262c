"""Contracts: every method combination decided up front, order-free pipelines,
per-request strategy state, replay-safe plans, a usable engine after a failed call, a cache that
shrinks and copies only the rows that move, no silent fallbacks."""
import asyncio
import copy
import itertools
import logging

import numpy as np
import pytest
import torch

from dllm_engine import LLM, SamplingParams
from dllm_engine.engine.kv_cache import KVCache
from dllm_engine.engine.sequence import Sequence, TokenIds
from dllm_engine.methods import DECODERS, STRATEGIES
from dllm_engine.resolve import resolve_params
from dllm_engine.strategies.base import Pipeline
from fixtures import write_checkpoint

PROMPTS = [[42, 13, 14, 15, 16, 17, 18], [20, 21, 22]]
FAMILIES = ("llada", "Dream", "sdar")
OPTIONS = dict(max_new_tokens=16, block_length=8, threshold=0.5, stop_at_eos=False)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    return {mt: write_checkpoint(root / mt, mt, tokenizer=False) for mt in FAMILIES}


@pytest.fixture(scope="module")
def llms(ckpts):
    return {mt: LLM(path) for mt, path in ckpts.items()}


def all_methods() -> list[str]:
    names = list(STRATEGIES)
    subsets = [c for n in range(len(names) + 1) for c in itertools.combinations(names, n)]
    return ["+".join((base, *subset)) for base in DECODERS for subset in subsets]


def accepted(llm: LLM, method: str) -> bool:
    """Whether validation (parse, then resolution against the model) accepts ``method``; a
    refusal must be a one-line ValueError."""
    try:
        llm.make_sequence(PROMPTS[0], SamplingParams(method=method, **OPTIONS))
    except ValueError as e:
        assert "\n" not in str(e) and str(e)
        return False
    return True


# -- the combination matrix --------------------------------------------------------------------
@pytest.mark.slow  # over 2 s
@pytest.mark.parametrize("family", FAMILIES)
def test_every_combination_is_refused_up_front_or_completes(ckpts, llms, family):
    shared = llms[family]
    ran = 0
    for method in all_methods():
        if not accepted(shared, method):
            continue
        params = SamplingParams(method=method, **OPTIONS)
        fresh = LLM(ckpts[family]).generate(PROMPTS, params)
        again = shared.generate(PROMPTS, params)  # one LLM for every combination: no poisoning
        assert [o.token_ids for o in again] == [o.token_ids for o in fresh], method
        assert all(len(o.token_ids) for o in fresh) and fresh.stats.nfe > 0
        assert shared.engine.running == [] and not shared.engine.waiting
        ran += 1
    assert ran >= {"llada": 16, "Dream": 12, "sdar": 6}[family]


@pytest.mark.parametrize("method,family,conflict", [
    ("dual-cache+focus+early-skip", "llada", "'focus' and 'early-skip' both drop tokens"),
    ("dual-cache+focus+focus-probe", "llada", "'focus' and 'focus-probe' both drop tokens"),
    ("dual-cache+focus+jump-share", "llada", "'jump-share' verifies every copy"),
    ("dual-cache+early-skip+jump-share", "llada", "'jump-share' verifies every copy"),
    ("dual-cache+jump-share", "Dream", "'jump-share' needs a model without logit shift"),
    ("block+early-skip", "sdar", "strategy 'early-skip' runs on dual-cache, not on 'block'"),
])
def test_conflicts_are_named(llms, method, family, conflict):
    with pytest.raises(ValueError, match=conflict):
        llms[family].make_sequence(PROMPTS[0], SamplingParams(method=method, **OPTIONS))


def test_a_refused_method_is_a_400_and_exit_code_2(llms, tmp_path, capsys):
    from dllm_engine.cli import main
    from dllm_engine.server.app import Server
    from dllm_engine.server.metrics import Metrics
    from dllm_engine.server.protocol import ApiError, CompletionRequest
    server = Server(llms["Dream"], None, SamplingParams(), "tiny", Metrics(), shutdown_timeout=1)
    body = CompletionRequest(prompt=PROMPTS[0], max_tokens=16, method="dual-cache+jump-share")
    with pytest.raises(ApiError, match="needs a model without logit shift") as e:
        server.make_request(body, [PROMPTS[0]], "r1")
    assert e.value.status == 400
    argv = ["generate", "--model", str(write_checkpoint(tmp_path / "dream", "Dream")), "--method",
            "dual-cache+jump-share",
            "--prompt", "x", "--max-new-tokens", "16", "--block-length", "8"]
    assert main(argv) == 2 and "needs a model without logit shift" in capsys.readouterr().err


def test_family_free_conflicts_are_refused_when_the_method_is_parsed():
    with pytest.raises(ValueError, match="both drop tokens"):
        SamplingParams(method="dual-cache+early-skip+focus")


# -- the order of the method string does not matter ----------------------------------------------
def test_strategies_run_in_stage_order_whatever_the_method_says(llms):
    llm = llms["llada"]
    a = llm.generate(PROMPTS, SamplingParams(method="dual-cache+jump-share+adaptive-length", **OPTIONS))
    b = llm.generate(PROMPTS, SamplingParams(method="dual-cache+adaptive-length+jump-share", **OPTIONS))
    assert [o.token_ids for o in a] == [o.token_ids for o in b] and a.stats.nfe == b.stats.nfe
    names = [s.name for s in Pipeline.named(["jump-share", "adaptive-length"], llm.model).strategies]
    assert names == ["adaptive-length", "jump-share"]


def test_a_strategy_that_commits_hides_no_other_strategy(llms, monkeypatch):
    """Every strategy sees every commit, including those the commit-owning strategy makes."""
    from dllm_engine.strategies.adaptive_length import AdaptiveLength
    seen = []
    original = AdaptiveLength.after_commit

    def spy(self, seq, committed):
        seen.append(len(committed))  # host positions
        return original(self, seq, committed)

    monkeypatch.setattr(AdaptiveLength, "after_commit", spy)
    params = SamplingParams(method="dual-cache+jump-share+adaptive-length", **OPTIONS)
    out = llms["llada"].generate(PROMPTS, params)
    assert len(seen) == out.stats.nfe and sum(seen) == out.stats.decoded_tokens


# -- per-request state, replay-safe plans -----------------------------------------------------
REPLAYED = [("sdar", "block+focus"), ("sdar", "block+focus-probe"), ("llada", "dual-cache+focus"),
            ("llada", "dual-cache+early-skip"), ("Dream", "dual-cache+early-skip"),
            ("llada", "dual-cache+adaptive-length"), ("llada", "dual-cache+jump-share"),
            ("llada", "dual-cache+early-skip:block_refresh=3,prompt_refresh=5")]


@pytest.mark.slow  # over 2 s on 2 busy cores
@pytest.mark.parametrize("family,spec", REPLAYED)
def test_planning_a_step_twice_changes_nothing(llms, monkeypatch, family, spec):
    """The server replays a failed step: planning (``computed``, ``plan``) must leave no trace."""
    from dllm_engine.spec import parse_spec
    llm, params = llms[family], parse_spec(spec, **OPTIONS)
    once = llm.generate(PROMPTS, params)
    original = Pipeline.plans

    def twice(self, seqs, shift):
        original(self, seqs, shift)
        planned_once = copy.deepcopy([s.strategy_state for s in seqs])
        out = original(self, seqs, shift)  # the replay
        assert_same_state(planned_once, [s.strategy_state for s in seqs])
        return out

    monkeypatch.setattr(Pipeline, "plans", twice)
    replayed = llm.generate(PROMPTS, params)
    assert [o.token_ids for o in replayed] == [o.token_ids for o in once]
    assert replayed.stats.processed_tokens == once.stats.processed_tokens


def assert_same_state(a, b) -> None:
    """Strategy states equal (layouts compared by their tensors)."""
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            assert_same_state(a[k], b[k])
    elif isinstance(a, torch.Tensor):
        assert torch.equal(a, b)
    elif isinstance(a, np.ndarray):
        assert np.array_equal(a, b)
    elif hasattr(a, "__dict__"):
        assert_same_state(vars(a), vars(b))
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same_state(x, y)
    else:
        assert a == b


@pytest.mark.slow  # over 2 s
def test_diagnostics_are_per_call_and_per_request(llms):
    llm = llms["sdar"]
    params = SamplingParams(method="block+focus-probe", **OPTIONS)
    first = llm.generate([PROMPTS[0]], params).diagnostics["focus-probe"]
    again = llm.generate([PROMPTS[0]], params).diagnostics["focus-probe"]
    other = llm.generate([PROMPTS[1]], params).diagnostics["focus-probe"]
    both = llm.generate(PROMPTS, params).diagnostics["focus-probe"]
    assert first.steps > 0 and first == again  # nothing carried over from the earlier call
    assert both == first + other  # each request counts its own steps


# -- the engine never sees an unresolved method --------------------------------------------------
@pytest.mark.slow  # over 2 s
def test_default_params_reach_the_engine_resolved(llms):
    out = llms["sdar"].generate([PROMPTS[0]], SamplingParams())
    explicit = llms["sdar"].generate([PROMPTS[0]], SamplingParams(method="block"))
    assert out.method == "block" and out[0].token_ids and out[0].token_ids == explicit[0].token_ids
    with pytest.raises(ValueError, match="resolved methods only"):
        llms["sdar"].engine.pipeline(None)


# -- a failed call leaves the engine empty and usable --------------------------------------------
def test_a_call_that_raises_mid_step_leaves_the_engine_usable(llms, monkeypatch):
    from dllm_engine.strategies.adaptive_length import AdaptiveLength
    llm = llms["llada"]
    want = llm.generate(PROMPTS, SamplingParams(method="dual-cache", **OPTIONS))

    def boom(self, seqs, outputs):
        raise RuntimeError("boom")

    with monkeypatch.context() as m:
        m.setattr(AdaptiveLength, "after_forward_rows", boom)
        with pytest.raises(RuntimeError, match="boom"):
            llm.generate(PROMPTS * 3, SamplingParams(method="dual-cache+adaptive-length", **OPTIONS))
    assert llm.engine.running == [] and not llm.engine.waiting
    got = llm.generate(PROMPTS, SamplingParams(method="dual-cache", **OPTIONS))
    assert [o.token_ids for o in got] == [o.token_ids for o in want]


# -- the KV cache pools -------------------------------------------------------------------------
def filled_cache(ids, length):
    cache = KVCache(2, 1, 2, torch.float32, "cpu")
    cache.arrange(ids, length)
    with torch.inference_mode():  # as the engine's steps write it
        for i in ids:  # each row holds its sequence id
            for t in cache.k + cache.v:
                t[cache.rows[i]] = float(i)
    return cache


def test_a_leave_moves_only_the_rows_that_must_move():
    cache = filled_cache([1, 2, 3, 4], 10)
    storage = cache.k[0].data_ptr()
    order = cache.arrange([1, 3, 4], 10)  # 2 leaves: 4 takes its row, 1 and 3 stay
    assert cache.k[0].data_ptr() == storage  # no reallocation
    assert cache.rows == {1: 0, 3: 2, 4: 1} and order == [1, 4, 3]
    for i, row in cache.rows.items():
        assert bool((cache.k[1][row] == i).all()) and bool((cache.v[0][row] == i).all())
    cache.arrange([1, 3, 4, 5], 10)  # a join takes the free row: nothing moves
    assert cache.rows == {1: 0, 3: 2, 4: 1, 5: 3} and bool((cache.k[0][2] == 3).all())


def test_the_cache_shrinks_when_the_long_sequences_leave():
    cache = filled_cache([1, 2, 3], 1000)
    cache.arrange([2, 3], 64)  # the long one left: rows hold what the others need
    assert cache.capacity == 64 and cache.num_rows == 2
    assert bool((cache.k[0][cache.rows[3], :, :64] == 3).all())
    cache.arrange([], 0)
    assert cache.nbytes == 0


@pytest.mark.slow  # over 2 s
def test_a_long_request_widens_only_its_own_group(llms):
    llm = llms["llada"]
    engine = llm.engine
    short = SamplingParams(method="dual-cache", max_new_tokens=8, block_length=8)
    long = SamplingParams(method="dual-cache", max_new_tokens=128, block_length=8, stop_at_eos=False)
    seqs = [llm.make_sequence(PROMPTS[0], long)] + [llm.make_sequence(p, short) for p in PROMPTS * 2]
    for s in seqs:
        engine.add(s)
    engine.step()
    caches = {len(group): engine.caches[key] for key, group in engine.groups.items()}
    assert sorted(caches) == [1, 4]  # the long one has a pool of its own
    assert caches[4].capacity == max(s.canvas_len for s in seqs[1:]) < seqs[0].canvas_len
    assert caches[1].capacity == seqs[0].canvas_len
    while not seqs[0].finished:
        engine.step()
    assert engine.cache_bytes == 0 and engine.running == []  # every pool went with its sequences


# -- no silent fallbacks -------------------------------------------------------------------------
def test_a_step_past_the_schedule_commits_every_mask_left():
    params = SamplingParams(method="dual-cache", max_new_tokens=8, block_length=8, steps=2)
    p = resolve_params(params, ("dual-cache",))
    seq = Sequence(0, [5, 6, 7], p, TokenIds(mask_id=4, eos_id=3, stop_ids=frozenset({3})))
    assert seq.tokens_this_step() == 4  # 8 masks over 2 steps
    seq.fill(slice(3, 5), 9)
    seq.step = 1
    assert seq.tokens_this_step() == 6  # fell behind: what is left, not 1
    seq.step = 2
    assert seq.tokens_this_step() == 6


def test_stop_strings_need_a_tokenizer(llms):
    from dllm_engine.server.app import Server
    from dllm_engine.server.metrics import Metrics
    from dllm_engine.server.protocol import ApiError, CompletionRequest
    server = Server(llms["llada"], None, SamplingParams(), "tiny", Metrics(), shutdown_timeout=1)
    body = CompletionRequest(prompt=PROMPTS[0], max_tokens=8, stop=["x"])
    with pytest.raises(ApiError, match="no tokenizer, so stop strings cannot match") as e:
        server.make_request(body, [PROMPTS[0]], "r1")
    assert e.value.status == 400


def test_an_event_for_a_closed_loop_is_logged(caplog):
    from dllm_engine.server.loop import Event, Job

    async def make():
        return Job([], [], stream=False)

    job = asyncio.run(make())  # its loop is closed once run() returns
    with caplog.at_level(logging.WARNING, logger="dllm_engine.server"):
        job.emit(Event(text="late"))
    assert "event dropped" in caplog.text


class Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture()
def hf_warnings():
    from transformers.utils import logging as hf_logging
    logger, handler = hf_logging.get_logger("transformers"), Collect()
    logger.addHandler(handler)
    yield handler.messages
    logger.removeHandler(handler)


def test_tokenizer_warnings_are_not_muted(tmp_path, monkeypatch, hf_warnings):
    import transformers
    from transformers.utils import logging as hf_logging
    real = transformers.AutoTokenizer.from_pretrained

    def noisy(*args, **kwargs):
        hf_logging.get_logger("transformers").warning("tokenizer warning for the user")
        return real(*args, **kwargs)

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", noisy)
    LLM(write_checkpoint(tmp_path / "tok", "llada"))
    assert "tokenizer warning for the user" in hf_warnings


def test_the_engine_model_type_gives_no_tokenizer_warning(tmp_path, hf_warnings):
    LLM(write_checkpoint(tmp_path / "tok", "llada"))
    assert not [m for m in hf_warnings if "model of type" in m]


# -- the per-sequence step's inputs ----------------------------------------------------------
@pytest.mark.parametrize("family,spec,fixed", [
    ("sdar", "block+focus", False), ("sdar", "block+focus", True), ("Dream", "dual-cache+early-skip", False),
    ("llada", "dual-cache+early-skip", True), ("llada", "dual-cache+adaptive-length+jump-share", False),
    ("llada", "reference:steps=8,cfg_scale=1.0", False), ("llada", "dual-cache:commit_rule=credit", True)])
def test_inputs_sent_from_host_arrays_equal_those_padded_on_the_device(llms, monkeypatch, family, spec, fixed):
    """``Runner.inputs`` lays the plans' host arrays out in one copy (``host_grids``); plans
    built with tensors only are padded on the device: the same step tensors either way."""
    import dataclasses

    from dllm_engine.engine.runner import Runner
    from dllm_engine.spec import parse_spec
    llm, params = llms[family], parse_spec(spec, **OPTIONS)
    original, checked = Runner.inputs, []

    def both(self, plans, rows=None, fixed=False):
        sent = original(self, plans, rows, fixed)
        padded = original(self, [dataclasses.replace(p, host_tokens=None) for p in plans], rows, fixed)
        for name in ("token_ids", "positions", "valid", "mask", "slots", "logit_slots", "logit_positions"):
            a, b = getattr(sent, name), getattr(padded, name)
            assert (a is None and b is None) or torch.equal(a, b), name
        assert (sent.num_keys, sent.lengths, sent.slot_span) == (padded.num_keys, padded.lengths, padded.slot_span)
        checked.append(len(plans))
        return sent

    monkeypatch.setattr(Runner, "inputs", both)
    llm.engine.runner.set_step_shapes(fixed)
    try:
        llm.generate(PROMPTS * 3, params)
    finally:
        llm.engine.runner.set_step_shapes(False)
    assert checked and max(checked) == 6
