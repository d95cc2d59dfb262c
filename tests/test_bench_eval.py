"""`dllm eval` / `dllm bench` plumbing on a tiny random checkpoint (speed is never asserted)."""
import json
import os
import re

import pytest

from dllm_engine import LLM
from dllm_engine.bench import parse_spec, run_bench
from dllm_engine.cli import main
from dllm_engine.eval import evaluate
from dllm_lab.tasks import load_split
from fixtures import write_checkpoint

pytestmark = pytest.mark.slow  # bench and eval runs

KEYS = {"method", "batch_size", "num_prompts", "accuracy", "throughput", "seconds", "nfe",
        "decoded_tokens", "output_tokens", "processed_tokens", "redundancy", "peak_memory_mb"}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("llada"), "llada")


def test_parse_spec_sets_typed_fields():
    p = parse_spec("dual-cache:threshold=0.8,block_length=16,keep_fractions=1/0.5,skip_depths=0/0.5",
                   max_new_tokens=32)
    assert p.method == "dual-cache" and p.threshold == 0.8 and p.block_length == 16
    assert p.keep_fractions == (1.0, 0.5) and p.max_new_tokens == 32
    assert parse_spec("reference").threshold is None
    assert parse_spec("dual-cache:stop_at_eos=true").stop_at_eos is True
    assert parse_spec("dual-cache:stop_at_eos=False").stop_at_eos is False


@pytest.mark.parametrize("spec,msg", [("dual-cache:thresh=0.9", "bad field 'thresh=0.9'"),
                                      ("dual-cache:threshold", "bad field 'threshold'"),
                                      ("dual-cache:threshold=high", "bad value 'high' for threshold"),
                                      ("dual-cache:stop_at_eos=maybe", "bad value 'maybe' for stop_at_eos"),
                                      ("warp", "unknown method 'warp'")])
def test_bad_specs(spec, msg):
    with pytest.raises(ValueError, match=msg):
        parse_spec(spec)


def test_bench_writes_records_and_plot(tmp_path, ckpt):
    llm = LLM(ckpt)
    examples = load_split(["sort", "reverse"], limit=2)
    records = run_bench(llm, ["reference", "dual-cache:threshold=0.9"], [1, 2], examples, tmp_path,
                        dict(max_new_tokens=16, block_length=8), progress=lambda _: None)
    data = json.loads((tmp_path / "results.json").read_text())
    assert [r["method"] for r in data] == ["reference", "dual-cache:threshold=0.9"] * 2
    assert [r["batch_size"] for r in data] == [1, 1, 2, 2]
    for row in data:
        assert KEYS <= set(row)
        assert row["num_prompts"] == 4 and row["nfe"] > 0
        assert row["accuracy"] * 4 == round(row["accuracy"] * 4)  # a share of the 4 prompts
    # same prompts, same greedy decoder: batch size changes nothing but speed
    assert data[0]["decoded_tokens"] == data[2]["decoded_tokens"]
    assert [r["accuracy"] for r in data[:2]] == [r["accuracy"] for r in data[2:]]
    assert (tmp_path / "throughput.png").stat().st_size > 1000
    assert len(records) == 4


def test_bench_rejects_unwritable_output(tmp_path, ckpt):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ValueError, match="cannot write to output folder"):
        run_bench(LLM(ckpt), ["reference"], [1], load_split(["sort"], limit=1), blocker / "out")


def test_bench_rejects_bad_batch_sizes(tmp_path, ckpt):
    with pytest.raises(ValueError, match="batch sizes must be >= 1"):
        run_bench(LLM(ckpt), ["reference"], [0], load_split(["sort"], limit=1), tmp_path)


def test_eval_reports_steps_by_commits_and_stop_share(ckpt):
    """One token per step (fixed steps = block length) puts every step in the "1" bucket; the
    stop share is the decoded tokens past the answer."""
    from dllm_engine import SamplingParams
    from dllm_engine.eval.evaluate import commit_histogram
    params = SamplingParams(method="reference", max_new_tokens=16, block_length=8, steps=8)
    report = evaluate(LLM(ckpt), params, tasks="sort", limit=2, batch_size=2, use_tqdm=False)
    s = report.stats
    assert s.step_commits == {1: s.nfe} and commit_histogram(s)["1"] == 1.0
    assert sum(commit_histogram(s).values()) == pytest.approx(1.0)
    assert s.stop_share == pytest.approx(1 - s.output_tokens / s.decoded_tokens)
    row = report.as_dict()["tasks"][0]
    assert row["steps_by_commits"]["1"] == 1.0 and row["stop_share"] == round(s.stop_share, 4)
    fast = evaluate(LLM(ckpt), SamplingParams(method="dual-cache", max_new_tokens=16, block_length=8,
                                              threshold=0.5), tasks="sort", limit=2, batch_size=2,
                    use_tqdm=False).stats
    assert sum(k * n for k, n in fast.step_commits.items()) == fast.decoded_tokens


