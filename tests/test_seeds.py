"""Request seeds (seeds.py): the engine's stream for requests without one, ``n`` answers per
prompt offline, and seeded requests that reproduce alone, in any batch and in any order."""
from pathlib import Path

import pytest

from dllm_engine import LLM, SamplingParams
from dllm_engine.cli import main
from dllm_engine.seeds import SeedStream, choice_seeds
from dllm_lab.tasks import load_split

ROOT = Path(__file__).resolve().parent.parent
SAMPLED = SamplingParams(method="block", temperature=1.5, top_k=50, max_new_tokens=48)


@pytest.fixture(scope="module")
def sdar():
    return LLM(str(ROOT / "checkpoints" / "tiny-sdar"))


def conversation(i: int = 0) -> list[dict]:
    return [{"role": "user", "content": load_split(["describe"], limit=4)[i].prompt}]


def texts(outs) -> list[str]:
    return [o.text for o in outs]


def test_the_stream_is_reproducible_and_choice_j_adds_j():
    a, b = SeedStream(3), SeedStream(3)
    drawn = [a.next() for _ in range(4)]
    assert drawn == [b.next() for _ in range(4)] and len(set(drawn)) == 4
    assert all(0 <= s < 2**63 for s in drawn)
    assert SeedStream(4).next() != SeedStream(3).next()
    assert choice_seeds(2**63 - 1, 3) == [2**63 - 1, 0, 1]
    assert SeedStream(3).choice_seeds(7, 2) == [7, 8]
    fresh = SeedStream(None)
    assert fresh.next() != fresh.next()
    with pytest.raises(ValueError, match="seed must be an integer"):
        SeedStream(-1)


def test_copies_of_a_prompt_sample_independently_and_a_second_call_too(sdar):
    first = texts(sdar.chat([conversation()] * 8, SAMPLED))
    second = texts(sdar.chat([conversation()] * 8, SAMPLED))
    assert len(set(first)) >= 6 and len(set(second)) >= 6
    assert first != second


def test_a_script_run_twice_gives_the_same_answers(sdar):
    again = LLM(str(ROOT / "checkpoints" / "tiny-sdar"))  # the same stream: seed 0
    other = LLM(str(ROOT / "checkpoints" / "tiny-sdar"), seed=1)
    fresh = LLM(str(ROOT / "checkpoints" / "tiny-sdar"))
    want = texts(fresh.chat([conversation()] * 4, SAMPLED))
    assert texts(again.chat([conversation()] * 4, SAMPLED)) == want
    assert texts(other.chat([conversation()] * 4, SAMPLED)) != want


def test_a_seeded_request_is_the_same_alone_in_a_batch_and_in_any_order(sdar):
    seeded = SAMPLED.replace(seed=5)
    twice = [texts(sdar.chat([conversation()] * 8, seeded)) for _ in range(2)]
    assert twice[0] == twice[1] and len(set(twice[0])) == 1
    alone = sdar.chat([conversation(0)], seeded)[0].text
    others = [conversation(i % 3 + 1) for i in range(7)]
    batch = sdar.chat([conversation(0)] + others, [seeded] + [SAMPLED] * 7)
    reversed_batch = sdar.chat(others[::-1] + [conversation(0)], [SAMPLED] * 7 + [seeded])
    assert batch[0].text == alone == reversed_batch[-1].text


def test_n_answers_per_prompt_grouped_and_distinct(sdar):
    outs = sdar.chat([conversation(0), conversation(1)], SAMPLED.replace(n=4))
    assert len(outs) == 2 and [len(group) for group in outs] == [4, 4]
    assert all(len(set(texts(group))) == 4 for group in outs)
    # answer j of a seeded request samples with seed + j, the server's rule
    seeded = sdar.chat([conversation(1)], SAMPLED.replace(n=3, seed=20))[0]
    assert texts(seeded) == [sdar.chat([conversation(1)], SAMPLED.replace(seed=20 + j))[0].text for j in range(3)]
    with pytest.raises(ValueError, match="n must be an integer >= 1"):
        SamplingParams(n=0)


def test_greedy_answers_do_not_depend_on_seeds(sdar):
    greedy = SamplingParams(method="block", max_new_tokens=48)
    want = texts(sdar.chat([conversation(i) for i in range(3)], greedy))
    assert texts(LLM(str(ROOT / "checkpoints" / "tiny-sdar"), seed=None).chat(
        [conversation(i) for i in range(3)], greedy.replace(n=2))[0]) == [want[0]] * 2


def test_generate_samples_afresh_and_prints_the_seed_that_repeats_it(capsys):
    argv = ["generate", "--model", str(ROOT / "checkpoints" / "tiny-sdar"), "--temperature", "1.5",
            "--prompt", load_split(["describe"], limit=1)[0].prompt, "--max-new-tokens", "48"]

    def run(extra):
        assert main(argv + extra) == 0
        lines = capsys.readouterr().out.splitlines()
        seed = next(line for line in lines if line.startswith("seed: "))
        return int(seed.split()[1]), next(line for line in lines if line.startswith("output: "))

    (s1, out1), (s2, out2) = run([]), run([])
    assert s1 != s2
    assert run(["--seed", str(s1)]) == (s1, out1) and run(["--seed", str(s2)]) == (s2, out2)


def test_an_evaluation_refuses_several_answers_per_prompt(sdar):
    from dllm_engine.eval.evaluate import evaluate
    with pytest.raises(ValueError, match="n=2: an evaluation grades one answer per prompt"):
        evaluate(sdar, SAMPLED.replace(n=2), tasks=["describe"], limit=1, use_tqdm=False)
