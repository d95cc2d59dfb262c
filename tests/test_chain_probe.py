"""The chain probe: result tokens found, the right masked from each, every prediction counted."""
from pathlib import Path

import pytest
import torch

from dllm_engine import LLM
from dllm_engine.errors import UserError
from dllm_lab.probes.chain_probe import (chain_probe, copy_masked_rows, result_positions,
                                         right_masked_rows)
from dllm_lab.probes.frontier_probe import block_ends, frontier_probe, oracle_frontier_probe
from dllm_lab.tasks import load_split
from fixtures import ScriptedLLM, commit_script, write_checkpoint

pytestmark = [pytest.mark.slow, pytest.mark.lab]  # probe runs over the held-out split (dllm_lab)

CHECKPOINTS = Path(__file__).resolve().parents[1] / "checkpoints"


def test_result_positions_are_the_tokens_between_open_and_close():
    # 3 + 5 = 8 , 8 + 2 = 1 0 , answer : 0   (ids stand for words; '=' is 9, ',' is 7)
    answer = [3, 1, 5, 9, 8, 7, 8, 1, 2, 9, 1, 0, 7, 4, 6, 0]
    assert result_positions(answer, 9, 7) == [4, 10, 11]
    assert result_positions([9, 5, 5], 9, 7) == [1, 2]  # a result running to the end
    assert result_positions([1, 2, 3], 9, 7) == []


def test_right_masked_rows_keep_the_prompt_and_the_answer_before_each_target():
    ids = torch.arange(10, 20)
    rows = right_masked_rows(ids, [6, 8], start=4, mask_id=-1)
    assert rows.tolist() == [[10, 11, 12, 13, 14, 15, -1, -1, -1, -1],
                             [10, 11, 12, 13, 14, 15, 16, 17, -1, -1]]


def test_copy_masked_rows_mask_the_result_through_its_copy_only():
    # 3 + 5 = 8 , 8 + 2 = 0 , 0   ('=' is 9, ',' is 7); results at 4 and 10
    ids = torch.tensor([3, 1, 5, 9, 8, 7, 8, 1, 2, 9, 0, 7, 0])
    rows = copy_masked_rows(ids, [4, 10], close_id=7, mask_id=-1)
    assert rows.tolist() == [[3, 1, 5, 9, -1, -1, -1, 1, 2, 9, 0, 7, 0],
                             [3, 1, 5, 9, 8, 7, 8, 1, 2, 9, -1, -1, -1]]
    # a last result with no ',' after it: masked to the end
    assert copy_masked_rows(ids[:11], [10], 7, -1).tolist() == [ids[:10].tolist() + [-1]]


@pytest.mark.parametrize("family", ["llada", "sdar"])
def test_chain_probe_counts_every_result_token(tmp_path, family):
    llm = LLM(write_checkpoint(tmp_path / family, family, vocab_size=128))  # the worked words too
    examples = load_split(["sum", "add"], limit=2)
    rows = chain_probe(llm, examples)
    vocab = llm.tokenizer.get_vocab()
    for task in ("sum", "add"):
        want = sum(len(result_positions(llm.tokenizer.encode(e.answer, add_special_tokens=False),
                                        vocab["="], vocab[","])) for e in examples if e.task == task)
        row = rows[task]
        assert row.results == want > 0
        # each count is a share of the results; their values are checked one row at a time
        # on the trained tiny-llada below (a random checkpoint predicts next to nothing)
        assert all(0 <= n <= row.results for n in (row.right_masked, row.causal, row.copy_masked,
                                                  row.block_masked))


def test_a_model_without_the_worked_words_is_refused_by_name(tmp_path):
    llm = LLM(write_checkpoint(tmp_path / "llada", "llada"))  # 96 ids: the copy suite's only
    with pytest.raises(ValueError, match=r"a prompt of task sum: prompt has token ids outside \[0, 96\)"):
        chain_probe(llm, load_split(["sum"], limit=1))


def test_block_masked_is_right_masked_for_a_block_causal_family():
    """SDAR's own attention is the block-causal view (its config's block size, not the
    argument's): the shipped tiny-sdar, which gets most results right, counts the same."""
    llm = LLM(CHECKPOINTS / "tiny-sdar")
    rows = chain_probe(llm, load_split(["sum", "story"], limit=2), block_size=8)
    assert all(r.block_masked == r.right_masked for r in rows.values())
    assert sum(r.right_masked for r in rows.values()) > 0