def test_commits_ahead_of_the_frontier_are_counted_with_their_gaps():
    """A token committed with masked slots on its left counts once, its gap is those slots (the
    tokens committed in the same call included, as they are no longer masked)."""
    import torch
    from dllm_engine.engine.sequence import Sequence, SequenceStats, TokenIds
    from dllm_engine.resolve import resolve_params
    from dllm_engine import SamplingParams
    p = resolve_params(SamplingParams(method="dual-cache", max_new_tokens=8, block_length=8), ("dual-cache",))
    seq = Sequence(0, [5, 6, 7], p, TokenIds(mask_id=4, eos_id=3, stop_ids=frozenset({3})))
    t = lambda *xs: torch.tensor(xs)  # noqa: E731
    seq.commit(t(5), t(9))  # generated slot 2: slots 0 and 1 still masked
    seq.commit(t(3, 4), t(9, 9))  # the frontier: nothing masked on their left
    seq.commit(t(6), t(9))
    seq.commit(t(10, 8), t(9, 9))  # 10 leaves 7 and 9 masked, 8 leaves 7
    s = seq.stats
    assert (s.decoded_tokens, s.ahead_tokens, s.ahead_gaps) == (6, 3, 5)
    assert s.ahead_share == 0.5 and s.mean_ahead_gap == pytest.approx(5 / 3)
    total = SequenceStats.total([s, s], seconds=1.0)
    assert (total.ahead_tokens, total.ahead_gaps) == (6, 10) and total.as_dict()["ahead_gaps"] == 10


def test_one_token_per_step_in_order_is_never_ahead(ckpt):
    from dllm_engine import SamplingParams
    params = SamplingParams(method="reference", max_new_tokens=16, block_length=1, steps=1)
    report = evaluate(LLM(ckpt), params, tasks="sort", limit=2, batch_size=2, use_tqdm=False)
    assert report.stats.decoded_tokens > 0 and report.stats.ahead_tokens == 0
    assert report.as_dict()["ahead_share"] == 0.0 and report.as_dict()["tasks"][0]["mean_ahead_gap"] == 0.0


def test_evaluate_counts_every_prompt(ckpt):
    from dllm_engine import SamplingParams
    report = evaluate(LLM(ckpt), SamplingParams(method="dual-cache", max_new_tokens=16, block_length=8),
                      tasks=["sort", "count"], limit=3, batch_size=4, use_tqdm=False)
    assert {t: r.num_prompts for t, r in report.tasks.items()} == {"sort": 3, "count": 3}
    assert report.stats.decoded_tokens > 0 and report.as_dict()["tasks"][0]["task"] == "sort"
    with pytest.raises(ValueError, match="batch size must be >= 1"):
        evaluate(LLM(ckpt), SamplingParams(), tasks=["sort"], limit=1, batch_size=0)


def test_eval_samples_hold_every_prompt_with_the_report_s_grades(tmp_path):
    """``--samples``: one JSON line per prompt, in split order, whose grades add up to the report's
    and whose output is what the model wrote for that prompt."""
    from dllm_engine import SamplingParams
    from dllm_lab.tasks import VOCAB
    ckpt = write_checkpoint(tmp_path / "llada", "llada", vocab_size=len(VOCAB))  # reads phrased words
    llm, params = LLM(ckpt), SamplingParams(method="dual-cache", max_new_tokens=16, block_length=8)
    examples = load_split(["sort", "calc"], limit=3)
    path = tmp_path / "samples.jsonl"
    report = evaluate(llm, params, examples=examples, batch_size=4, use_tqdm=False, samples=path)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(r["id"], r["task"], r["prompt"], r["target"]) for r in rows] == \
        [(e.id, e.task, e.prompt, e.answer) for e in examples]
    for task, result in report.tasks.items():
        mine = [r for r in rows if r["task"] == task]
        assert sum(r["correct"] for r in mine) == result.correct
        assert sum(r["nfe"] for r in mine) == result.stats.nfe
        assert sum(r["output_tokens"] for r in mine) == result.stats.output_tokens
    assert {r["form_correct"] is None for r in rows if r["task"] == "sort"} == {True}  # no form grade
    assert {type(r["form_correct"]) for r in rows if r["task"] == "calc"} == {bool}
    assert rows[0]["output"] == llm.chat([examples[0].chat()], params)[0].text


