"""Tests for the synthetic task suite: generators, graders, committed split, train stream."""
from __future__ import annotations

import itertools
import json
import random
from collections import Counter
from pathlib import Path

import pytest

from dllm_lab.tasks import (TASK_FAMILIES, TASK_NAMES, TASKS, VOCAB, Example, grade, load_split,
                            resolve_tasks, task_family, train_examples, write_split)
from dllm_lab.tasks import splits
from dllm_lab.tasks.suite import answer_stats, main as suite_main

pytestmark = pytest.mark.lab  # the lab's task suite and tokenizer builder (dllm_lab)

COMMITTED = Path(splits.DATA_DIR) / "test"
# the tasks with one right answer, graded by exact match (phrased tasks: tests/test_phrased.py)
EXACT = TASK_FAMILIES["copy"] + TASK_FAMILIES["worked"]
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
    elif task == "count":
        out = [w for k, c in sorted(Counter(args).items()) for w in (k, str(c))]
    else:
        return _solve_worked(task, args)
    return " ".join(out)


def _solve_worked(task: str, args: list[str]) -> str:
    """The worked tasks' traces, written from the task descriptions with plain integers."""
    if task == "sum":
        total, clauses = int(args[0]), []
        for d in map(int, args[1:]):
            clauses.append(f"{total} + {d} = {(total + d) % 10}")
            total = (total + d) % 10
        return " , ".join(clauses) + f" , answer : {total}"
    if task == "add":
        plus = args.index("+")
        a, b = args[:plus], args[plus + 1:]
        value = int("".join(a)) + int("".join(b))
        clauses, carry = [], 0
        for x, y in zip(a[::-1], b[::-1]):
            s = int(x) + int(y) + carry
            clauses.append(f"{x} + {y} + {carry} = {s // 10} {s % 10}")
            carry = s // 10
        return " , ".join(clauses) + " , answer : " + " ".join(str(value))
    if task == "insert":
        passes = [f"{d} : " + " ".join(sorted(args[: i + 1])) for i, d in enumerate(args)]
        return " | ".join(passes) + " , answer : " + " ".join(sorted(args))
    # story: "<who> has N <item> . (<who> gets|gives N more|away .)* how many <item> now ?"
    sentences = " ".join(args).split(" . ")
    total, clauses = int(sentences[0].split()[2]), []
    for sentence in sentences[1:-1]:
        who, verb, amount, _ = sentence.split()
        new = total + int(amount) if verb == "gets" else total - int(amount)
        assert 0 <= new <= 9
        clauses.append(f"{total} {'+' if verb == 'gets' else '-'} {amount} = {new}")
        total = new
    assert sentences[-1].startswith("how many")
    return " , ".join(clauses) + f" , answer : {total}"


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


@pytest.mark.parametrize("task", EXACT)
def test_generated_answers_are_correct(task: str) -> None:
    for ex in _samples(task):
        assert ex.task == task
        assert ex.answer == _solve(task, ex.prompt)


@pytest.mark.parametrize("task", EXACT)
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


# family -> (longest prompt, shortest and longest answer) in words
BOUNDS = {"copy": (40, 4, 120), "worked": (80, 15, 180), "phrased": (64, 4, 200)}


@pytest.mark.parametrize("task", TASK_NAMES)
def test_format_and_length_bounds(task: str) -> None:
    vocab = set(VOCAB)
    max_prompt, shortest, longest = BOUNDS[task_family(task)]
    lengths = []
    for ex in _samples(task):
        for text in (ex.prompt, ex.answer):
            assert " ".join(text.split()) == text  # single spaces, no padding
            assert set(text.split()) <= vocab
        assert ex.prompt.startswith(f"{task} : ")
        assert len(ex.prompt.split()) <= max_prompt
        lengths.append(len(ex.answer.split()))
    assert shortest <= min(lengths) and max(lengths) <= longest
    assert len(set(lengths)) >= 4, "answer lengths must vary"


def test_length_mix_of_copy_suite() -> None:
    lengths = {t: [len(e.answer.split()) for e in _samples(t)] for t in TASK_FAMILIES["copy"]}
    long_tasks = [t for t, ls in lengths.items() if max(ls) > 60]
    assert long_tasks == ["spell"] and max(lengths["spell"]) > 100
    every = [n for ls in lengths.values() for n in ls]
    assert sum(n < 60 for n in every) / len(every) > 0.8


