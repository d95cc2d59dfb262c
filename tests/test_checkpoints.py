"""The shipped checkpoints have learned the task suite: a CI-fast eval on the held-out split.

Exact match over whole answers has a chance level of practically zero (the shortest answers are
four tokens over a 95-token vocabulary), so the thresholds below are far above chance while
leaving room under what this subset scores today (tiny-llada 83%, tiny-sdar 96%; the whole split
in the model cards: 83.7% and 89.8%).
"""
from pathlib import Path

import pytest

from dllm_engine import LLM, SamplingParams
from dllm_engine.eval import evaluate

CHECKPOINTS = Path(__file__).resolve().parents[1] / "checkpoints"
PER_TASK = 4  # 24 held-out prompts


@pytest.mark.parametrize("name,method,min_accuracy", [
    ("tiny-llada", "dual-cache", 0.7),
    ("tiny-sdar", "block", 0.75),
])
def test_shipped_checkpoint_solves_held_out_tasks(name, method, min_accuracy):
    llm = LLM(CHECKPOINTS / name)
    report = evaluate(llm, SamplingParams(method=method, threshold=0.9), tasks="copy", limit=PER_TASK,
                      batch_size=24, use_tqdm=False)
    assert report.accuracy >= min_accuracy, {t: r.accuracy for t, r in report.tasks.items()}
    assert report.stats.tokens_per_step > 1.5  # confident enough for parallel decoding