def test_eval_reports_the_final_answer_grade_of_worked_tasks():
    """A reference answer with a wrong step but the right result: the model's right trace fails
    the whole-answer grade and passes the final-answer one; a copy task has no final grade."""
    import dataclasses
    from dllm_engine import SamplingParams
    from dllm_engine.cli.common import DEFAULT_MODEL
    llm = LLM(DEFAULT_MODEL)  # the embedded tiny-llada
    params = SamplingParams(method="dual-cache", threshold=0.9)
    examples = load_split(["sum", "sort"], limit=1)
    right = evaluate(llm, params, examples=examples, batch_size=2, use_tqdm=False)
    assert right.tasks["sum"].accuracy == 1.0 and right.tasks["sort"].accuracy == 1.0  # the premise
    words = examples[0].answer.split()
    words[0] = str((int(words[0]) + 1) % 10)  # the first clause's left operand: a wrong trace
    report = evaluate(llm, params, examples=[dataclasses.replace(examples[0], answer=" ".join(words)),
                                             examples[1]], batch_size=2, use_tqdm=False)
    rows = {r["task"]: r for r in report.as_dict()["tasks"]}
    assert (rows["sum"]["accuracy"], rows["sum"]["final_accuracy"]) == (0.0, 1.0)
    assert (rows["sort"]["accuracy"], rows["sort"]["final_accuracy"]) == (1.0, None)
    assert report.final_accuracy == 1.0 and report.as_dict()["final_accuracy"] == 1.0
    sum_line, sort_line = report.table().splitlines()[1:3]
    assert sum_line.split()[2:5] == ["0.0%", "100.0%", "–"] and sort_line.split()[2:5] == ["100.0%", "–", "–"]
    assert rows["sum"]["form_accuracy"] is None and report.form_accuracy is None  # one form: no grade


def test_cli_reports_errors_without_traceback(capsys, ckpt):
    assert main(["eval", "--model", str(ckpt), "--tasks", "nope", "--limit", "1"]) == 2
    assert "unknown task" in capsys.readouterr().err
    assert main(["eval", "--model", str(ckpt), "--limit", "0"]) == 2
    assert "limit" in capsys.readouterr().err
    assert main(["generate", "--model", str(ckpt / "missing")]) == 2
    assert "does not exist" in capsys.readouterr().err


@pytest.mark.parametrize("flag,want", [([], None), (["--stop-at-eos"], True), (["--no-stop-at-eos"], False)])
def test_cli_stop_at_eos_flag(ckpt, flag, want):
    import argparse
    from dllm_engine.cli.common import add_sampling_args, sampling_params
    parser = argparse.ArgumentParser()
    add_sampling_args(parser)
    params = sampling_params(parser.parse_args(flag))
    assert params.stop_at_eos is want


@pytest.mark.parametrize("argv,method,alpha,threshold", [
    (["--method", "dual-cache+focus:focus_alpha=3"], "dual-cache+focus", 3.0, 0.9),
    (["--method", "dual-cache:threshold=0.8", "--threshold", "0.7"], "dual-cache", 1.5, 0.8),
    (["--threshold", "0.7"], "dual-cache", 1.5, 0.7)])
def test_cli_method_takes_a_bench_spec(ckpt, argv, method, alpha, threshold):
    import argparse
    from dllm_engine.cli.common import add_sampling_args, sampling_params
    parser = argparse.ArgumentParser()
    add_sampling_args(parser)
    params = LLM(ckpt).resolve(sampling_params(parser.parse_args(argv)))
    assert (params.method, params.focus_alpha, params.threshold) == (method, alpha, threshold)


def test_eval_reports_a_diagnostic_strategy(ckpt, capsys):
    from dllm_engine import SamplingParams
    llm = LLM(ckpt)
    params = SamplingParams(method="dual-cache+focus-probe", max_new_tokens=16, block_length=8, threshold=0.9)
    report = evaluate(llm, params, tasks=["sort"], limit=2, use_tqdm=False)
    assert report.diagnostics["probed_steps"] > 0
    assert report.as_dict()["diagnostics"] == report.diagnostics and "top_kept_by_chance" in report.table()
    again = evaluate(llm, params, tasks=["sort"], limit=2, use_tqdm=False)
    assert again.diagnostics == report.diagnostics  # counted afresh for each evaluation
    plain = evaluate(llm, params.replace(method="dual-cache"), tasks=["sort"], limit=2, use_tqdm=False)
    assert plain.diagnostics == {} and "diagnostics" not in plain.as_dict()


def test_eval_with_default_params_resolves_the_method(ckpt):
    """``SamplingParams()`` leaves the method to the model: it reaches the engine resolved."""
    from dllm_engine import SamplingParams
    report = evaluate(LLM(ckpt), SamplingParams(), examples=load_split(limit=1)[:1], use_tqdm=False)
    assert report.method == "dual-cache" and report.stats.nfe > 0


