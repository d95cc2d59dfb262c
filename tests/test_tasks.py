"""Tests for the synthetic task suite: generators, graders, committed split, train stream."""
from __future__ import annotations

import itertools
import json
import random
from collections import Counter
from pathlib import Path

import pytest

from dllm_engine.tasks import (TASK_NAMES, TASKS, VOCAB, Example, grade, load_split,
                               train_examples, write_split)
from dllm_engine.tasks import splits
from dllm_engine.tasks.suite import main as suite_main

COMMITTED = Path(splits.DATA_DIR) / "test"
DIGIT_WORDS = "zero one two three four five six seven eight nine".split()


def _samples(task: str, n: int = 300) -> list[Example]:
    """n examples of ``task`` from a fixed seed."""
    rng = random.Random(f"pytest-{task}")
    return [TASKS[task].generate(rng) for _ in range(n)]


def _solve(task: str, prompt: str) -> str:
    """Independent reference solution, parsed from the prompt text alone."""
    head, colon, *args = prompt.split()
    assert (head, colon) == (task, ":")
    if task == "sort":
        out = sorted(args)
    elif task == "reverse":
        out = args[::-1]
    elif task == "spell":
        out = " , ".join(f"{d} = {DIGIT_WORDS[int(d)]}" for d in args).split()
    elif task == "lookup":
        q = args.index("?")
        table = dict(zip(args[0:q:4], args[2:q:4]))
        out = [w for k in args[q + 1:] for w in (k, table[k])]
    elif task == "dedup":
        out = list(dict.fromkeys(args))
    else:
        out = [w for k, c in sorted(Counter(args).items()) for w in (k, str(c))]
    return " ".join(out)


def _wrong_answers(answer: str) -> list[str]:
    """Near misses a grader must reject: a changed, missing or extra token, or nothing."""
    words = answer.split()
    swapped = "zz" if words[-1] != "zz" else "yy"
    return ["", " ".join(words[:-1]), answer + " " + words[-1], " ".join(words[:-1] + [swapped]),
            answer.replace(" ", "  ", 1)]


def test_registry() -> None:
    assert len(TASKS) >= 6
    assert TASK_NAMES == list(TASKS)
    assert all(TASKS[n].name == n for n in TASK_NAMES)


@pytest.mark.parametrize("task", TASK_NAMES)
def test_generated_answers_are_correct(task: str) -> None:
    for ex in _samples(task):
        assert ex.task == task
        assert ex.answer == _solve(task, ex.prompt)


@pytest.mark.parametrize("task", TASK_NAMES)
def test_grader_accepts_right_rejects_wrong(task: str) -> None:
    for ex in _samples(task, 50):
        assert TASKS[task].grade(ex.answer, ex)
        assert TASKS[task].grade(f" \n{ex.answer} \n", ex)
        assert grade(ex, ex.answer)
        for wrong in _wrong_answers(ex.answer):
            assert not TASKS[task].grade(wrong, ex), wrong
            assert not grade(ex, wrong)


@pytest.mark.parametrize("task", TASK_NAMES)
def test_generator_is_deterministic(task: str) -> None:
    gen = TASKS[task]
    assert gen.generate(random.Random(7)) == gen.generate(random.Random(7))
    assert len({gen.generate(random.Random(s)).prompt for s in range(20)}) > 15


@pytest.mark.parametrize("task", TASK_NAMES)
def test_format_and_length_bounds(task: str) -> None:
    vocab = set(VOCAB)
    lengths = []
    for ex in _samples(task):
        for text in (ex.prompt, ex.answer):
            assert " ".join(text.split()) == text  # single spaces, no padding
            assert set(text.split()) <= vocab
        assert ex.prompt.startswith(f"{task} : ")
        assert len(ex.prompt.split()) <= 40
        lengths.append(len(ex.answer.split()))
    assert 4 <= min(lengths) and max(lengths) <= 120
    assert len(set(lengths)) >= 4, "answer lengths must vary"


def test_length_mix_across_tasks() -> None:
    lengths = {t: [len(e.answer.split()) for e in _samples(t)] for t in TASK_NAMES}
    long_tasks = [t for t, ls in lengths.items() if max(ls) > 60]
    assert long_tasks == ["spell"] and max(lengths["spell"]) > 100
    every = [n for ls in lengths.values() for n in ls]
    assert sum(n < 60 for n in every) / len(every) > 0.8


def test_committed_split_loads() -> None:
    rows = load_split()
    assert Counter(e.task for e in rows) == {t: 100 for t in TASK_NAMES}
    assert len({e.id for e in rows}) == len(rows)
    for task in TASK_NAMES:
        assert (COMMITTED / f"{task}.jsonl").is_file()
        prompts = [e.prompt for e in rows if e.task == task]
        assert len(set(prompts)) == 100
    assert all(e.answer == _solve(e.task, e.prompt) for e in rows)


