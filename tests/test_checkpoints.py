"""The shipped checkpoints have learned the task suite: a CI-fast eval on the held-out split.

Exact match over whole answers has a chance level of practically zero (the shortest answers are
four tokens over a vocabulary of 95 or more words), so the thresholds below are far above chance
while leaving room under what this subset scores today (copy: tiny-llada 95.8%, tiny-sdar 87.5%;
the whole split in the model cards: 95.5% and 90.5%). Both have also learned the worked answers
(the whole worked split: tiny-llada 93.8% with `dual-cache`, tiny-sdar 83.3% with `block`).
"""
import re
from pathlib import Path

import pytest

from dllm_engine import LLM, SamplingParams
from dllm_engine.eval import evaluate
from dllm_engine.eval.chain_probe import chain_probe
from dllm_engine.tasks import load_split

pytestmark = pytest.mark.slow  # the shipped checkpoints on held-out tasks

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


def test_tiny_sdar_solves_held_out_worked_answers():
    llm = LLM(CHECKPOINTS / "tiny-sdar")
    report = evaluate(llm, SamplingParams(method="block", threshold=0.9), tasks="worked", limit=4,
                      batch_size=16, use_tqdm=False)
    accuracy = {t: r.accuracy for t, r in report.tasks.items()}
    assert set(accuracy) == {"sum", "add", "insert", "story"}
    assert report.accuracy >= 0.5, accuracy  # whole answers of 40-180 tokens, every result right
    assert min(r.stats.output_tokens for r in report.tasks.values()) > 40 * 4  # long answers, not stubs


def test_tiny_llada_computes_results_at_a_masked_slot():
    """tiny-llada computes a worked answer's results where the decoders ask for them, with the
    answer masked from the result on (100% of `sum`'s results in its card's chain probe), and gets
    whole answers right (4 of 4 `sum`, 4 of 4 `insert` here)."""
    llm = LLM(CHECKPOINTS / "tiny-llada")
    probe = chain_probe(llm, load_split(["sum"], limit=4))["sum"]
    assert probe.results >= 8 and probe.right_masked >= 0.8 * probe.results, probe
    report = evaluate(llm, SamplingParams(method="dual-cache", threshold=0.9), tasks="sum,insert",
                      limit=4, batch_size=8, use_tqdm=False)
    assert report.accuracy >= 0.6, {t: r.accuracy for t, r in report.tasks.items()}
    assert report.tasks["sum"].stats.output_tokens > 40 * 4  # worked answers, not stubs


def test_demo_answers_its_default_prompt(capsys):
    """`make demo` (`dllm generate`, no options): the default checkpoint writes the worked answer
    of the held-out prompt it picks, and the line of speed figures follows."""
    import torch

    from dllm_engine.cli import main
    before = torch.get_num_threads()
    try:
        assert main(["generate", "--threads", "1"]) == 0
    finally:
        torch.set_num_threads(before)
    out = capsys.readouterr().out
    assert re.search(r"^prompt: story : ", out, re.M), out
    assert re.search(r"^expected: .* , answer : \d+  \(correct\)$", out, re.M), out
    assert re.search(r"^stats: nfe=\d+ .* tokens_per_step=\d+\.\d\d .* throughput=[\d.]+ tok/s$", out, re.M), out