def test_serve_bench_plot_axes_start_at_zero():
    from dllm_engine.bench.serve import LevelResult, figure
    rows = [LevelResult(c, 4, 0, 1.0, 40, 250.0 + c, 4.0, 0.5, 0.6, 0.7, 0.1, 0.2, 0.3, 1.0, 10, 2.0)
            for c in (1, 8)]
    fig = figure(rows, "test")
    assert [ax.get_ylim()[0] for ax in fig.axes] == [0.0, 0.0]
    assert fig.axes[0].get_ylim()[1] >= 258  # the data is still inside the axis


def test_eval_table_prints_every_figure_with_two_decimals(ckpt):
    from dllm_engine import SamplingParams
    report = evaluate(LLM(ckpt), SamplingParams(max_new_tokens=16, block_length=8), tasks=["sort", "count"],
                      limit=3, use_tqdm=False)
    for line in report.table().splitlines()[1:-1]:  # task rows: out_len, tok/step, ans/step, redundancy
        _, _, _, final, form, out_len, nfe, per_step, answer_per_step, redundancy, *_ = line.split()
        assert final == form == "–" and nfe.isdigit() and all(re.fullmatch(r"\d+\.\d\d", x)
                                                    for x in (out_len, per_step, answer_per_step, redundancy)), line


def test_threads_flag_sets_torch_threads(ckpt, capsys):
    import torch
    before = torch.get_num_threads()
    try:
        assert main(["generate", "--model", str(ckpt), "--prompt", "sort : b a", "--max-new-tokens", "8",
                     "--block-length", "8", "--threads", "1"]) == 0
        assert torch.get_num_threads() == 1
        assert main(["generate", "--model", str(ckpt), "--threads", "0"]) == 2
        assert "--threads must be >= 1" in capsys.readouterr().err
    finally:
        torch.set_num_threads(before)


def test_generate_shows_a_progress_bar_once_a_run_is_long(ckpt, capsys, monkeypatch):
    import dllm_engine.engine.llm as llm_module
    argv = ["generate", "--model", str(ckpt), "--prompt", "sort : b a", "--max-new-tokens", "16",
            "--block-length", "8"]
    monkeypatch.setattr(llm_module, "PROGRESS_DELAY_S", 60.0)
    assert main(argv) == 0
    assert "generate" not in capsys.readouterr().err  # a short run prints no bar
    monkeypatch.setattr(llm_module, "PROGRESS_DELAY_S", 0.0)
    assert main(argv) == 0
    assert re.search(r"generate: 100%.*16/16 \[", capsys.readouterr().err)  # committed slots of the canvas


