"""Datasets and commands that installed packages register (``dllm_engine.datasets``,
``dllm_engine.plugins``): the lab's task suite arrives as the dataset ``tasks``; another
package's dataset is one ``--dataset NAME`` away; a missing dataset or a broken package is one
clear line, never a crash of the engine's own commands."""
import json
from importlib.metadata import EntryPoint
from pathlib import Path

import pytest

from dllm_engine import datasets, plugins
from dllm_engine.cli import all_commands, main
from dllm_engine.datasets import Dataset
from dllm_engine.errors import UserError

TINY_LLADA = Path(__file__).resolve().parent.parent / "checkpoints" / "tiny-llada"


class Question:
    """A dataset's own example type: the engine reads it only through ``datasets.Prompt``."""

    def __init__(self, task: str, digits: str) -> None:
        self.task, self.prompt, self.id = task, f"sort : {digits}", digits
        self.answer = " ".join(sorted(digits.split()))

    def chat(self) -> list[dict]:
        return [{"role": "user", "content": self.prompt}]

    def grades(self, output_text: str):
        return output_text.strip() == self.answer, None, None


def load_digits(selection, limit):
    subsets = {"one": ["9 4 7 1", "5 1 8 3"], "two": ["9 2 7 4", "8 6 1 3"]}  # the first of each: answered right
    names = list(subsets) if selection in (None, "all") else selection.split(",")
    unknown = [n for n in names if n not in subsets]
    if unknown:
        raise UserError(f"unknown subset {unknown[0]!r}; use one, two or all")
    return [Question(n, d) for n in names for d in subsets[n][:limit]]


DIGITS = Dataset(name="digits", selections="one, two or all", load=load_digits)


@pytest.fixture
def with_digits(monkeypatch):
    """The registry as if a package had registered ``DIGITS`` beside the lab's suite."""
    monkeypatch.setattr(datasets, "registered", lambda: {**REAL, "digits": DIGITS})


REAL = datasets.registered()


def test_the_lab_registers_its_task_suite_as_tasks():
    suite = datasets.get()
    assert suite.name == datasets.DEFAULT == "tasks"
    examples = datasets.load("worked", 2)
    assert [e.task for e in examples] == ["sum", "sum", "add", "add", "insert", "insert", "story", "story"]
    first = examples[0]
    assert first.chat() == [{"role": "user", "content": first.prompt}]
    assert first.grades(first.answer) == (True, True, None)  # a worked answer: whole and final grades
    assert first.grades("0")[:2] == (False, False)
    assert suite.demo().task == "story" and [e.task for e in suite.showcase()] == ["sort", "spell", "story"]
    with pytest.raises(UserError, match="unknown task 'nope'"):
        datasets.load("nope")


def test_a_missing_dataset_says_where_it_comes_from(with_digits):
    with pytest.raises(UserError) as missing:
        datasets.get("gsm8k")
    assert str(missing.value) == ("no dataset named 'gsm8k' (installed: digits, tasks). Or give the prompts as "
                                  "a file: --prompts FILE.jsonl")
    with pytest.raises(UserError, match="limit must be >= 1"):
        datasets.load("one", 0, name="digits")


def test_without_the_lab_the_suite_is_a_clear_error(monkeypatch, capsys):
    monkeypatch.setattr(datasets, "registered", lambda: {})
    with pytest.raises(UserError) as missing:
        datasets.get()
    assert "no dataset named 'tasks' (none is installed). The task suite 'tasks' comes with the lab: " \
           "pip install dllm-lab" in str(missing.value)
    assert main(["bench", "--model", str(TINY_LLADA), "--methods", "dual-cache", "--threads", "1"]) == 2
    assert "error: no dataset named 'tasks'" in capsys.readouterr().err


def test_bench_reads_another_packages_dataset(with_digits, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["bench", "--model", str(TINY_LLADA), "--methods", "dual-cache:threshold=0.9", "--threads", "1",
                 "--dataset", "digits", "--tasks", "all", "--limit", "1", "--batch-sizes", "2",
                 "--max-new-tokens", "16", "--out", str(out)]) == 0
    assert "prompts: 2  dataset: digits, tasks: one,two  " in capsys.readouterr().out
    row, = json.loads((out / "results.json").read_text())
    assert row["tasks"] == ["one", "two"] and row["num_prompts"] == 2
    assert row["accuracy"] == 1.0  # the embedded tiny-llada sorts these, graded by the dataset's own grades
    assert main(["bench", "--model", str(TINY_LLADA), "--methods", "dual-cache", "--dataset", "digits",
                 "--tasks", "medium"]) == 2
    assert "error: unknown subset 'medium'; use one, two or all" in capsys.readouterr().err


def broken(group: str) -> EntryPoint:
    return EntryPoint(name="broken", value="dllm_no_such_package.plugin:thing", group=group)


def test_a_package_that_cannot_load_is_skipped_with_one_warning(monkeypatch):
    good = EntryPoint(name="digits", value="test_datasets:DIGITS", group=datasets.GROUP)
    monkeypatch.setattr(plugins, "entry_points", lambda group: [broken(group)] + [good] * (group == datasets.GROUP))
    with pytest.warns(plugins.PluginWarning, match=r"its dllm.datasets entry point broken = "
                                                   r"dllm_no_such_package.plugin:thing cannot be loaded "
                                                   r"\(ModuleNotFoundError"):
        assert plugins.load(datasets.GROUP) == [("digits", DIGITS)]
    with pytest.warns(plugins.PluginWarning):
        commands = all_commands()  # the engine's commands stay
    assert {"generate", "bench", "serve"} <= set(commands)


def test_an_entry_point_that_is_no_dataset_is_refused(monkeypatch):
    point = EntryPoint(name="odd", value="test_datasets:load_digits", group=datasets.GROUP)
    monkeypatch.setattr(plugins, "entry_points", lambda group: [point])
    datasets.registered.cache_clear()
    try:
        with pytest.raises(TypeError, match="the dllm.datasets entry point odd is a function, not a "
                                            "dllm_engine.datasets.Dataset"):
            datasets.registered()
    finally:
        datasets.registered.cache_clear()
