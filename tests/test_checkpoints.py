"""The shipped checkpoints have learned the task suite: a CI-fast eval on the held-out split.

Exact match over whole answers has a chance level of practically zero (the shortest answers are
four tokens over a vocabulary of 95 or more words), so the thresholds below are far above chance
while leaving room under what this subset scores today (copy: tiny-llada 95.8%, tiny-sdar 95.8%;
the whole split in the model cards: 95.2% and 94.0%). Both have also learned the worked answers
(the whole worked split: tiny-llada 93.0% with `dual-cache`, tiny-sdar 86.8% with `block`).
"""
import re
from pathlib import Path

import pytest

from dllm_engine import LLM, SamplingParams
from dllm_engine.eval import evaluate
from dllm_lab.probes.chain_probe import chain_probe
from dllm_lab.tasks import load_split

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


@pytest.mark.parametrize("name,method", [("tiny-llada", "dual-cache"), ("tiny-sdar", "block")])
def test_shipped_checkpoint_reads_phrased_prompts(name, method):
    """Both checkpoints were trained on the phrased family too: the tokenizer is the suite's whole
    vocabulary with the same ids, and each names the right final answer of some held-out `biggest`
    prompts (tiny-llada 5, tiny-sdar 8 of the first 10), though it writes few whole traces right
    (the cards: tiny-llada 4.2%, tiny-sdar 10.4% of the phrased split)."""
    from dllm_lab.tokenizer import build_tokenizer
    llm = LLM(CHECKPOINTS / name)
    assert llm.tokenizer.get_vocab() == build_tokenizer().get_vocab()
    report = evaluate(llm, SamplingParams(method=method, threshold=0.9), tasks="biggest", limit=10,
                      batch_size=10, use_tqdm=False)
    assert report.tasks["biggest"].final_accuracy >= 0.2, report.tasks["biggest"]


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


@pytest.mark.parametrize("name,method", [("tiny-llada", "reference"), ("tiny-llada", "prefix-cache"),
                                         ("tiny-llada", "dual-cache"), ("tiny-sdar", "block")])
def test_stopping_at_the_stop_block_changes_no_text(name, method):
    """The default (stop after the block holding the first stop token) gives the text the whole
    canvas gives, in fewer forwards: a semi-autoregressive decoder never changes a committed block."""
    llm = LLM(CHECKPOINTS / name)
    prompts = [[{"role": "user", "content": e.prompt}] for e in load_split(["sort", "spell"], limit=2)]
    params = SamplingParams(method=method, max_new_tokens=64, block_length=32, threshold=0.9)
    stopping = llm.chat(prompts, params)
    whole = llm.chat(prompts, params.replace(stop_at_eos=False))
    assert [o.text for o in stopping] == [o.text for o in whole]
    assert all(o.text.strip() for o in stopping), "the answers are not empty"
    assert stopping.stats.nfe < whole.stats.nfe


def test_generate_applies_the_chat_template_unless_raw(capsys, tmp_path):
    """`dllm generate --prompt X` chats when the checkpoint has a template, and says so on stderr;
    `--raw` is a plain completion; `--chat` on a checkpoint without a template is an error."""
    import json
    import shutil

    from dllm_engine.cli import main
    argv = ["generate", "--prompt", "sort : 9 2 7 4", "--threads", "1", "--max-new-tokens", "32"]
    assert main(argv) == 0
    out, err = capsys.readouterr()
    assert "output: 2 4 7 9\n" in out and "the checkpoint's chat template applied" in err
    assert main([*argv, "--raw"]) == 0
    assert "a plain completion (--raw)" in capsys.readouterr().err
    plain = shutil.copytree(CHECKPOINTS / "tiny-llada", tmp_path / "plain")
    config = json.loads((plain / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (plain / "tokenizer_config.json").write_text(json.dumps(config))
    assert main([*argv, "--model", str(plain)]) == 0
    assert "a plain completion (the checkpoint has no chat template)" in capsys.readouterr().err
    assert main([*argv, "--model", str(plain), "--chat"]) == 2
    assert "has no chat template in its tokenizer_config.json; drop --chat" in capsys.readouterr().err