def test_cli_bench_prints_each_spec_resolved(ckpt, tmp_path, capsys):
    assert main(["bench", "--model", str(ckpt), "--methods", "reference", "dual-cache:threshold=0.8",
                 "--batch-sizes", "1", "--tasks", "sort", "--limit", "1", "--max-new-tokens", "8",
                 "--block-length", "8", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "method: reference = reference max_new_tokens=8 block_length=8 steps=8 " in out
    assert re.search(r"^method: dual-cache:threshold=0.8 = dual-cache .*threshold=0.8 ", out, re.M)


# -- what a benchmark keeps when it is interrupted or fails, and how it writes its files ------------
BENCH_ARGS = ["--batch-sizes", "1,2", "--tasks", "sort", "--limit", "1", "--max-new-tokens", "8",
              "--block-length", "8"]


def test_cli_bench_defaults_out_to_a_new_folder_and_shows_a_bar_per_spec_and_batch(ckpt, tmp_path, capsys,
                                                                                     monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["bench", "--model", str(ckpt), "--methods", "reference", "dual-cache", *BENCH_ARGS]) == 0
    out, err = capsys.readouterr()
    folder, = (tmp_path / "bench-out").iterdir()
    assert re.fullmatch(r"\d{8}-\d{6}", folder.name) and f"writing to bench-out/{folder.name}\n" in out
    assert len(json.loads((folder / "results.json").read_text())) == 4
    for place, (batch, spec) in enumerate([(b, s) for b in (1, 2) for s in ("reference", "dual-cache")], 1):
        # the bar of each timed pass, after its place among the run's passes (it is cleared
        # when done; a fast pass may close before tqdm redraws it at 100%)
        assert re.search(rf"\[{place}/4\] {spec} batch {batch}: .*/1 ", err), err


def stop_at_call(monkeypatch, n: int | None = None, error: BaseException | None = None) -> list:
    """``bench_one`` raises ``error`` on its ``n``-th call (1-based; never when None); returns
    the methods it was called for."""
    from dllm_engine.bench import offline
    real, calls = offline.bench_one, []

    def bench_one(llm, spec, *args, **kw):
        calls.append(spec)
        if len(calls) == n:
            raise error
        return real(llm, spec, *args, **kw)
    monkeypatch.setattr(offline, "bench_one", bench_one)
    return calls


def test_bench_ctrl_c_keeps_the_rows_measured(ckpt, tmp_path, capsys, monkeypatch):
    """Ctrl-C during the second row: results.json holds the first (written as it was measured),
    the plot is drawn from it, and the command says so in one line with the shell's 130."""
    out = tmp_path / "out"
    stop_at_call(monkeypatch, 2, KeyboardInterrupt())
    assert main(["bench", "--model", str(ckpt), "--methods", "reference", "dual-cache", *BENCH_ARGS,
                 "--out", str(out)]) == 130
    err = capsys.readouterr().err  # after the progress bars: one line
    assert err.splitlines()[-1] == f"interrupted: 1 row written to {out / 'results.json'}" and "Traceback" not in err
    assert [r["method"] for r in json.loads((out / "results.json").read_text())] == ["reference"]
    assert (out / "throughput.png").read_bytes()[:4] == b"\x89PNG"
    assert sorted(p.name for p in out.iterdir()) == ["meta.json", "results.json", "table.md", "throughput.png"]  # no temp file


def test_bench_spec_failing_mid_run_keeps_the_rows_and_names_the_spec(ckpt, tmp_path, capsys, monkeypatch):
    out = tmp_path / "out"
    from dllm_engine.errors import UserError
    stop_at_call(monkeypatch, 3, UserError("the engine refused"))  # bad input found mid-run
    assert main(["bench", "--model", str(ckpt), "--methods", "reference", "dual-cache", *BENCH_ARGS,
                 "--out", str(out)]) == 2
    err = capsys.readouterr().err  # after the progress bars: one line
    last = err.splitlines()[-1]
    assert last.startswith("error: spec 'reference' at batch size 2: the engine refused") and "Traceback" not in err
    assert f"2 rows written to {out / 'results.json'}" in last
    data = json.loads((out / "results.json").read_text())
    assert [(r["method"], r["batch_size"]) for r in data] == [("reference", 1), ("dual-cache", 1)]


def scripted_seconds(monkeypatch, seconds: list[float]) -> list:
    """``bench_one`` runs for real, then reports the next of ``seconds`` as its pass's time;
    returns the (spec, batch size) of each call, in order."""
    from dllm_engine.bench import offline
    real, calls, times = offline.bench_one, [], iter(seconds)

    def bench_one(llm, spec, params, examples, batch_size, *args, **kw):
        calls.append((spec, batch_size))
        record = real(llm, spec, params, examples, batch_size, *args, **kw)
        record.seconds = next(times)
        record.runs_seconds = [record.seconds]
        record.throughput = round(record.output_tokens / record.seconds, 2)
        return record
    monkeypatch.setattr(offline, "bench_one", bench_one)
    return calls


def test_bench_repeats_run_rounds_in_turn_and_keep_each_rows_fastest_pass(ckpt, tmp_path, monkeypatch):
    from dllm_engine.bench.offline import table
    calls = scripted_seconds(monkeypatch, [2.0, 4.0, 1.0, 5.0, 3.0, 2.0,   # batch 1: rounds of (ref, dc)
                                           1.0, 1.0, 1.0, 1.0, 1.0, 1.0])  # batch 2
    specs = ["reference", "dual-cache:threshold=0.9"]
    records = run_bench(LLM(ckpt), specs, [1, 2], load_split(["sort"], limit=2), tmp_path,
                        dict(max_new_tokens=8, block_length=8), progress=lambda _: None, repeats=3)
    assert calls == [(s, b) for b in (1, 2) for _ in range(3) for s in specs]  # round-robin per batch size
    data = json.loads((tmp_path / "results.json").read_text())
    assert [(r["method"], r["batch_size"]) for r in data] == [(s, b) for b in (1, 2) for s in specs]
    ref, dc = data[0], data[1]
    assert ref["runs_seconds"] == [2.0, 1.0, 3.0] and ref["seconds"] == 1.0
    assert dc["runs_seconds"] == [4.0, 5.0, 2.0] and dc["seconds"] == 2.0
    assert dc["throughput"] == round(dc["output_tokens"] / 2.0, 2)
    # speed-up from the fastest passes; the rounds column: each round against the same round
    per_round = [(dc["output_tokens"] / t) / (ref["output_tokens"] / u) for t, u in ((4, 2), (5, 1), (2, 3))]
    row = table(records).splitlines()[3]
    speedup = dc["throughput"] / ref["throughput"]
    assert f"| {speedup:.2f}× | {min(per_round):.2f}–{max(per_round):.2f}× |" in row
    assert table(records).splitlines()[0].startswith("| method | batch | accuracy | throughput (tok/s) | speed-up | rounds |")


def test_bench_with_one_round_has_no_rounds_column(ckpt, tmp_path):
    from dllm_engine.bench.offline import table
    records = run_bench(LLM(ckpt), ["reference"], [1], load_split(["sort"], limit=1), tmp_path,
                        dict(max_new_tokens=8, block_length=8), progress=lambda _: None)
    assert "rounds" not in table(records) and len(records[0].runs_seconds) == 1


def test_bench_a_spec_given_twice_is_two_rows_in_every_round(ckpt, tmp_path, monkeypatch):
    """``--methods a a`` (an A/A check of the machine) is two rows, each with its own passes, as
    it was before rounds: not one row folding both in and written twice."""
    from dllm_engine.bench.offline import table
    llm, examples, defaults = LLM(ckpt), load_split(["sort"], limit=1), dict(max_new_tokens=8, block_length=8)
    scripted_seconds(monkeypatch, [1.0, 2.0])
    records = run_bench(llm, ["reference", "reference"], [1], examples, tmp_path / "one", defaults,
                        progress=lambda _: None)
    assert records[0] is not records[1] and [r.runs_seconds for r in records] == [[1.0], [2.0]]
    assert "rounds" not in table(records) and table(records).splitlines()[3].count("| 0.50× |") == 1
    monkeypatch.undo()
    scripted_seconds(monkeypatch, [1.0, 2.0, 3.0, 1.0])  # rounds of (first, second)
    records = run_bench(llm, ["reference", "reference"], [1], examples, tmp_path / "two", defaults,
                        progress=lambda _: None, repeats=2)
    data = json.loads((tmp_path / "two" / "results.json").read_text())
    assert [r["runs_seconds"] for r in data] == [[1.0, 3.0], [2.0, 1.0]]
    first, second = table(records).splitlines()[2:]
    assert "| 1.00× | 1.00–1.00× |" in first  # the first spec's row is its own reference
    assert "| 1.00× | 0.50–3.00× |" in second  # round by round against the first row's rounds


def scripted_passes(monkeypatch, passes: list[tuple[float, int]]) -> None:
    """``bench_one`` runs for real, then reports the next (unrounded seconds, extra output
    tokens) of ``passes`` as its pass, the way ``bench_one`` records one."""
    from dllm_engine.bench import offline
    real, script = offline.bench_one, iter(passes)

    def bench_one(*args, **kw):
        record = real(*args, **kw)
        seconds, extra = next(script)
        record.output_tokens += extra
        record.seconds, record.runs_seconds = round(seconds, 3), [round(seconds, 3)]
        record.throughput = round(record.output_tokens / seconds, 2)
        return record
    monkeypatch.setattr(offline, "bench_one", bench_one)


def test_a_rows_per_rank_memory_is_each_ranks_peak_over_its_passes(ckpt):
    from dllm_engine.bench.offline import BenchRecord
    def record(seconds, mb, ranks):
        return BenchRecord("m", 1, 1, 1.0, 10 / seconds, seconds, 1, 10, 10, 10.0, 1.0, 1, mb, ["sort"],
                           ranks, [seconds])
    row = record(2.0, 300.0, [300.0, 280.0])
    row.add_run(record(1.0, 310.0, [290.0, 310.0]))
    assert (row.seconds, row.peak_memory_mb, row.peak_memory_mb_per_rank) == (1.0, 310.0, [300.0, 310.0])


def test_bench_repeats_keep_the_fastest_pass_own_throughput(ckpt, tmp_path, monkeypatch):
    """A row's throughput is its fastest pass's own: a pass under half a millisecond (0.000 s
    once rounded) is not 0 tok/s, and a pass that decoded other tokens is not divided into the
    first pass's count."""
    llm, examples, defaults = LLM(ckpt), load_split(["sort"], limit=1), dict(max_new_tokens=8, block_length=8)
    scripted_passes(monkeypatch, [(0.002, 0), (0.0004, 0)])
    row = run_bench(llm, ["reference"], [1], examples, tmp_path / "a", defaults, progress=lambda _: None,
                    repeats=2)[0]
    assert row.runs_seconds == [0.002, 0.0] and row.seconds == 0.0
    assert row.throughput == round(row.output_tokens / 0.0004, 2) > 0
    monkeypatch.undo()
    scripted_passes(monkeypatch, [(2.0, 0), (1.0, 4), (1.5, 0)])
    row = run_bench(llm, ["reference"], [1], examples, tmp_path / "b", defaults, progress=lambda _: None,
                    repeats=3)[0]
    assert row.runs_seconds == [2.0, 1.0, 1.5] and row.seconds == 1.0
    assert row.throughput == round(row.output_tokens + 4, 2)  # the second pass's tokens over its second


def test_bench_repeats_ctrl_c_mid_round_keeps_the_finished_batch_sizes(ckpt, tmp_path, capsys, monkeypatch):
    """Rows are written once their last round ends: Ctrl-C in batch size 2's second round keeps
    batch size 1's two rows, each with its two passes."""
    out = tmp_path / "out"
    stop_at_call(monkeypatch, 7, KeyboardInterrupt())  # batch 1: 4 passes; batch 2: round 2's first
    assert main(["bench", "--model", str(ckpt), "--methods", "reference", "dual-cache", *BENCH_ARGS,
                 "--repeats", "2", "--out", str(out)]) == 130
    err = capsys.readouterr().err  # after the progress bars: one line
    assert err.splitlines()[-1] == f"interrupted: 2 rows written to {out / 'results.json'}" and "Traceback" not in err
    data = json.loads((out / "results.json").read_text())
    assert [(r["method"], r["batch_size"], len(r["runs_seconds"])) for r in data] == [
        ("reference", 1, 2), ("dual-cache", 1, 2)]


def test_bench_and_profile_refuse_repeats_below_one_before_loading(ckpt, tmp_path, capsys, monkeypatch):
    from dllm_engine.cli import common
    monkeypatch.setattr(common, "load_llm", lambda *_, **__: pytest.fail("loaded the model"))
    assert main(["bench", "--model", str(ckpt), "--methods", "reference", *BENCH_ARGS, "--repeats", "0",
                 "--out", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err == "error: --repeats must be >= 1, got 0\n"
    assert main(["profile", "--model", str(ckpt), "--methods", "dual-cache", "--repeats", "0"]) == 2
    captured = capsys.readouterr()
    assert captured.err == "error: --repeats must be >= 1, got 0\n" and captured.out == ""
    with pytest.raises(ValueError, match="repeats must be >= 1"):
        run_bench(LLM(ckpt), ["reference"], [1], load_split(["sort"], limit=1), tmp_path, repeats=0)


def test_bench_refuses_a_spec_too_long_for_the_longest_prompt_before_any_run(tmp_path, capsys, monkeypatch):
    """A canvas that fits the shortest prompt but not the longest: refused up front, naming the
    spec, before the first spec runs (it used to fail mid-run, after the rows before it)."""
    from dllm_engine.cli.common import DEFAULT_MODEL
    llm = LLM(DEFAULT_MODEL)  # the embedded tiny-llada: a context of 1024, every task's tokens
    lengths = {e.task: len(llm.apply_chat_template(e.chat())) for e in load_split(["sort", "story"], limit=1)}
    assert lengths["story"] >= lengths["sort"] + 8
    context = llm.model.config.max_position_embeddings
    spec = f"dual-cache:max_new_tokens={(context - lengths['sort']) // 8 * 8},block_length=8"
    calls = stop_at_call(monkeypatch)
    out = tmp_path / "out"
    assert main(["bench", "--model", str(DEFAULT_MODEL), "--methods", "reference", spec, "--tasks", "sort,story",
                 "--limit", "1", "--batch-sizes", "1", "--out", str(out)]) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith(f"error: spec {spec!r} on the longest prompt (task story, {lengths['story']} tokens)")
    assert f"exceed the model's context of {context} tokens" in captured.err
    assert calls == [] and "method:" not in captured.out and not (out / "results.json").exists()
    with pytest.raises(ValueError, match=re.escape(f"spec {spec!r} on the longest prompt")):  # the Python API too
        run_bench(llm, ["reference", spec], [1], load_split(["sort", "story"], limit=1), out)
    assert calls == []


def test_bench_says_it_replaces_an_earlier_results_json(ckpt, tmp_path, capsys):
    (tmp_path / "results.json").write_text("[]\n")
    assert main(["bench", "--model", str(ckpt), "--methods", "reference", *BENCH_ARGS, "--batch-sizes", "1",
                 "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.count(f"replacing {tmp_path / 'results.json'} (from an earlier run)\n") == 1
    assert len(json.loads((tmp_path / "results.json").read_text())) == 1


def no_space(*_):
    import errno
    raise OSError(errno.ENOSPC, "No space left on device")


def test_write_json_atomic_keeps_the_old_file_when_a_write_fails(tmp_path, monkeypatch):
    from dllm_engine import outputs
    from dllm_engine.outputs import write_json_atomic
    path = tmp_path / "r.json"
    write_json_atomic(path, {"a": 1})
    write_json_atomic(path, [1, 2])
    assert json.loads(path.read_text()) == [1, 2] and path.read_text().endswith("]\n")
    umask = os.umask(0)
    os.umask(umask)
    assert path.stat().st_mode & 0o777 == 0o666 & ~umask  # as a plain open would make it
    monkeypatch.setattr(outputs.os, "fsync", no_space)
    with pytest.raises(OSError, match=re.escape(f"cannot write {path}: No space left on device")):
        write_json_atomic(path, {"new": True})
    assert json.loads(path.read_text()) == [1, 2] and [p.name for p in tmp_path.iterdir()] == ["r.json"]


@pytest.mark.parametrize("command", [["eval", "--tasks", "sort", "--limit", "1", "--max-new-tokens", "8",
                                      "--block-length", "8"],
                                     ["chain-probe", "--tasks", "sum", "--limit", "1"],  # the embedded model
                                     ["frontier-probe", "--tasks", "sum", "--limit", "1"],
                                     ["canvas-probe", "--tasks", "calc", "--limit", "1", "--max-new-tokens", "32"]])
def test_json_output_failing_to_write_names_the_file_and_keeps_the_old_one(ckpt, tmp_path, capsys,
                                                                         monkeypatch, command):
    from dllm_engine import outputs
    path = tmp_path / "report.json"
    path.write_text('{"old": true}\n')
    monkeypatch.setattr(outputs.os, "fsync", no_space)  # the disk fills up as the report is written
    model = ["--model", str(ckpt)] if command[0] == "eval" else []
    assert main([*command, *model, "--json", str(path)]) == 2
    err = capsys.readouterr().err  # after eval's progress bar: one error line
    assert err.splitlines()[-1] == f"error: cannot write {path}: No space left on device" and "Traceback" not in err
    assert path.read_text() == '{"old": true}\n' and [p.name for p in tmp_path.iterdir()] == ["report.json"]


def test_ctrl_c_is_one_line_and_exit_130_for_any_command(ckpt, capsys, monkeypatch):
    from dllm_engine.cli import common

    def interrupted(*_, **__):
        raise KeyboardInterrupt
    monkeypatch.setattr(common, "load_llm", interrupted)
    for argv in (["generate", "--prompt", "sort : b a"], ["eval", "--tasks", "sort", "--limit", "1"]):
        assert main([*argv, "--model", str(ckpt)]) == 130
        assert capsys.readouterr().err == "interrupted\n"


# -- dllm bench serve without a server: the load test itself replaced by a stand-in -----------------
def level(concurrency: int):
    from dllm_engine.bench.serve import LevelResult
    return LevelResult(concurrency, 2, 0, 1.0, 16, 16.0, 2.0, 0.5, 0.6, 0.7, 0.1, 0.2, 0.3, 1.0, 4, 1.0)


def test_bench_serve_checks_its_out_folder_before_the_run(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    # nothing listens on the URL: the folder is refused first, before the server is even asked
    assert main(["bench", "serve", "--url", "http://127.0.0.1:9", "--out", str(blocker / "out")]) == 2
    assert "cannot write to output folder" in capsys.readouterr().err


def test_bench_serve_ctrl_c_keeps_the_levels_done(tmp_path, capsys, monkeypatch):
    from dllm_engine.bench import serve
    out, seen = tmp_path / "serve", []
    out.mkdir()
    (out / "serve_bench.json").write_text("{}\n")

    def run_level(url, model, examples, concurrency, *args):
        if seen:  # every level done is on disk before the next one starts
            seen.append([r["concurrency"] for r in json.loads((out / "serve_bench.json").read_text())["levels"]])
        else:
            seen.append([])
        if concurrency == 4:
            raise KeyboardInterrupt

        async def done():
            return level(concurrency)
        return done()
    monkeypatch.setattr(serve, "served_model", lambda url, timeout: "stand-in")
    monkeypatch.setattr(serve, "run_level", run_level)
    assert main(["bench", "serve", "--url", "http://unused", "--concurrency", "1,2,4,8", "--tasks", "sort",
                 "--out", str(out)]) == 130
    captured = capsys.readouterr()
    assert captured.err == f"interrupted: 2 levels written to {out / 'serve_bench.json'}\n"
    assert f"replacing {out / 'serve_bench.json'} (from an earlier run)" in captured.out
    assert seen == [[], [1], [1, 2]]
    report = json.loads((out / "serve_bench.json").read_text())
    assert report["model"] == "stand-in" and [r["concurrency"] for r in report["levels"]] == [1, 2]
    assert (out / "serve_bench.png").read_bytes()[:4] == b"\x89PNG"
    assert sorted(p.name for p in out.iterdir()) == ["meta.json", "serve_bench.json", "serve_bench.png", "table.md"]
