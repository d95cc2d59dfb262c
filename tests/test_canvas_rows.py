"""Rows from a model's own canvases: the phrasing that finishes a canvas, the rows a decoding
leaves, and the trainer's loss on them (``dllm canvas-rows``, ``dllm train --canvas-rows``)."""
import random
from collections import Counter

import pytest
import torch

from dllm_engine import SamplingParams
from dllm_engine.errors import UserError
from dllm_lab.tasks import TASKS, load_split
from dllm_lab.tasks.phrased import END, check_trace, fill_canvas
from dllm_lab.train import TrainConfig, Trainer
from dllm_lab.train.canvases import CanvasRows, canvas_rows
from dllm_lab.train.data import block_diffusion_mask
from fixtures import ScriptedLLM, commit_script

pytestmark = pytest.mark.lab  # dllm_lab's canvas rows

TRACED = ["calc", "shop", "biggest", "tally"]


def canvases(rng, example, keep: float, wrong: float = 0.0):
    """The gold answer with a ``keep`` share of its words written (a ``wrong`` share of those
    replaced) and the rest masked, then a masked tail."""
    words = example.answer.split()
    canvas = [None] * (len(words) + 12)
    for i, w in enumerate(words):
        if rng.random() < keep:
            canvas[i] = rng.choice(["so", "9", ",", "is"]) if rng.random() < wrong else w
    return tuple(canvas)


@pytest.mark.parametrize("task_name", TRACED)
def test_a_fill_fits_its_canvas_and_exists_exactly_when_check_trace_says(task_name):
    task, rng = TASKS[task_name], random.Random(task_name)
    fitted = refused = 0
    for ex in load_split([task_name], limit=8):
        steps = tuple(task.steps_of(ex))
        for keep, wrong in ((0.0, 0.0), (0.3, 0.0), (0.6, 0.05), (0.9, 0.02)):
            canvas = canvases(rng, ex, keep, wrong)
            fill = fill_canvas(task, steps, canvas, rng)
            assert (fill is not None) == check_trace(task, steps, canvas)
            if fill is None:
                refused += 1
                continue
            fitted += 1
            assert len(fill) <= len(canvas)
            assert all(c is None or c == w for c, w in zip(canvas, fill))  # written words kept
            assert all(c is None or c is END for c in canvas[len(fill):])
            assert check_trace(task, steps, tuple(fill))  # a right trace, as the generator writes
    assert fitted and refused