def test_worked_answers_are_long() -> None:
    """The worked family's committed split: median >= 48 words, mean >= 64, some >= 150."""
    lengths = sorted(len(e.answer.split()) for e in load_split("worked"))
    assert lengths[len(lengths) // 2] >= 48
    assert sum(lengths) / len(lengths) >= 64
    assert any(n >= 150 for n in lengths)


def test_worked_answers_depend_on_earlier_answer_tokens() -> None:
    """A worked answer is a chain: changing one prompt digit changes the trace after it, not only
    one token (the copy suite's sort changes one output token)."""
    ex = TASKS["sum"].generate(random.Random(3))
    words = ex.prompt.split()
    words[3] = str((int(words[3]) + 1) % 10)  # the second digit
    changed = _solve("sum", " ".join(words)).split()
    diff = [i for i, (a, b) in enumerate(zip(ex.answer.split(), changed)) if a != b]
    assert len(diff) >= len(words) - 4  # every later clause's result moved


@pytest.mark.parametrize("task", TASK_FAMILIES["worked"])
def test_final_answer_grader(task: str) -> None:
    ex = load_split([task], limit=1)[0]
    final = ex.answer.rpartition("answer :")[2].strip()
    assert final and TASKS[task].final_answer(ex.answer) == final
    assert TASKS[task].final_answer("3 + 4 = 7 , answer : " + final) == final
    assert TASKS[task].final_answer("no final line") == ""


@pytest.mark.parametrize("task", EXACT)
def test_final_answer_grade(task: str) -> None:
    """A worked answer's final-only grade passes a wrong trace with the right result and fails the
    right trace with a wrong or missing one; a copy task has no final grade (None)."""
    from dllm_lab.tasks import grade_final
    ex = load_split([task], limit=1)[0]
    if task not in TASK_FAMILIES["worked"]:
        assert grade_final(ex, ex.answer) is None and not TASKS[task].has_final_answer
        return
    head, _, final = ex.answer.rpartition("answer :")
    wrong_trace = "9 + 9 = 9 , answer :" + final
    assert grade_final(ex, ex.answer) and grade_final(ex, wrong_trace) and not grade(ex, wrong_trace)
    other = str((int(final.split()[-1]) + 1) % 10)
    assert not grade_final(ex, head + "answer : " + " ".join([*final.split()[:-1], other]))
    assert not grade_final(ex, head) and not grade_final(ex, ex.answer + " 0")


def test_resolve_tasks() -> None:
    assert resolve_tasks("all") == TASK_NAMES == resolve_tasks(None)
    assert resolve_tasks("worked") == ["sum", "add", "insert", "story"]
    assert resolve_tasks("copy") == ["sort", "reverse", "spell", "lookup", "dedup", "count"]
    assert resolve_tasks("worked,sort,sum") == ["sum", "add", "insert", "story", "sort"]
    assert resolve_tasks(["sort"]) == ["sort"]
    assert [e.task for e in load_split("worked", limit=1)] == TASK_FAMILIES["worked"]
    for bad in ("worke", "sort,nope", ","):
        with pytest.raises(ValueError, match="task"):
            resolve_tasks(bad)


def test_vocabulary_keeps_copy_suite_ids() -> None:
    """The worked words are appended, so a checkpoint trained on the copy suite keeps its ids."""
    from dllm_lab.tasks.generators import COPY_VOCAB
    assert VOCAB[: len(COPY_VOCAB)] == COPY_VOCAB and len(set(VOCAB)) == len(VOCAB)


def test_committed_split_loads() -> None:
    rows = load_split()
    assert Counter(e.task for e in rows) == {t: 100 for t in TASK_NAMES}
    assert len({e.id for e in rows}) == len(rows)
    for task in TASK_NAMES:
        assert (COMMITTED / f"{task}.jsonl").is_file()
        prompts = [e.prompt for e in rows if e.task == task]
        assert len(set(prompts)) == 100
    assert all(e.answer == _solve(e.task, e.prompt) for e in rows if e.task in EXACT)
    assert all(grade(e, e.answer) for e in rows)


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


@pytest.mark.parametrize("task, answer, results", [
    ("sum", "3 + 5 = 8 , 8 + 2 = 0 , 0 + 8 = 8 , answer : 8", 3),
    ("add", "5 + 9 + 0 = 1 4 , 7 + 8 + 1 = 1 6 , 4 + 3 + 1 = 0 8 , answer : 8 6 4", 3),
    ("insert", "3 : 3 | 1 : 1 3 | 4 : 1 3 4 , answer : 1 3 4", 3),
    ("story", "3 + 4 = 7 , 7 - 2 = 5 , answer : 5", 2),
])
def test_worked_results_count_the_chained_steps(task: str, answer: str, results: int) -> None:
    assert TASKS[task].results(answer) == results


def test_worked_results_follow_the_prompt() -> None:
    """One result per digit after the first (sum), per column (add), per digit (insert), per
    sentence after the first (story), counted from the prompt, not from the answer."""
    for ex in _samples("sum", 50):
        assert TASKS["sum"].results(ex.answer) == len(ex.prompt.split()) - 3
    for ex in _samples("add", 50):
        assert TASKS["add"].results(ex.answer) == (len(ex.prompt.split()) - 3) // 2
    for ex in _samples("insert", 50):
        assert TASKS["insert"].results(ex.answer) == len(ex.prompt.split()) - 2
    for ex in _samples("story", 50):
        assert TASKS["story"].results(ex.answer) == ex.prompt.count(" . ") - 1


def test_answer_stats() -> None:
    st = answer_stats("sum", [Example("sum", "sum : 3 5", "3 + 5 = 8 , answer : 8"),
                              Example("sum", "sum : 3 5 2", "3 + 5 = 8 , 8 + 2 = 0 , answer : 0")])
    assert st == {"answers": 2, "median_tokens": 12.0, "mean_tokens": 12.0, "max_tokens": 15,
                  "mean_results": 1.5, "tokens_per_result": 8.0}
    assert answer_stats("spell", [Example("spell", "spell : 3 1", "3 = three , 1 = one")])["mean_results"] == 0  # copy: no chain


def test_cli_stats_covers_every_task(capsys: pytest.CaptureFixture[str]) -> None:
    suite_main(["--stats"])
    lines = capsys.readouterr().out.splitlines()
    rows = {line.split()[0]: line.split() for line in lines[1:]}
    assert list(rows) == list(TASK_NAMES)
    assert all(rows[t][-1] == "-" for t in TASK_FAMILIES["copy"])
    assert all(float(rows[t][-1]) > 1 for t in TASK_FAMILIES["worked"])
    assert all(rows[t][1] == "100" for t in TASK_NAMES)


def test_train_stream_avoids_test_prompts_and_is_balanced() -> None:
    test_prompts = {e.prompt for e in load_split()}
    stream = list(itertools.islice(train_examples(0), 300 * len(TASK_NAMES)))
    assert not test_prompts & {e.prompt for e in stream}
    assert Counter(e.task for e in stream) == {t: 300 for t in TASK_NAMES}


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
    rounds = len(TASK_NAMES) - 2 + 3 + 2
    stream = list(itertools.islice(train_examples(0, mix={"lookup": 3, "spell": 2}), 100 * rounds))
    counts = Counter(e.task for e in stream)  # 100 rounds of one of each other task + 3 + 2
    assert counts == {**{t: 100 for t in TASK_NAMES}, "lookup": 300, "spell": 200}
    uniform = list(itertools.islice(train_examples(5), 100))
    assert list(itertools.islice(train_examples(5, mix={t: 1 for t in TASK_NAMES}), 100)) == uniform


def test_train_stream_mix_errors() -> None:
    with pytest.raises(ValueError, match="mix names tasks not in the stream: lookup"):
        train_examples(0, ["sort"], mix={"lookup": 2})
    with pytest.raises(ValueError, match="mix weights must be integers >= 0"):
        train_examples(0, mix={"sort": -1})
    with pytest.raises(ValueError, match="mix leaves every task out of the stream"):
        train_examples(0, ["sort", "spell"], mix={"sort": 0, "spell": 0})
    stream = list(itertools.islice(train_examples(0, ["sort", "spell"], mix={"sort": 0}), 20))
    assert {e.task for e in stream} == {"spell"}


def _write_split_file(root: Path, task: str, lines: list[str]) -> None:
    """Write a fake ``test/<task>.jsonl`` under ``root`` for error-path tests."""
    (root / "test").mkdir(parents=True, exist_ok=True)
    (root / "test" / f"{task}.jsonl").write_text("\n".join(lines) + "\n")


def test_load_split_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"unknown task 'nope'; use 'all', a family \(copy, worked, phrased\) or task names: sort"):
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
    with pytest.raises(ValueError, match="unknown task.*task names"):
        train_examples(0, ["sort", "addition"])
    with pytest.raises(ValueError, match="unknown task.*task names"):
        grade(Example("addition", "addition : 1", "1"), "1")
    with pytest.raises(ValueError, match="n must be >= 1"):
        write_split(tmp_path, n=0)
