"""Per-step traces (engine/trace.py): ``record_steps`` off by default, the records of every base
decoder, strategy and allowed composition rebuild the output exactly, and each strategy reports
what it did."""
import itertools
from pathlib import Path

import pytest

from dllm_engine import LLM, SamplingParams
from dllm_engine.engine.trace import canvas_frames, format_steps, record_from_dict, replay, summary
from dllm_engine.methods import DECODERS, STRATEGIES, check_method
from fixtures import write_checkpoint

CHECKPOINTS = Path(__file__).resolve().parent.parent / "checkpoints"
CHATS = [[{"role": "user", "content": "sort : 5 1 3 8 5 7 9 5 7 4 2"}],
         [{"role": "user", "content": "spell : 1 6 2 8"}]]
# what each strategy must report at least once on these runs (the record API is exercised)
REPORTS = {"focus": "evicted", "early-skip": "skipped", "jump-share": "accepted", "adaptive-length": "cut_to"}


def allowed_methods(base: str) -> list[str]:
    """Every method string the registry allows on ``base``: the base, then each combination of
    strategies ``check_method`` accepts (in registry order)."""
    names = [n for n in STRATEGIES if DECODERS[base] in STRATEGIES[n].bases]
    out = [base]
    for k in (1, 2, 3):
        for combo in itertools.combinations(names, k):
            try:
                check_method(base, list(combo), logit_shift=0)
            except ValueError:
                continue
            out.append("+".join([base, *combo]))
    return out


@pytest.fixture(scope="module")
def llada():
    return LLM(CHECKPOINTS / "tiny-llada")


@pytest.fixture(scope="module")
def sdar():
    return LLM(CHECKPOINTS / "tiny-sdar")


def run(llm: LLM, method: str, **options):
    """Both chats in one batch, fixed steps (one token per step: many steps, so every strategy
    acts); returns the result."""
    params = SamplingParams(method=method, max_new_tokens=24, block_length=8, steps=8, record_steps=True,
                            **options)
    return llm.chat(CHATS, params)


def check_replay(llm: LLM, result, max_new_tokens: int = 24) -> None:
    for out in result:
        steps = out.steps
        assert steps, "record_steps gave no records"
        prompt_len = len(out.prompt_token_ids)
        assert replay(steps, prompt_len, max_new_tokens, llm.token_ids.stop_ids) == out.token_ids
        assert [r.step for r in steps] == list(range(len(steps))) and len(steps) == out.stats.nfe
        assert sum(len(r.committed) for r in steps) == out.stats.decoded_tokens
        assert sum(r.processed_tokens for r in steps) == pytest.approx(out.stats.processed_tokens, abs=1e-2)
        for r in steps:
            assert all(r.block_start <= c.position < r.block_end for c in r.committed)
            assert all(c.confidence is not None and 0.0 <= c.confidence <= 1.0 + 1e-6 for c in r.committed)
            assert all(c.text is not None for c in r.committed)  # the checkpoints have tokenizers


def reported(result, strategy: str) -> bool:
    key = REPORTS.get(strategy)
    return key is None or any(r.strategies.get(strategy, {}).get(key) for out in result for r in out.steps)


def test_off_by_default_and_free(llada):
    out = llada.chat(CHATS[0], SamplingParams(max_new_tokens=24, block_length=8))
    assert out[0].steps is None
    seq_params = llada.resolve(SamplingParams())
    assert seq_params.record_steps is False


@pytest.mark.parametrize("method", allowed_methods("dual-cache") + allowed_methods("prefix-cache"))
def test_replay_rebuilds_llada_outputs(llada, method):
    result = run(llada, method)
    check_replay(llada, result)
    for name in method.split("+")[1:]:
        assert reported(result, name), f"{name} reported nothing on {method}"


def test_replay_reference_and_threshold(llada):
    """reference (fixed steps over the whole canvas) and the dual-cache threshold rule."""
    check_replay(llada, run(llada, "reference"))
    check_replay(llada, run(llada, "reference+adaptive-length"))
    result = llada.chat(CHATS, SamplingParams(method="dual-cache", max_new_tokens=24, block_length=8,
                                              threshold=0.9, record_steps=True))
    check_replay(llada, result)
    for r in (r for out in result for r in out.steps):  # the rule: >= threshold, else the best one
        assert len(r.committed) == 1 or all(c.confidence >= 0.9 for c in r.committed)


@pytest.mark.parametrize("method", allowed_methods("block"))
def test_replay_rebuilds_sdar_outputs(sdar, method):
    params = SamplingParams(method=method, max_new_tokens=24, block_length=8, steps=8, record_steps=True)
    result = sdar.chat(CHATS, params)
    check_replay(sdar, result)
    for name in method.split("+")[1:]:
        if name != "adaptive-length":  # SDAR: a cut only ends the sequence after its block
            assert reported(result, name), f"{name} reported nothing on {method}"


