"""scripts/gpu_check.py, the one prepared device check, runs here on the CPU with tiny shapes
(``--device cpu --tiny``), so it cannot rot before a GPU is lent."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow  # a subprocess that decodes and profiles (~25 s)
def test_the_gpu_check_runs_on_the_cpu_and_writes_its_report(tmp_path):
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "--device", "cpu", "--tiny",
                          "--out", str(tmp_path)], capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stderr[-2000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    checks = report["correctness"]
    assert {r["checkpoint"] for r in checks} == {"tiny-llada", "tiny-sdar"}
    assert {r["draw"] for r in checks} == {"greedy", "sampled"}
    assert all(r["equal"] and r["rows_equal"] == r["prompts"] > 0 for r in checks)  # the CPU against itself
    # the CPU's fused SDPA kernel takes every mask and grouped-query layout the methods use
    gemma, = report["diffusion_gemma"]  # the CPU against itself: every sampled row the same
    assert gemma["equal"] and gemma["rows_equal"] == gemma["prompts"] == 3 and gemma["denoising_steps"] > 0
    fused = report["fused_attention"]
    assert len(fused) == len(checks) // 2 and all(r["fused"] and r["error"] is None for r in fused)
    cost = report["step_cost"]
    assert {r["model"] for r in cost} == {"llada-8b-shaped", "llada2-mini-shaped"}
    assert {r["method"] for r in cost} >= {"dual-cache:threshold=0.9", "block+focus:threshold=0.9"}
    for r in cost:
        assert r["steps"] > 0 and 0 < r["floor_ms"] and r["syncs_per_step"] >= 1 and r["ops_per_step"] > 0
    by_variant = {r["variant"]: r for r in cost if r["model"] == "llada-8b-shaped"}
    assert set(by_variant) == {"bf16", "int8"}  # int4 is CUDA's; --tiny leaves compiling out
    assert by_variant["int8"]["weights_mb"] < by_variant["bf16"]["weights_mb"]
    gemma_cost, = report["diffusion_gemma_cost"]  # --tiny: batch 2, eager only
    assert gemma_cost["variant"] == "bf16" and gemma_cost["batch_size"] == 2 and gemma_cost["steps"] > 0
    assert 0 < gemma_cost["forward_ms"] < gemma_cost["step_ms"] and gemma_cost["tokens_per_second"] > 0
    table = (tmp_path / "gpu_check.md").read_text()
    assert table.count("\n| llada") == len(cost) and "rows equal to the CPU's" in table
    assert table.count("\n| diffusiongemma-26B-A4B-shaped (2 layers) | bf16 |") == 1


def test_the_gpu_check_says_when_there_is_no_gpu(tmp_path):
    import torch
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is here")
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "no CUDA device" in run.stderr