def test_fills_are_drawn_as_the_generator_writes():
    """A fill is drawn as ``phrase`` writes answers, among those that fit: on a canvas of the
    median answer's length (the longer half does not fit), the first words and lengths of 2000
    fills are distributed as those of the written answers that fit (the split's shortest trace
    among 20, for speed). Choosing among the phrasings that fit without weighing how many ways
    remain after each would favour long openings and fail here."""
    task = TASKS["calc"]
    steps = min((tuple(task.steps_of(ex)) for ex in load_split(["calc"], limit=20)), key=len)
    rng, n = random.Random(0), 2000
    written = [task.phrase(list(steps), rng) for _ in range(3 * n)]
    room = sorted(map(len, written))[len(written) // 2]
    fitting = [w for w in written if len(w) <= room]
    fills = [fill_canvas(task, steps, (None,) * room, rng) for _ in range(n)]
    for key in (lambda a: a[0], len):
        got, want = Counter(map(key, fills)), Counter(map(key, fitting))
        distance = sum(abs(got[k] / n - want[k] / len(fitting)) for k in got | want) / 2
        assert len(want) > 2 and distance < 0.05, (got, want)


def test_rows_are_finishable_canvases_as_decoded_with_a_fitting_target():
    rng, n_slots = random.Random("rows"), 256
    examples = load_split(["calc", "tally"], limit=5)
    scripts = [commit_script(rng, ex.answer.split() + ["<end>"], 0.95, ("so", "9", ",")) for ex in examples]
    frames = []  # every script's slots after each of its steps
    for script in scripts:
        slots = {}
        for step in script:
            slots.update(step)
            frames.append(dict(slots))
    llm = ScriptedLLM([list(s) for s in scripts], n_slots)
    rows = canvas_rows(llm, SamplingParams(method="dual-cache"), examples, per_answer=3, seed=1, batch_size=4)
    names = {i: w for w, i in llm.ids.items()}
    assert len(rows.inputs) == len(rows.targets) == len(rows.prompt_lengths) == sum(rows.meta["kept"].values()) > 0
    assert rows.meta["answers"] == {"calc": 5, "tally": 5} and sum(rows.meta["lost"].values()) > 0
    for inputs, targets, p in zip(rows.inputs, rows.targets, rows.prompt_lengths):
        assert inputs[:p] == targets[:p] == ScriptedLLM.PROMPT and len(inputs) == len(targets) <= p + n_slots
        canvas, target = inputs[p:], [names[t] for t in targets[p:]]
        assert 2 in canvas  # a masked slot left to learn
        assert all(c == 2 or c == t for c, t in zip(canvas, targets[p:]))  # written slots kept
        end = target.index("<end>")
        assert all(t == "<eos>" or c != 2 for c, t in zip(canvas[end + 1:], target[end + 1:]))  # EOS padding
        written = {i: names[c] for i, c in enumerate(canvas) if c != 2}  # the canvas as decoded, cut
        assert any({i: w for i, w in f.items() if i < len(canvas)} == written for f in frames)
        assert any(check_trace(TASKS[e.task], tuple(TASKS[e.task].steps_of(e)), tuple(target[:end]))
                   for e in examples)  # a right trace of one of the prompts


def block_script(rng, words: list[str], block: int, right: float, wrong: tuple[str, ...]):
    """A block-causal decoding for ``ScriptedLLM``: ``commit_script`` within each block of
    ``block`` positions (counted from the prompt's first) in turn, as SDAR's ``block`` decodes."""
    steps, start, p = [], 0, len(ScriptedLLM.PROMPT)
    while start < len(words):
        end = min(len(words), (p + start) // block * block + block - p)
        steps += [[(start + i, w) for i, w in step] for step in commit_script(rng, words[start:end], right, wrong)]
        start = end
    return steps


def test_a_block_decoders_rows_end_at_the_block_it_was_decoding():
    rng, block = random.Random("block rows"), 8
    examples = load_split(["calc", "shop"], limit=5)
    scripts = [block_script(rng, ex.answer.split() + ["<end>"], block, 0.97, ("so", "9", ",")) for ex in examples]
    llm = ScriptedLLM([list(s) for s in scripts], 256)
    rows = canvas_rows(llm, SamplingParams(method="block", block_length=block), examples, per_answer=4, seed=2,
                       batch_size=4)
    names = {i: w for w, i in llm.ids.items()}
    assert rows.block_size == block and len(rows.inputs) > 5
    for inputs, targets, p in zip(rows.inputs, rows.targets, rows.prompt_lengths):
        assert len(inputs) % block == 0  # cut at a block's end
        last_block = len(inputs) - block
        masked = [i for i, t in enumerate(inputs) if t == 2]
        assert masked and min(masked) >= max(p, last_block)  # every masked slot in the decoded block
        assert all(c == 2 or c == t for c, t in zip(inputs, targets))
        words = tuple(names[t] for t in targets[p:])
        words = words[:words.index("<end>")] if "<end>" in words else words + (None,) * 200
        assert any(check_trace(TASKS[e.task], tuple(TASKS[e.task].steps_of(e)), words) for e in examples)
    b = rows.batch([0, 1, 2], mask_id=2, eos_id=1)
    length = max(len(rows.inputs[i]) for i in range(3))
    assert b.input_ids.shape == (3, 2 * length) and b.targets.shape == (3, length)
    assert torch.equal(b.input_ids[:, length:], b.targets)  # the clean copy
    assert torch.equal(b.is_masked, b.input_ids[:, :length] == 2)  # EOS padding is no loss
    assert torch.equal(b.attention_mask, block_diffusion_mask(length, block))
    for row in range(3):
        response = rows.inputs[row][rows.prompt_lengths[row]:]
        assert b.weight[row] == pytest.approx(1 / max(0.1, response.count(2) / len(response)))


def test_rows_round_trip_and_a_bad_file_is_refused(tmp_path):
    rows = CanvasRows([[7, 2, 2], [7, 5, 2, 2]], [[7, 5, 0], [7, 5, 6, 0]], [1, 1], {"mask_id": 2})
    rows.save(tmp_path / "rows.pt")
    back = CanvasRows.load(tmp_path / "rows.pt")
    assert (back.inputs, back.targets, back.prompt_lengths, back.meta) == (rows.inputs, rows.targets, [1, 1],
                                                                           {"mask_id": 2})
    b = back.batch([0, 1], mask_id=2, eos_id=1)
    assert b.input_ids.tolist() == [[7, 2, 2, 2], [7, 5, 2, 2]]  # padded with masked slots
    assert b.targets.tolist() == [[7, 5, 0, 1], [7, 5, 6, 0]]  # whose target is EOS
    assert b.is_masked.tolist() == [[False, True, True, True], [False, False, True, True]]
    assert torch.allclose(b.weight, torch.tensor([1.0, 1.5]))  # 1 / share of the response masked
    (tmp_path / "junk.pt").write_text("not rows")
    for path, match in ((tmp_path / "junk.pt", "not a file"), (tmp_path / "none.pt", "no such file")):
        with pytest.raises(UserError, match=match):
            CanvasRows.load(path)


def test_an_interrupted_save_leaves_the_rows_file_as_it_was(tmp_path, monkeypatch):
    """A write stopped half way (Ctrl-C, a full disk) neither truncates the file already there nor
    leaves a partial one: a rerun that skips an existing rows file may trust it."""
    first = CanvasRows([[7, 2]], [[7, 5]], [1], {"mask_id": 2})
    first.save(tmp_path / "rows.pt")
    real_save = torch.save

    def half_written(obj, f):
        real_save(obj, f)
        f.truncate(10)
        raise KeyboardInterrupt

    monkeypatch.setattr(torch, "save", half_written)
    with pytest.raises(KeyboardInterrupt):
        CanvasRows([[7, 2, 2]], [[7, 5, 6]], [1], {"mask_id": 2}).save(tmp_path / "rows.pt")
    with pytest.raises(KeyboardInterrupt):
        first.save(tmp_path / "new.pt")
    monkeypatch.undo()
    assert CanvasRows.load(tmp_path / "rows.pt").inputs == [[7, 2]]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rows.pt"]  # nothing partial, nothing left over


def test_rows_of_several_rounds_join_into_one_set():
    meta = {"mask_id": 10, "eos_id": 3, "end_of_turn_id": 9, "block_size": None}
    first = CanvasRows([[1, 10]], [[1, 20]], [1], {**meta, "vocab_size": 100, "seed": 81})
    second = CanvasRows([[2, 10, 10], [2, 5, 10]], [[2, 21, 9], [2, 5, 9]], [1, 1], {**meta, "vocab_size": 120, "seed": 82})
    joined = CanvasRows.joined([first, second])
    assert joined.inputs == [[1, 10], [2, 10, 10], [2, 5, 10]]
    assert joined.targets == [[1, 20], [2, 21, 9], [2, 5, 9]] and joined.prompt_lengths == [1, 1, 1]
    assert joined.meta["vocab_size"] == 120 and [p["seed"] for p in joined.meta["parts"]] == [81, 82]
    assert joined.block_size is None
    blocks = CanvasRows([[1, 10]], [[1, 20]], [1], {**meta, "block_size": 32})
    with pytest.raises(UserError, match="different decoders or tokenizers"):
        CanvasRows.joined([first, blocks])


TINY = dict(hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=2, intermediate_size=64,
            batch_size=4, warmup=2, save_every=2, block_size=8)


@pytest.mark.slow
def test_the_trainer_adds_the_canvas_rows_loss(tmp_path):
    plain = Trainer(TrainConfig(family="llada", out=str(tmp_path / "a-out"), work=str(tmp_path / "a"), **TINY))
    enc = plain.encoder
    prompt, _ = enc.encode(load_split(["calc"], limit=1)[0])
    meta = {"mask_id": enc.mask_id, "eos_id": enc.eos_id, "end_of_turn_id": enc.end_of_turn_id,
            "vocab_size": len(plain.tokenizer)}
    rows = CanvasRows([prompt + [enc.mask_id] * 6], [prompt + [20, 21, 22, enc.end_of_turn_id, 3, 3]],
                      [len(prompt)], meta)
    rows.save(tmp_path / "rows.pt")
    with_rows = Trainer(TrainConfig(family="llada", out=str(tmp_path / "b-out"), work=str(tmp_path / "b"),
                                    canvas_rows=str(tmp_path / "rows.pt"), canvas_batch=2, **TINY))
    b = with_rows.canvas_batch(0)
    assert b.input_ids.shape == (1, len(prompt) + 6) and int(b.is_masked.sum()) == 6
    CanvasRows([prompt + [enc.mask_id] * 4], [prompt + [24, enc.end_of_turn_id, 3, 3]], [len(prompt)],
               meta).save(tmp_path / "round2.pt")
    rounds = Trainer(TrainConfig(family="llada", out=str(tmp_path / "r-out"), work=str(tmp_path / "r"),
                                 canvas_rows=[str(tmp_path / "rows.pt"), str(tmp_path / "round2.pt")],
                                 canvas_batch=2, **TINY))
    assert sorted(rounds.canvas_batch(0).targets[:, len(prompt)].tolist()) == [20, 24]  # a row of each file
    without, terms = plain.train_step(0), with_rows.train_step(0)  # one more loss term: a different update
    assert any(not torch.equal(p, q) for p, q in zip(plain.model.parameters(), with_rows.model.parameters()))
    assert set(without) == {"loss", "ar_loss", "total"} and set(terms) == set(without) | {"canvas_loss"}
    assert terms["loss"] == without["loss"] and terms["canvas_loss"] > 0  # the same examples, and the rows
    assert terms["total"] == pytest.approx(terms["loss"] + terms["ar_loss"] + terms["canvas_loss"], rel=1e-5)
    rows.meta["mask_id"] = 99
    rows.save(tmp_path / "other.pt")
    with pytest.raises(UserError, match="another tokenizer"):
        Trainer(TrainConfig(family="llada", out=str(tmp_path / "c-out"), work=str(tmp_path / "c"),
                            canvas_rows=str(tmp_path / "other.pt"), **TINY))
    with pytest.raises(UserError, match="a full-attention decoder's; a sdar run trains on a block decoder's"):
        Trainer(TrainConfig(family="sdar", out=str(tmp_path / "d-out"), work=str(tmp_path / "d"),
                            canvas_rows=str(tmp_path / "rows.pt"), **TINY))


@pytest.mark.slow
def test_an_sdar_run_trains_on_a_block_decoders_rows(tmp_path):
    plain = Trainer(TrainConfig(family="sdar", out=str(tmp_path / "a-out"), work=str(tmp_path / "a"), **TINY))
    enc = plain.encoder
    prompt, _ = enc.encode(load_split(["calc"], limit=1)[0])
    end = -(-(len(prompt) + 1) // 8) * 8  # the first block holding an answer slot
    answer = [20 + i % 5 for i in range(end - len(prompt))]
    meta = {"mask_id": enc.mask_id, "eos_id": enc.eos_id, "end_of_turn_id": enc.end_of_turn_id,
            "vocab_size": len(plain.tokenizer), "block_size": 8}
    rows = CanvasRows([prompt + [enc.mask_id] * len(answer)], [prompt + answer], [len(prompt)], meta)
    rows.save(tmp_path / "rows.pt")
    with_rows = Trainer(TrainConfig(family="sdar", out=str(tmp_path / "b-out"), work=str(tmp_path / "b"),
                                    canvas_rows=str(tmp_path / "rows.pt"), **TINY))
    b = with_rows.canvas_batch(0)
    assert b.input_ids.shape == (1, 2 * end) and int(b.is_masked.sum()) == len(answer)
    plain.train_step(0)
    with_rows.train_step(0)
    assert any(not torch.equal(p, q) for p, q in zip(plain.model.parameters(), with_rows.model.parameters()))
    for config, error in ((dict(family="sdar", block_size=4), "blocks of 8; a sdar run trains on a block decoder's with blocks of 4"),
                          (dict(family="llada"), "blocks of 8; a llada run trains on a full-attention decoder's")):
        with pytest.raises(UserError, match=error):
            Trainer(TrainConfig(out=str(tmp_path / "c-out"), work=str(tmp_path / "c"), canvas_rows=str(tmp_path / "rows.pt"),
                                **{**TINY, **config}))


def test_cli_writes_rows_and_refuses_bad_input_before_the_model_loads(tmp_path, capsys, monkeypatch):
    from pathlib import Path

    from dllm_engine.cli import common, main
    sdar = str(Path(__file__).resolve().parents[1] / "checkpoints" / "tiny-sdar")
    out = tmp_path / "rows.pt"
    assert main(["canvas-rows", "--model", sdar, "--method", "block", "--threshold", "0.9", "--tasks", "biggest",
                 "--count", "2", "--per-answer", "2", "--threads", "1", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    rows = CanvasRows.load(out)
    assert rows.meta["answers"] == {"biggest": 2} and 0 < len(rows.inputs) <= 4
    assert f"{len(rows.inputs)} rows written to {out}" in printed and "biggest" in printed
    monkeypatch.setattr(common, "load_llm", lambda *_: pytest.fail("the model loaded"))
    for argv, error in ((["--tasks", "describe"], "phrased tasks with a trace (calc, shop, biggest, tally), not describe"),
                        (["--count", "0"], "--count must be >= 1")):
        assert main(["canvas-rows", "--out", str(tmp_path / "x.pt"), *argv]) == 2
        assert error in capsys.readouterr().err
