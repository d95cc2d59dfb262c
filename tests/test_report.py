"""Benchmark pages generated from `dllm bench`'s output: meta.json, table.md, page sections."""
from __future__ import annotations

import json

import pytest

from dllm_engine.bench import report


def row(method: str, batch: int, throughput: float, nfe: int, processed: float, prefill: int = 10,
        output: int = 40, decoded: int = 50, seconds: list[float] | None = None) -> dict:
    return {"method": method, "batch_size": batch, "num_prompts": 2, "accuracy": 0.5, "throughput": throughput,
            "seconds": 1.0, "nfe": nfe, "decoded_tokens": decoded, "output_tokens": output,
            "processed_tokens": processed, "redundancy": processed / decoded, "prefill_tokens": prefill,
            "peak_memory_mb": 100.0, "tasks": ["sort"], "runs_seconds": seconds or [1.0]}


def write_run(folder, rows, meta=None):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "results.json").write_text(json.dumps(rows))
    report.write_table(folder, rows, meta or {"commit": "abc1234", "date": "2026-12-03 10:00 UTC",
                                              "machine": "a CPU", "command": "dllm bench --x"})
    return folder


def test_table_gives_speedup_and_exact_work_ratios_against_the_first_spec():
    rows = [row("dual-cache", 1, 100.0, nfe=40, processed=990), row("dual-cache+x", 1, 150.0, nfe=20, processed=490),
            row("dual-cache", 8, 400.0, nfe=40, processed=990), row("dual-cache+x", 8, 800.0, nfe=80, processed=190)]
    lines = report.table(rows).splitlines()
    assert lines[0].startswith("| method | batch | accuracy | throughput (tok/s) | speed-up | forwards | query tokens |")
    assert "| 1.50× | 2.00× | 2.00× |" in lines[3]  # nfe 40 -> 20; (990 + 10) -> (490 + 10)
    assert "| 2.00× | 0.50× | 5.00× |" in lines[5]  # at batch 8 against batch 8's baseline
    assert "| 1.00× | 1.00× | 1.00× |" in lines[2]
    assert "| 1.00 | 0.80 |" not in lines[2] and "| 1.25 | 1.00 |" in lines[2]  # decoded / nfe, output / nfe


def test_table_rounds_and_variants():
    rows = [row("a", 1, 100.0, 10, 90, seconds=[1.0, 2.0]), row("a [compiled]", 1, 300.0, 10, 90, seconds=[0.5, 0.5]),
            row("b", 1, 50.0, 10, 90, seconds=[2.0, 2.0])]
    lines = report.table(rows).splitlines()
    assert " rounds |" in lines[0]
    assert "| 3.00× | 2.00–4.00× |" in lines[3]  # a variant against the same spec as loaded
    assert "| 0.50× | 0.50–1.00× |" in lines[4]


def test_meta_names_commit_date_machine_and_command():
    meta = report.collect_meta(["/usr/bin/dllm", "bench", "--model", "x y"])
    assert meta["command"] == "dllm bench --model 'x y'"
    assert meta["commit"] is None or len(meta["commit"].split("-")[0]) >= 7
    assert meta["date"].endswith("UTC") and "torch" in meta["machine"]


def test_update_page_appends_then_replaces_its_section(tmp_path):
    run = write_run(tmp_path / "run", [row("a", 1, 100.0, 10, 90), row("b", 1, 200.0, 5, 45)])
    (run / "throughput.png").write_bytes(b"png")
    page = tmp_path / "docs" / "page.md"
    page.parent.mkdir()
    page.write_text("# Page\n\nprose kept\n\n<!-- bench:other -->\nold other\n<!-- /bench:other -->\n")
    report.update_page(page, "first", run)
    text = page.read_text()
    assert "prose kept" in text and "old other" in text
    assert "commit `abc1234`, 2026-12-03 10:00 UTC, a CPU:* `dllm bench --x`" in text
    assert "| `b` | 1 |" in text and "![first](img/first.png)" in text
    assert (page.parent / "img" / "first.png").read_bytes() == b"png"
    write_run(run, [row("a", 1, 100.0, 10, 90), row("c", 1, 300.0, 5, 45)],
              {"commit": "def5678", "date": "d", "machine": "m", "command": "c"})
    report.update_page(page, "first", run)
    text = page.read_text()
    assert text.count("<!-- bench:first -->") == 1 and "| `c` | 1 |" in text and "| `b` |" not in text
    assert "def5678" in text and "abc1234" not in text and "old other" in text


def test_update_page_errors(tmp_path):
    with pytest.raises(ValueError, match="not a dllm bench output folder: results.json is missing"):
        report.update_page(tmp_path / "p.md", "x", tmp_path)
    with pytest.raises(ValueError, match="section name 'Bad Name'"):
        report.update_page(tmp_path / "p.md", "Bad Name", tmp_path)
    (tmp_path / "results.json").write_text("[]")
    (tmp_path / "meta.json").write_text("{}")
    with pytest.raises(ValueError, match="holds no rows"):
        report.load_run(tmp_path)


def test_cli_report_prints_or_writes_the_page(tmp_path, capsys):
    from dllm_engine.cli import main
    run = write_run(tmp_path / "run", [row("a", 1, 100.0, 10, 90), row("b", 1, 200.0, 5, 45)])
    assert main(["report", str(run)]) == 0
    out = capsys.readouterr().out
    assert "commit abc1234" in out and "| `b` | 1 | 50.0% | 200.0 | 2.00× | 2.00× | 1.82× |" in out  # (90 + 10) / (45 + 10)
    page = tmp_path / "bench.md"
    assert main(["report", str(run), "--page", str(page), "--section", "ab"]) == 0
    assert "<!-- bench:ab -->" in page.read_text()
    assert main(["report", str(run), "--page", str(page)]) == 2
    assert "--page and --section go together" in capsys.readouterr().err


def test_update_page_puts_the_plot_in_another_folder_linked_relative_to_the_page(tmp_path):
    run = write_run(tmp_path / "run", [row("a", 1, 100.0, 10, 90)])
    (run / "throughput.png").write_bytes(b"png")
    report.update_page(tmp_path / "README.md", "readme", run, tmp_path / "docs" / "benchmarks" / "img")
    assert "![readme](docs/benchmarks/img/readme.png)" in (tmp_path / "README.md").read_text()
    assert (tmp_path / "docs" / "benchmarks" / "img" / "readme.png").read_bytes() == b"png"