@pytest.fixture(scope="module")
def dream(tmp_path_factory):
    return LLM(write_checkpoint(tmp_path_factory.mktemp("dream") / "Dream", "Dream"))


@pytest.mark.parametrize("method", ["dual-cache+focus", "dual-cache+early-skip+adaptive-length"])
def test_replay_with_logit_shift(dream, method):
    """Dream reads position p's logits at p - 1: FOCUS and early skipping take that path."""
    params = SamplingParams(method=method, max_new_tokens=16, block_length=8, steps=8, record_steps=True)
    check_replay(dream, dream.generate([[20, 21, 22, 23], [30, 31]], params), 16)


def test_sampling_records_replay(llada):
    """Temperature sampling (the per-sequence rule, not the batched greedy one)."""
    check_replay(llada, run(llada, "dual-cache+jump-share", temperature=0.7, seed=3))
    check_replay(llada, run(llada, "dual-cache+focus", temperature=0.7, seed=3))


def test_strategy_records_are_what_the_strategies_did(llada):
    """Evicted / skipped slots are masked block slots not committed that step; accepted drafts
    are drafted and committed; a cut shortens the canvas."""
    for method in ("dual-cache+focus", "dual-cache+early-skip", "dual-cache+jump-share"):
        for out in run(llada, method):
            for r in out.steps:
                done = {c.position for c in r.committed}
                rec = next(iter(r.strategies.values()), {})
                for pos in rec.get("evicted", []) + [p for p, _ in rec.get("skipped", [])]:
                    assert r.block_start <= pos < r.block_end and pos not in done
                assert set(rec.get("accepted", [])) <= set(rec.get("drafted", [])) & done
    out = run(llada, "dual-cache+adaptive-length")
    cuts = [(r, r.strategies["adaptive-length"]) for o in out for r in o.steps if r.strategies]
    assert cuts and all(r.canvas_len == cut["cut_to"] for r, cut in cuts)


def test_tampered_records_do_not_replay(llada):
    out = run(llada, "dual-cache")[0]
    prompt_len, stops = len(out.prompt_token_ids), llada.token_ids.stop_ids
    first = next(i for i, r in enumerate(out.steps) if any(c.position == prompt_len for c in r.committed))
    assert out.token_ids and replay(out.steps[:first] + out.steps[first + 1:], prompt_len, 24, stops) == []
    with pytest.raises(ValueError, match="committed twice"):
        replay(out.steps + out.steps[:1], prompt_len, 24, stops)


def test_records_as_json_and_text(llada):
    out = run(llada, "dual-cache+early-skip")[0]
    data = [r.as_dict() for r in out.steps]
    assert [record_from_dict(d) for d in data] == out.steps
    assert set(data[0]) == {"step", "block", "block_start", "block_end", "block_step", "canvas_len",
                            "processed_tokens", "seconds", "committed", "strategies"}
    assert all(a.seconds <= b.seconds for a, b in zip(out.steps, out.steps[1:]))
    text = format_steps(out.steps, len(out.prompt_token_ids))
    assert text.count("\n") == len(out.steps) and "early-skip skipped=" in text
    frames = canvas_frames(out.steps, len(out.prompt_token_ids))
    assert len(frames) == len(out.steps) and None not in frames[-1][: len(out.token_ids)]
    assert frames[-1][: len(out.token_ids)] == out.token_ids
    assert summary({"focus": {"evicted": [1, 2]}, "x": {"cut_to": 9}}) == "focus evicted=2 | x cut_to=9"
    assert [r.step for r in out.steps] == list(range(len(out.steps)))  # one record per forward, in order
    assert out.steps[0].block == 0 and out.steps[0].block_step == 0


@pytest.mark.parametrize("method", ["dual-cache+jump-share", "dual-cache+early-skip+adaptive-length",
                                    "dual-cache+focus"])
def test_recording_changes_no_token(llada, method):
    params = SamplingParams(method=method, max_new_tokens=24, block_length=8, steps=8)
    plain = llada.chat(CHATS, params)
    traced = llada.chat(CHATS, params.replace(record_steps=True))
    assert [o.token_ids for o in traced] == [o.token_ids for o in plain]
    assert traced.stats.nfe == plain.stats.nfe


def test_generate_show_steps_prints_one_line_per_forward(capsys):
    from dllm_engine.cli import main
    argv = ["generate", "--prompt", "sort : 3 1 2", "--chat", "--method", "dual-cache+focus", "--max-new-tokens",
            "16", "--block-length", "8", "--steps", "8", "--threads", "1", "--show-steps"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    nfe = int(out.split("nfe=")[1].split()[0])
    lines = [ln for ln in out.splitlines() if ln.startswith("step ")]
    assert len(lines) == nfe and f"{nfe} steps (" in out and "focus evicted=" in out
    assert main(argv[:-1]) == 0 and "step   0" not in capsys.readouterr().out