def test_load_split_subset_and_limit() -> None:
    rows = load_split(["count", "sort"], limit=3)
    assert [e.id for e in rows] == ["count-000", "count-001", "count-002",
                                    "sort-000", "sort-001", "sort-002"]


def test_write_split_regenerates_committed_files(tmp_path: Path) -> None:
    write_split(tmp_path)
    for task in TASK_NAMES:
        assert (tmp_path / f"{task}.jsonl").read_bytes() == (COMMITTED / f"{task}.jsonl").read_bytes()


def test_cli_writes_split(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    suite_main(["--write-split", "--dir", str(tmp_path), "--n", "2"])
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(f"{t}.jsonl" for t in TASK_NAMES)
    assert len((tmp_path / "sort.jsonl").read_text().splitlines()) == 2
    assert "sort.jsonl" in capsys.readouterr().out


def test_train_stream_avoids_test_prompts_and_is_balanced() -> None:
    test_prompts = {e.prompt for e in load_split()}
    stream = list(itertools.islice(train_examples(0), 3000))
    assert not test_prompts & {e.prompt for e in stream}
    assert Counter(e.task for e in stream) == {t: 500 for t in TASK_NAMES}


def test_train_stream_is_deterministic_per_seed() -> None:
    first = list(itertools.islice(train_examples(1), 200))
    assert first == list(itertools.islice(train_examples(1), 200))
    assert first != list(itertools.islice(train_examples(2), 200))


def test_train_stream_skips_blocked_prompts(monkeypatch: pytest.MonkeyPatch) -> None:
    unfiltered = list(itertools.islice(train_examples(3), 30))
    blocked = frozenset(e.prompt for e in unfiltered[::2])
    monkeypatch.setattr(splits, "_test_prompts", lambda: blocked)
    filtered = list(itertools.islice(train_examples(3), 300))
    assert not blocked & {e.prompt for e in filtered}


def test_train_stream_task_subset() -> None:
    assert {e.task for e in itertools.islice(train_examples(0, ["spell"]), 20)} == {"spell"}


def test_train_stream_mix_oversamples() -> None:
    stream = list(itertools.islice(train_examples(0, mix={"lookup": 3, "spell": 2}), 900))
    counts = Counter(e.task for e in stream)  # 900 = 100 rounds of 4 + 3 + 2 = 9
    assert counts == {**{t: 100 for t in TASK_NAMES}, "lookup": 300, "spell": 200}
    uniform = list(itertools.islice(train_examples(5), 100))
    assert list(itertools.islice(train_examples(5, mix={t: 1 for t in TASK_NAMES}), 100)) == uniform


def test_train_stream_mix_errors() -> None:
    with pytest.raises(ValueError, match="mix names tasks not in the stream: lookup"):
        train_examples(0, ["sort"], mix={"lookup": 2})
    with pytest.raises(ValueError, match="mix weights must be integers >= 1"):
        train_examples(0, mix={"sort": 0})


def _write_split_file(root: Path, task: str, lines: list[str]) -> None:
    """Write a fake ``test/<task>.jsonl`` under ``root`` for error-path tests."""
    (root / "test").mkdir(parents=True, exist_ok=True)
    (root / "test" / f"{task}.jsonl").write_text("\n".join(lines) + "\n")


def test_load_split_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"unknown task\(s\) \['nope'\]; known tasks: \['sort'"):
        load_split(["sort", "nope"])
    with pytest.raises(ValueError, match="limit must be >= 1"):
        load_split(limit=0)
    with pytest.raises(ValueError, match="cannot read split file .*dev.*sort.jsonl"):
        load_split(["sort"], split="dev")
    good = json.dumps({"id": "sort-000", "task": "sort", "prompt": "sort : 2 1", "answer": "1 2"})
    _write_split_file(tmp_path, "sort", [good, "", "{not json"])
    with pytest.raises(ValueError, match=r"invalid JSON at .*sort\.jsonl:3"):
        load_split(["sort"], data_dir=tmp_path)
    _write_split_file(tmp_path, "sort", [good, json.dumps({"id": "x", "task": "sort"})])
    with pytest.raises(ValueError, match=r"invalid row at .*sort\.jsonl:2: need string fields"):
        load_split(["sort"], data_dir=tmp_path)
    _write_split_file(tmp_path, "sort", [good.replace('"task": "sort"', '"task": "count"')])
    with pytest.raises(ValueError, match=r"sort\.jsonl:1: task 'count' in file for 'sort'"):
        load_split(["sort"], data_dir=tmp_path)


def test_other_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown task.*known tasks"):
        train_examples(0, ["sort", "add"])
    with pytest.raises(ValueError, match="unknown task.*known tasks"):
        grade(Example("add", "add : 1", "1"), "1")
    with pytest.raises(ValueError, match="n must be >= 1"):
        write_split(tmp_path, n=0)