def test_counts_are_their_forwards_one_row_at_a_time():
    """Every count but the right-masked one, recomputed here one row at a time on the shipped
    tiny-llada (it gets some results right under each view, so a wrong mask or an off-by-one
    changes a count): block masked (the answer masked from the target on; a slot reads its own
    block of 8 and the ones before), copy masked (the target up to and including the token after
    the next ','), causal (the unmasked answer under a causal mask, read at t - 1)."""
    llm = LLM(CHECKPOINTS / "tiny-llada")
    tok, model = llm.tokenizer, llm.model
    examples = load_split(["sum", "add"], limit=2)
    vocab = tok.get_vocab()
    mask_id = llm.token_ids.mask_id

    def argmax_at(ids: list[int], mask: torch.Tensor | None, at: int) -> int:
        x = torch.tensor([ids])
        with torch.no_grad():
            hidden = model.forward_context(x, model.plain_context(x, mask))
        return int(model.logits(hidden[0, at]).argmax())

    want = {view: {"sum": 0, "add": 0} for view in ("block", "copy", "causal")}
    for ex in examples:
        prompt = tok.apply_chat_template([{"role": "user", "content": ex.prompt}],
                                         add_generation_prompt=True, tokenize=True, return_dict=False)
        answer = tok.encode(ex.answer, add_special_tokens=False)
        ids = list(prompt) + answer
        n = len(ids)
        blocks = torch.tensor([[j // 8 <= q // 8 for j in range(n)] for q in range(n)])[None, None]
        causal = torch.tensor([[j <= q for j in range(n)] for q in range(n)])[None, None]
        for i in result_positions(answer, vocab["="], vocab[","]):
            t = len(prompt) + i
            right = ids[:t] + [mask_id] * (n - t)
            want["block"][ex.task] += argmax_at(right, blocks, t) == ids[t]
            close = next((j for j in range(t + 1, n) if ids[j] == vocab[","]), None)
            end = n if close is None else min(close + 2, n)  # through the copy after ','
            copy = ids[:t] + [mask_id] * (end - t) + ids[end:]
            want["copy"][ex.task] += argmax_at(copy, None, t) == ids[t]
            want["causal"][ex.task] += argmax_at(ids, causal, t - 1) == ids[t]
    rows = chain_probe(llm, examples, block_size=8)
    assert {t: r.block_masked for t, r in rows.items()} == want["block"]
    assert {t: r.copy_masked for t, r in rows.items()} == want["copy"]
    assert {t: r.causal for t, r in rows.items()} == want["causal"]
    assert all(sum(counts.values()) > 0 for counts in want.values())
    # a block holding the whole row is full attention: the right-masked count again
    wide = chain_probe(llm, examples, block_size=4096)
    assert {t: r.block_masked for t, r in wide.items()} == {t: r.right_masked for t, r in rows.items()}


# -- the frontier probe ----------------------------------------------------------------------
def test_frontier_block_ends_follow_the_decoders_layout():
    ends = block_ends(prompt_len=10, max_new_tokens=64, block_length=32, block_causal=False)
    assert len(ends) == 64 and ends[0] == 42  # after the prompt
    assert ends[41 - 10] == 42 and ends[42 - 10] == 74
    ends = block_ends(10, 64, 32, True)
    assert ends[0] == 32 and ends[32 - 10] == 64 and ends[-1] == 96  # from position 0


@pytest.mark.parametrize("family", ["llada", "sdar"])
def test_frontier_probe_matches_the_decoders_first_step(tmp_path, family):
    """On a one-token answer the probe reads the canvas a decoder starts from: it says the step
    commits the frontier exactly when the decoder's first step does, and otherwise how far ahead
    the decoder's single commit stands; every answer token is probed once."""
    from dllm_engine import SamplingParams
    from dllm_lab.tasks import Example
    llm = LLM(write_checkpoint(tmp_path / family, family))
    method = "block" if family == "sdar" else "dual-cache"
    prompts = [f"sort : {' '.join(str((i * 7 + k) % 10) for k in range(4 + i % 5))}" for i in range(12)]
    threshold = 0.15  # a random model's top probabilities are 0.1-0.35: the frontier reaches it or not
    params = SamplingParams(method=method, threshold=threshold, max_new_tokens=64, record_steps=True)
    outs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params)
    seen = set()
    for prompt, out in zip(prompts, outs):
        first = out.steps[0]
        start = len(llm.tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                                      add_generation_prompt=True, tokenize=True,
                                                      return_dict=False))
        row = frontier_probe(llm, [Example("sort", prompt, "1")], threshold=threshold,
                             max_new_tokens=64)["sort"]
        positions = sorted(c.position for c in first.committed)
        assert row.positions == 1
        assert row.frontier_committed == int(start in positions)
        if start not in positions:  # the most confident slot is committed, ahead
            assert start + row.ahead_gap in positions and row.ahead_gap > 0
        seen.add(row.frontier_committed)
    assert seen == {0, 1}  # both cases met
    examples = load_split(["sort", "count"], limit=2)
    rows = frontier_probe(llm, examples, threshold=threshold, max_new_tokens=64, rows_per_forward=5)
    for task in ("sort", "count"):
        n = sum(len(llm.tokenizer.encode(e.answer, add_special_tokens=False)) for e in examples if e.task == task)
        row = rows[task]
        assert row.positions == n
        assert all(0 <= c <= n for c in (row.frontier_committed, row.frontier_right, row.over_threshold))
    with pytest.raises(UserError, match="max_new_tokens"):
        frontier_probe(llm, [Example("sort", "sort : 1 2", "1 2")], max_new_tokens=1)
    if family == "sdar":
        with pytest.raises(UserError, match="decodes blocks of"):
            frontier_probe(llm, examples, block_length=8)


def test_frontier_probe_on_a_template_answer():
    """The embedded tiny-llada on ``sum`` (one fixed template): with the answer right so far it
    reads the next word right and the step commits it (a template's slots are all sure)."""
    llm = LLM(CHECKPOINTS / "tiny-llada")
    row = frontier_probe(llm, load_split(["sum"], limit=2))["sum"]
    assert row.frontier_right / row.positions > 0.95
    assert row.frontier_committed == row.positions


def test_oracle_frontier_probe_reads_the_generator_s_next_word(tmp_path):
    """The oracle's frontier probability, drawn from samples, is the exact next-word probability
    the writing states give (each state's pending word, or the first words of the next step's
    writings, or the end); every position whose next word is certain reaches the threshold."""
    from collections import defaultdict
    from dllm_lab.tasks import TASKS, VOCAB
    from dllm_lab.tasks.phrased import step_writings, writing_states
    llm = LLM(write_checkpoint(tmp_path / "llada", "llada", vocab_size=len(VOCAB)))
    ex = load_split(["tally"], limit=1)[0]
    task, gold = TASKS["tally"], ex.answer.split()
    steps = task.steps_of(ex)
    exact = []
    for i in range(len(gold)):
        nexts = defaultdict(float)
        for state in writing_states(task, steps, gold[:i]):
            if state.pending:
                nexts[state.pending[0]] += state.weight
            elif state.next_step == len(steps):
                nexts["<end>"] += state.weight
            else:
                k = state.next_step
                for words, share in step_writings(task, steps[k], k, state.sep).items():
                    nexts[words[0]] += state.weight * share
        exact.append(max(nexts.values()) / sum(nexts.values()))
    row = oracle_frontier_probe(llm, [ex], samples=2000)["tally"]
    assert row.positions == len(gold)
    assert row.frontier_confidence / len(gold) == pytest.approx(sum(exact) / len(gold), abs=0.02)
    assert sum(p == 1.0 for p in exact) <= row.over_threshold < len(gold)  # sure, and unsure, places
    with pytest.raises(UserError, match="phrased tasks with a trace"):
        oracle_frontier_probe(llm, load_split(["describe"], limit=1))


# -- the canvas probe ------------------------------------------------------------------------
def test_canvas_probe_finds_the_step_that_loses_each_canvas():
    """Over random commit orders of right and wrong words, the probe's losing step (found by
    bisection) is the first frame a step-by-step check refuses, each step is classed ahead
    exactly when it leaves a masked slot left of a slot it commits, a step counts as below the
    threshold exactly when every slot it commits is, and the counts add up."""
    import random
    from dllm_engine import SamplingParams
    from dllm_lab.probes.canvas_probe import canvas_probe, canvas_table
    from dllm_lab.tasks import TASKS
    from dllm_lab.tasks.phrased import END, check_trace
    rng, n_slots = random.Random("canvas-probe"), 256
    sure = random.Random("forced")  # the commits' confidences
    examples = load_split(["calc", "tally"], limit=6)
    scripts, want = [], {}
    for ex in examples:
        task = TASKS[ex.task]
        steps = commit_script(rng, ex.answer.split() + ["<end>"] * 4, 0.93, ("so", "is", "9", ","))
        # a one-slot step is sometimes the threshold rule's forced commit (below 0.9)
        steps = [[(i, w, 0.5 if len(step) == 1 and sure.random() < 0.5 else sure.choice((0.9, 0.97)))
                  for i, w in step] for step in steps]
        scripts.append(steps)
        row = want.setdefault(ex.task, {"ahead": 0, "steps": 0, "below": 0, "below_ahead": 0, "gapless": 0,
                                        "gapless_below": 0, True: [0, 0, 0, 0, 0], False: [0, 0, 0, 0, 0]})
        canvas, frames, ahead, belows = [None] * n_slots, [], [], []
        for step in steps:
            first_masked = canvas.index(None) if None in canvas else n_slots
            gapless = all(w is None for w in canvas[first_masked:])  # the canvas this step reads
            row["gapless"] += gapless
            for i, w, _ in step:
                canvas[i] = END if w == "<end>" else w
            frames.append(tuple(canvas))
            ahead.append(any(None in canvas[:i] for i, _, _ in step))
            below = all(conf < 0.9 for _, _, conf in step)
            belows.append(below)
            row["below"] += below
            row["below_ahead"] += below and ahead[-1]
            row["gapless_below"] += below and gapless
        row["ahead"] += sum(ahead)
        row["steps"] += len(steps)
        for form in (True, False):
            lost_at = next((j for j, f in enumerate(frames)
                            if not check_trace(task, tuple(task.steps_of(ex)), f, form=form)), None)
            upto = ahead if lost_at is None else ahead[:lost_at + 1]
            counts = row[form]
            counts[0] += lost_at is not None
            counts[1] += lost_at is not None and ahead[lost_at]
            counts[2] += sum(upto)
            counts[3] += len(upto) - sum(upto)
            counts[4] += sum(belows[:len(upto)])
    llm = ScriptedLLM(scripts, n_slots)
    rows = canvas_probe(llm, SamplingParams(method="dual-cache", threshold=0.9), examples, batch_size=4)
    lost_somewhere = 0
    for task, row in rows.items():
        w = want[task]
        assert (row.answers, row.ahead, row.steps) == (6, w["ahead"], w["steps"])
        assert (row.below, row.below_ahead) == (w["below"], w["below_ahead"])
        assert 0 < row.below_ahead < row.below < row.steps  # forced steps, some of them ahead
        assert (row.gapless, row.gapless_below) == (w["gapless"], w["gapless_below"])
        assert 0 < row.gapless < row.steps  # the first step reads an empty canvas, later ones gaps
        for loss, form in ((row.form, True), (row.trace, False)):
            counts = [loss.lost, loss.lost_ahead, loss.ahead_steps, loss.frontier_steps, loss.below_steps]
            assert counts == w[form]
            assert 0 < loss.below_steps
        assert row.form.lost <= row.trace.lost  # a lost form loses the trace
        lost_somewhere += row.trace.lost
    assert 0 < lost_somewhere < 12  # some canvases kept, some lost
    # a rule other than the plain threshold (here, fixed steps) has no forced commits to count
    fixed = canvas_probe(ScriptedLLM(scripts, n_slots), SamplingParams(method="dual-cache", steps=32),
                         examples, batch_size=4)
    assert all(r.below is None and r.as_dict()["below_steps"] is None is r.as_dict()["form_below_before_loss"]
               is r.as_dict()["gapless_below"] and r.gapless > 0 for r in fixed.values())
    assert [line.split()[3] for line in canvas_table(fixed).splitlines()[1:]] == ["–", "–"]
    assert "–" not in canvas_table(rows)
    with pytest.raises(UserError, match="phrased tasks with a trace"):
        canvas_probe(llm, SamplingParams(), load_split(["describe"], limit=1))
