"""The embedded task suites as lm-eval tasks: one YAML per committed split file, and groups.

``write_tasks(DIR)`` writes ``dllm_<file stem>.yaml`` for every ``*.jsonl`` in the held-out split
folder, ``dllm_<family>.yaml`` grouping each task family's files (``dllm_copy``, ``dllm_worked``) and
``dllm_suite.yaml`` grouping them all; ``lm_eval --include_path DIR --tasks dllm_suite`` then runs
offline (the rows are read by the ``datasets`` json loader). Each answer is graded by the task's own
grader (``tasks.grade``, the one ``dllm eval`` uses), so both report the same accuracy; a group's
score is the mean of its tasks' scores, as ``dllm eval``'s. A task with a final result (the worked
family) also reports ``final_answer`` (``tasks.grade_final``), and ``dllm_worked`` its mean; a task
with a form-only grade (the phrased family) reports ``form`` (``tasks.grade_form``).
"""
from __future__ import annotations

import json
from pathlib import Path

from .tasks import TASK_FAMILIES, TASKS, Example, grade, grade_final, grade_form
from .tasks.splits import DATA_DIR

GROUP = "dllm_suite"
PREFIX = "dllm_"


def metrics(data_file: Path) -> list[str]:
    """The metrics ``process_results`` reports on the rows of ``data_file``: exact match, and
    the final answer and the form where a row's task has them (each row is graded by its own
    ``task``, which the file's name need not be)."""
    tasks = {json.loads(line).get("task") for line in data_file.read_text(encoding="utf-8").splitlines()
             if line.strip()}
    known = [TASKS[t] for t in tasks if t in TASKS]
    return (["exact_match"] + (["final_answer"] if any(t.has_final_answer for t in known) else [])
            + (["form"] if any(t.has_form for t in known) else []))


def task_yaml(name: str, data_file: Path, task_metrics: list[str]) -> str:
    """One generate_until task over ``data_file`` reporting ``task_metrics`` (``metrics``; JSON
    is valid YAML: values are JSON-quoted)."""
    config = {
        "task": name,
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": str(data_file.resolve())}},
        "test_split": "test",
        "output_type": "generate_until",
        "doc_to_text": "{{prompt}}",
        "doc_to_target": "{{answer}}",
        # no max_gen_toks: the model's own default (the checkpoint's generation_config) applies
        "generation_kwargs": {"until": [], "do_sample": False},
        "metric_list": [{"metric": m, "aggregation": "mean", "higher_is_better": True}
                        for m in task_metrics],
        "metadata": {"version": 1.0},
    }
    lines = [f"{key}: {json.dumps(value)}" for key, value in config.items()]
    lines.append(f"process_results: !function {__name__}.process_results")
    return "\n".join(lines) + "\n"


def group_yaml(group: str, tasks: list[str], task_metrics: dict[str, list[str]]) -> str:
    """A group's mean of every metric all its tasks report (``task_metrics``: task name -> metrics)."""
    shared = [m for m in ("exact_match", "final_answer", "form") if all(m in task_metrics[t] for t in tasks)]
    config = {"group": group, "task": tasks,
              "aggregate_metric_list": [{"metric": m, "aggregation": "mean", "weight_by_size": False}
                                        for m in shared],
              "metadata": {"version": 1.0}}
    return "\n".join(f"{key}: {json.dumps(value)}" for key, value in config.items()) + "\n"


def write_tasks(out_dir: str | Path, split_dir: str | Path | None = None) -> list[str]:
    """Write the task and group YAMLs into ``out_dir``; returns the task names (groups aside)."""
    split_dir = Path(split_dir) if split_dir is not None else DATA_DIR / "test"
    files = sorted(split_dir.glob("*.jsonl"))
    if not files:
        raise FileNotFoundError(f"no *.jsonl split files in {split_dir}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    names = [PREFIX + f.stem for f in files]
    task_metrics = {name: metrics(path) for name, path in zip(names, files)}
    for name, path in zip(names, files):
        (out / f"{name}.yaml").write_text(task_yaml(name, path, task_metrics[name]), encoding="utf-8")
    for group, members in groups([f.stem for f in files]).items():
        (out / f"{group}.yaml").write_text(group_yaml(group, members, task_metrics), encoding="utf-8")
    return names


def groups(stems: list[str]) -> dict[str, list[str]]:
    """Group name -> task names: every family with split files here, then the whole suite."""
    families = {f"{PREFIX}{family}": [PREFIX + s for s in stems if s in members]
                for family, members in TASK_FAMILIES.items()}
    return {**{g: tasks for g, tasks in families.items() if tasks}, GROUP: [PREFIX + s for s in stems]}


def process_results(doc: dict, results: list[str]) -> dict[str, float]:
    """lm-eval hook: grade the first response with the task's own grader (and its final-answer
    and form graders where it has them)."""
    example = Example(doc["task"], doc["prompt"], doc["answer"], id=doc.get("id"))
    final, form = grade_final(example, results[0]), grade_form(example, results[0])
    return {"exact_match": float(grade(example, results[0])),
            **({} if final is None else {"final_answer": float(final)}),
            **({} if form is None else {"form": float(form)})}
