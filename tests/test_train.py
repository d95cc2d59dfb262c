"""Training: the objectives' batches, a smoke run, exact resume, and a loadable export."""
import json
import re

import pytest
import torch

from dllm_lab.tasks import TASK_FAMILIES, TASK_NAMES

from dllm_engine import LLM
from dllm_lab.train import TrainConfig, Trainer
from dllm_lab.train.trainer import grow_weights
from dllm_lab.train.data import (LONG_TAILS, MAX_CANVAS, MIN_T, SUFFIX_WINDOW, block_causal_mask,
                                 block_diffusion_mask, noise, pack_rows)

pytestmark = [pytest.mark.slow, pytest.mark.lab]  # training runs (dllm_lab)

TINY = dict(hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=2, intermediate_size=64,
            batch_size=4, warmup=2, save_every=2, block_size=8)


def trainer(tmp_path, family="llada", steps=6, name="run", **kw):
    return Trainer(TrainConfig(family=family, out=str(tmp_path / f"{name}-out"),
                               work=str(tmp_path / name), steps=steps, **{**TINY, **kw}))


@pytest.mark.parametrize("family", ["llada", "sdar"])
def test_masking_touches_only_the_response(tmp_path, family):
    t = trainer(tmp_path, family)
    b = t.batch(0)
    length = b.targets.shape[1]
    noisy = b.input_ids[:, :length]
    assert torch.equal(noisy[~b.is_masked], b.targets[~b.is_masked])
    assert (noisy[b.is_masked] == t.encoder.mask_id).all()
    assert (b.weight <= 1 / MIN_T + 1e-6).all() and (b.weight >= 1).all()
    prompt_end = (b.targets == t.tokenizer.convert_tokens_to_ids(
        "<|end_header_id|>" if family == "llada" else "<|im_start|>")).long().cumsum(1)
    assert not b.is_masked[prompt_end == 0].any()  # the chat prompt's start is never masked
    if family == "sdar":
        assert length % 8 == 0 and torch.equal(b.input_ids[:, length:], b.targets)


def test_suffix_masking_is_a_left_to_right_decoders_view():
    ids = torch.arange(100).repeat(64, 1)
    is_resp = torch.zeros(64, 100, dtype=torch.bool)
    is_resp[:, 20:] = True
    plain = noise(ids, is_resp, -1, torch.Generator().manual_seed(3))
    off = noise(ids, is_resp, -1, torch.Generator().manual_seed(3), suffix_mask=0.0)
    assert all(torch.equal(a, b) for a, b in zip(plain, off))  # runs without it replay exactly
    _, masked, weight = noise(ids, is_resp, -1, torch.Generator().manual_seed(3), suffix_mask=1.0)
    assert not masked[~is_resp].any()
    assert masked.any(1).float().mean() > 0.9
    for row, w in zip(masked, weight):
        if not row.any():  # a cut in the last few positions may mask nothing at a low rate
            continue
        first = int(row.float().argmax())
        assert not row[:first].any() and first >= 20
        tail = row[first + SUFFIX_WINDOW:]
        assert tail.all(), "a block past the first masked token, everything is masked"
        assert w == pytest.approx(1 / max(MIN_T, float(row.sum()) / 80))
    half = noise(ids, is_resp, -1, torch.Generator().manual_seed(3), suffix_mask=0.5)[1]
    suffix_rows = int((half != plain[1]).any(1).sum())  # the other rows keep their uniform draw
    assert 16 < suffix_rows < 48
    with pytest.raises(ValueError, match="suffix_mask must be in"):
        TrainConfig(family="llada", out="x", work="y", suffix_mask=1.5)


def test_long_tails_share_sets_how_often_the_canvas_runs_on():
    import random
    rows = [([1, 2, 3], [4] * 10), ([1, 2], [5] * 6)]  # longest prompt 3, longest response 10

    def canvases(share):
        return [pack_rows(rows, 0, random.Random(seed), long_tails=share)[0].shape[1] - 3
                for seed in range(400)]
    # a long tail is uniform in [10, 256]: past 42 with probability 214 / 247
    for share, lo, hi in [(0.0, 0, 0), (LONG_TAILS, 5, 35), (0.5, 140, 210), (1.0, 320, 380)]:
        lengths = canvases(share)
        assert all(10 <= n <= MAX_CANVAS for n in lengths)
        assert lo <= sum(n > 10 + 32 for n in lengths) <= hi, share  # past the short 0-32 EOS tail
    with pytest.raises(ValueError, match="long_tails must be in"):
        TrainConfig(family="llada", out="x", work="y", long_tails=-0.1)


def test_block_aux_adds_the_block_diffusion_loss_on_the_same_examples(tmp_path):
    plain, aux = trainer(tmp_path, name="plain"), trainer(tmp_path, name="aux", block_aux=1.0)
    b = aux.block_batch(0)
    assert b.attention_mask is not None and b.input_ids.shape[1] == 2 * b.targets.shape[1]
    assert torch.equal(b.input_ids[:, b.targets.shape[1]:], b.targets)  # the clean copy
    before = [p.detach().clone() for p in plain.model.parameters()]
    plain.train_step(0)
    terms = aux.train_step(0)  # same weights (same seed), one more loss term: a different update
    assert set(terms) == {"loss", "ar_loss", "block_loss", "total"} and terms["block_loss"] > 0
    moved = [not torch.equal(p, q) for p, q in zip(plain.model.parameters(), aux.model.parameters())]
    assert any(moved) and not all(torch.equal(p, q) for p, q in zip(before, plain.model.parameters()))
    with pytest.raises(ValueError, match="block_aux must be"):
        TrainConfig(family="sdar", out="x", work="y", block_aux=1.0)


def test_block_causal_mask_reads_own_and_earlier_blocks():
    m = block_causal_mask(5, 2)[0, 0]
    assert m.tolist() == [[i // 2 >= j // 2 for j in range(5)] for i in range(5)]


def test_block_diffusion_mask():
    m = block_diffusion_mask(4, 2)[0, 0]  # [noisy 0..3 ; clean 0..3]
    noisy_q2 = m[2].tolist()  # noisy token in block 1
    assert noisy_q2 == [False, False, True, True, True, True, False, False]
    clean_q1 = m[5].tolist()  # clean token 1 (block 0)
    assert clean_q1 == [False, False, False, False, True, True, False, False]


def test_loss_decreases_on_a_fixed_batch(tmp_path):
    t = trainer(tmp_path, lr=3e-3)
    batch = t.batch(0)
    t.batch = lambda step: batch
    losses = [t.train_step(s)["total"] for s in range(25)]
    assert sum(losses[-5:]) / 5 < 0.7 * sum(losses[:5]) / 5


def stop_at(stop: int, train_step):
    """``train_step`` that kills the run at step ``stop`` (after the state saved there)."""
    def killed(step):
        if step == stop:
            raise KeyboardInterrupt
        return train_step(step)
    return killed


@pytest.mark.parametrize("saved_on", [None, "cuda"])
def test_resume_continues_exactly(tmp_path, saved_on):
    """A run killed at step 4 resumes where it stopped, bit for bit. The device is free to change
    on resume (a CPU run may go on on a GPU and back): a state whose config names cuda resumes here."""
    whole = trainer(tmp_path, name="whole")
    whole.train()
    first = trainer(tmp_path, name="split")
    first.train_step = stop_at(4, first.train_step)
    with pytest.raises(KeyboardInterrupt):
        first.train()
    if saved_on:
        state_file = tmp_path / "split" / "state.pt"
        state = torch.load(state_file, weights_only=True)
        state["config"]["device"] = saved_on
        torch.save(state, state_file)
    resumed = trainer(tmp_path, name="split", steps=6)
    resumed.train()
    for (n, a), (_, b) in zip(whole.model.state_dict().items(), resumed.model.state_dict().items()):
        assert torch.allclose(a, b, atol=1e-6), n
    steps = [json.loads(l)["step"] for l in (tmp_path / "split" / "loss.jsonl").read_text().splitlines()]
    assert steps == list(range(6))


def test_batches_move_whole_to_the_training_device(tmp_path):
    for family in ("llada", "sdar"):
        b = trainer(tmp_path, family=family, name=family).batch(0)
        moved = b.to(torch.device("meta"))
        for field in ("input_ids", "targets", "is_masked", "weight", "attention_mask", "position_ids"):
            src, dst = getattr(b, field), getattr(moved, field)
            assert (src is None) == (dst is None), field
            if src is not None:
                assert dst.device.type == "meta" and dst.shape == src.shape and dst.dtype == src.dtype, field
        assert moved.content_length == b.content_length


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a torch build without a GPU")
def test_an_unusable_device_is_refused_before_training(tmp_path):
    with pytest.raises(ValueError, match="'cuda' is not available.*use --device cpu"):
        trainer(tmp_path, device="cuda")
    with pytest.raises(ValueError, match="not a device name"):
        trainer(tmp_path, device="gpu0")
    assert not (tmp_path / "run").exists() or not (tmp_path / "run" / "state.pt").exists()


def test_export_only_writes_the_saved_state(tmp_path):
    with pytest.raises(ValueError, match="no saved state"):
        trainer(tmp_path, name="empty").export_saved()
    t = trainer(tmp_path, name="run", steps=4)
    t.train()
    again = trainer(tmp_path, name="run", steps=4)
    out = again.export_saved()
    assert again.step == 4  # nothing trained
    exported = LLM(out).model.state_dict()
    for n, a in t.model.state_dict().items():
        assert torch.equal(a, exported[n]), n


def test_export_is_a_loadable_checkpoint(tmp_path):
    t = trainer(tmp_path, family="sdar", steps=2)
    out = t.train()
    gen = json.loads((out / "generation_config.json").read_text())
    assert gen["block_length"] == 8 and 9 in gen["eos_token_id"]  # <|im_end|>
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "sdar" and cfg["block_size"] == 8
    llm = LLM(out)
    assert llm.token_ids.mask_id == t.encoder.mask_id
    res = llm.chat([[{"role": "user", "content": "sort : 3 1 2"}]])
    assert res.stats.nfe > 0
    warm = trainer(tmp_path, family="sdar", steps=1, name="warm", init_from=str(out))
    assert torch.equal(warm.model.lm_head.weight, llm.model.lm_head.weight)


def test_bad_config():
    with pytest.raises(ValueError, match="family must be one of"):
        TrainConfig(family="gpt", out="x", work="y")
    with pytest.raises(ValueError, match="mix names tasks not in the stream: addition"):
        TrainConfig(family="llada", out="x", work="y", task_mix={"addition": 2})


def test_task_mix_reaches_the_batches(tmp_path):
    t = trainer(tmp_path, batch_size=16, task_mix={"lookup": 4})
    prompts = [t.tokenizer.decode(row) for step in range(4) for row in t.batch(step).targets]
    # one pool of 64 examples = whole rounds (every other task once, lookup 4 times) + a part round
    size = len(TASK_NAMES) - 1 + 4
    whole, rest = divmod(64, size)
    assert 4 * whole <= sum("lookup :" in p for p in prompts) <= 4 * whole + min(4, rest)


def test_task_mix_weight_zero_leaves_tasks_out(tmp_path):
    phrased = TASK_FAMILIES["phrased"]
    t = trainer(tmp_path, batch_size=16, task_mix={name: 0 for name in phrased})
    tasks = {e.task for step in range(4) for e in t.examples(step)}
    assert phrased and not tasks & set(phrased)
    assert tasks == set(TASK_NAMES) - set(phrased)


def test_cli_task_mix(tmp_path, capsys):
    from dllm_engine.cli import main
    from dllm_lab.cli.train import task_mix
    assert task_mix("lookup=3,spell=2") == {"lookup": 3, "spell": 2}
    assert task_mix("lookup=3,calc=0") == {"lookup": 3, "calc": 0}
    base = ["train", "--family", "llada", "--out", str(tmp_path / "o"), "--work", str(tmp_path / "w")]
    with pytest.raises(SystemExit):
        main([*base, "--task-mix", "lookup=-1"])
    assert "expected TASK=N with N >= 0, got 'lookup=-1'" in capsys.readouterr().err
    assert main([*base, "--task-mix", "addition=2"]) == 2
    assert "mix names tasks not in the stream: addition" in capsys.readouterr().err


def test_cli_takes_trainconfigs_defaults_and_shows_them(capsys):
    """dllm train sets only the options it is given; the rest, and --help's defaults, are TrainConfig's."""
    from dllm_engine.cli import build_parser
    from dllm_lab.cli.train import train_config
    base = ["train", "--family", "sdar", "--out", "o", "--work", "w"]
    assert train_config(build_parser().parse_args(base)) == TrainConfig(family="sdar", out="o", work="w")
    given = train_config(build_parser().parse_args([*base, "--steps", "7", "--lr", "0.01", "--task-mix", "calc=2",
                                                    "--canvas-rows", "a.pt", "b.pt"]))
    assert given == TrainConfig(family="sdar", out="o", work="w", steps=7, lr=0.01, task_mix={"calc": 2},
                                canvas_rows=["a.pt", "b.pt"])
    with pytest.raises(SystemExit):
        build_parser().parse_args(["train", "--help"])
    shown = " ".join(capsys.readouterr().out.split())  # argparse wraps the lines
    defaults = TrainConfig(family="sdar", out="o", work="w")
    for flag, name in (("--steps STEPS", "steps"), ("--lr LR", "lr"), ("--long-tails SHARE", "long_tails"),
                       ("--num-kv-heads NUM_KV_HEADS", "num_kv_heads"), ("--distill-weight DISTILL_WEIGHT",
                                                                         "distill_weight")):
        text, _, rest = shown.split(f" {flag} ", 1)[1].partition("(default: ")
        assert not re.search(r" --[a-z-]+ [A-Z]", text), flag  # no other option's entry before it
        assert rest.startswith(f"{getattr(defaults, name)})"), flag
    assert "(default: None)" not in shown and "(default: ==SUPPRESS==)" not in shown


def test_grow_weights_copies_the_source_and_starts_new_outputs_at_zero():
    """--init-from a smaller checkpoint: more words, wider MLPs, more layers."""
    old = {"embed_tokens.weight": torch.ones(3, 4), "lm_head.weight": torch.ones(3, 4),
           "layers.0.mlp.up_proj.weight": torch.ones(6, 4), "layers.0.mlp.down_proj.weight": torch.ones(4, 6),
           "norm.weight": torch.ones(4)}
    fresh = {"embed_tokens.weight": torch.full((5, 4), 7.0), "lm_head.weight": torch.full((5, 4), 7.0),
             "layers.0.mlp.up_proj.weight": torch.full((8, 4), 7.0),
             "layers.0.mlp.down_proj.weight": torch.full((4, 8), 7.0),
             "layers.1.mlp.up_proj.weight": torch.full((8, 4), 7.0),
             "layers.1.mlp.down_proj.weight": torch.full((4, 8), 7.0),
             "layers.1.self_attn.o_proj.weight": torch.full((4, 4), 7.0), "norm.weight": torch.zeros(4)}
    out = grow_weights(old, fresh)
    assert set(out) == set(fresh) and all(out[n].shape == fresh[n].shape for n in fresh)
    for name in ("embed_tokens.weight", "lm_head.weight", "layers.0.mlp.up_proj.weight"):  # new rows: fresh
        assert (out[name][:len(old[name])] == 1).all() and (out[name][len(old[name]):] == 7).all()
    down = out["layers.0.mlp.down_proj.weight"]  # new units add nothing yet
    assert (down[:, :6] == 1).all() and (down[:, 6:] == 0).all()
    assert (out["layers.1.mlp.up_proj.weight"] == 7).all()  # a new layer: fresh, but writes nothing
    assert (out["layers.1.mlp.down_proj.weight"] == 0).all()
    assert (out["layers.1.self_attn.o_proj.weight"] == 0).all()
    assert out["norm.weight"] is old["norm.weight"]
    with pytest.raises(ValueError, match=r"up_proj.weight is \(9, 4\) in the checkpoint and \(8, 4\) here: "
                                         r"a model grown from a checkpoint only adds words, MLP units or layers"):
        grow_weights({**old, "layers.0.mlp.up_proj.weight": torch.ones(9, 4)}, fresh)
    with pytest.raises(ValueError, match=r"weights this model lacks \(layers.1.mlp.down_proj.weight, "):
        grow_weights(fresh, old)


@pytest.mark.parametrize("family", ["llada", "sdar"])
def test_a_grown_model_starts_as_the_checkpoint_it_grew_from(tmp_path, family):
    """--init-from with more layers and MLP units (the CLI's flags): the same logits at step 0,
    and the new parts learn."""
    from dllm_engine.cli import main
    out = trainer(tmp_path, family, steps=2, name="base").train()
    source = LLM(out).model.eval()
    cmd = ["train", "--family", family, "--out", str(tmp_path / "big-out"), "--work", str(tmp_path / "big"),
           "--init-from", str(out), "--steps", "1", "--batch-size", "4", "--block-size", "8",
           "--hidden-size", "32", "--num-heads", "2", "--num-kv-heads", "2", "--num-layers", "3",
           "--intermediate-size", "96"]
    assert main(cmd) == 0
    cfg = json.loads((tmp_path / "big-out" / "config.json").read_text())
    assert cfg.get("n_layers", cfg.get("num_hidden_layers")) == 3
    assert cfg.get("mlp_hidden_size", cfg.get("intermediate_size")) == 96
    grown = trainer(tmp_path, family, steps=1, name="grown", init_from=str(out), num_layers=3,
                    intermediate_size=96)
    ids = torch.randint(0, source.config.vocab_size, (2, 24))
    with torch.no_grad():
        assert torch.equal(grown.model.eval()(ids), source(ids))
    grown.model.train()
    grown.train_step(0)
    assert grown.model.layers[0].mlp.down_proj.weight[:, 64:].abs().sum() > 0
    assert grown.model.layers[2].self_attn.o_proj.weight.abs().sum() > 0
    with pytest.raises(ValueError, match=r"keeps its widths and heads; hidden_size 32 \(checkpoint\) vs 48"):
        trainer(tmp_path, family, steps=1, name="wide", init_from=str(out), hidden_size=48)
    with pytest.raises(ValueError, match="a model grown from it needs at least its layers"):
        trainer(tmp_path, family, steps=1, name="short", init_from=str(out), num_layers=1)


# -- robustness: signals, resume with other settings, export into a stale folder -----------------
TINY_MODEL = {k: TINY[k] for k in ("hidden_size", "num_layers", "num_heads", "intermediate_size", "warmup")}


class Unhandled(Exception):
    pass


@pytest.fixture
def guarded_signals():
    """SIGINT / SIGTERM raise Unhandled unless the code under test handles them; the test's
    handler is back afterwards."""
    import signal

    def unhandled(signum, frame):
        raise Unhandled(signal.Signals(signum).name)
    previous = {s: signal.signal(s, unhandled) for s in (signal.SIGINT, signal.SIGTERM)}
    yield unhandled
    for s, handler in previous.items():
        signal.signal(s, handler)


def test_sigint_finishes_the_step_saves_and_resumes_exactly(tmp_path, guarded_signals):
    import os
    import signal
    from dllm_lab.train.trainer import Interrupted
    whole = trainer(tmp_path, name="whole")
    whole.train()
    first = trainer(tmp_path, name="split", save_every=50)  # no periodic save before the signal
    real_step = first.train_step

    def ctrl_c_in_step_2(step):
        if step == 2:
            os.kill(os.getpid(), signal.SIGINT)
        return real_step(step)
    first.train_step = ctrl_c_in_step_2
    with pytest.raises(Interrupted) as info:
        first.train()
    assert signal.getsignal(signal.SIGINT) is guarded_signals  # library use keeps no handler
    assert signal.getsignal(signal.SIGTERM) is guarded_signals
    assert info.value.exit_code == 130
    assert str(info.value) == (f"interrupted at step 3; state saved to {tmp_path / 'split'}; "
                               f"rerun the same command to resume")
    assert torch.load(tmp_path / "split" / "state.pt", weights_only=True)["step"] == 3
    assert not (tmp_path / "split-out").exists()
    trainer(tmp_path, name="split", save_every=50).train()  # save_every may change on resume
    resumed = LLM(tmp_path / "split-out").model.state_dict()
    for n, a in whole.model.state_dict().items():
        assert torch.allclose(a, resumed[n], atol=1e-6), n
    steps = [json.loads(l)["step"] for l in (tmp_path / "split" / "loss.jsonl").read_text().splitlines()]
    assert steps == list(range(6))


def test_cli_sigterm_exits_143_saves_and_resumes(tmp_path, capsys, monkeypatch, guarded_signals):
    import dataclasses
    import os
    import signal
    import dllm_lab.cli.train as cli_train
    from dllm_engine.cli import main
    real_config = cli_train.train_config
    monkeypatch.setattr(cli_train, "train_config", lambda args: dataclasses.replace(real_config(args), **TINY_MODEL))
    real_step = Trainer.train_step

    def term_in_step_1(self, step):
        if step == 1:
            os.kill(os.getpid(), signal.SIGTERM)
        return real_step(self, step)
    monkeypatch.setattr(Trainer, "train_step", term_in_step_1)
    work = tmp_path / "w"
    cmd = ["train", "--family", "sdar", "--out", str(tmp_path / "o"), "--work", str(work),
           "--steps", "3", "--batch-size", "2", "--num-kv-heads", "2", "--block-size", "8",
           "--save-every", "50"]
    with pytest.raises(SystemExit) as info:
        main(cmd)
    assert info.value.code == 143
    out, err = capsys.readouterr()
    assert "Traceback" not in err and "checkpoint written" not in out
    assert err.strip().splitlines()[-1] == (f"interrupted at step 2; state saved to {work}; "
                                            f"rerun the same command to resume")
    assert signal.getsignal(signal.SIGTERM) is guarded_signals
    monkeypatch.setattr(Trainer, "train_step", real_step)
    assert main([*cmd[:-2], "--lr", "1e-3"]) == 2  # other settings: refused, one line
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "lr 0.002 (saved) vs 0.001 (now)" in err[0]
    assert main([*cmd[:-1], "7"]) == 0  # the same command (another --save-every) resumes
    assert f"checkpoint written to {tmp_path / 'o'}" in capsys.readouterr().out
    steps = [json.loads(l)["step"] for l in (work / "loss.jsonl").read_text().splitlines()]
    assert steps == [0, 1, 2]
    assert main([*cmd[:-1], "0"]) == 2
    assert "save_every must be >= 1, got 0" in capsys.readouterr().err


def test_resume_refuses_other_model_or_training_settings(tmp_path):
    trainer(tmp_path, steps=2).train()
    log = (tmp_path / "run" / "loss.jsonl").read_text()
    assert [sorted(json.loads(line)) for line in log.splitlines()] == \
        [["ar_loss", "elapsed_s", "loss", "lr", "step", "total"]] * 2
    with pytest.raises(ValueError) as info:
        trainer(tmp_path, steps=2, hidden_size=48, block_size=16).train()
    msg = str(info.value)
    for diff in ("hidden_size 32 (saved) vs 48 (now)", "block_size 8 (saved) vs 16 (now)"):
        assert diff in msg
    with pytest.raises(ValueError) as info:
        trainer(tmp_path, steps=2, lr=1e-3, seed=5, task_mix={"lookup": 2}).train()
    msg = str(info.value)
    for diff in ("lr 0.002 (saved) vs 0.001 (now)", "seed 0 (saved) vs 5 (now)",
                 "task_mix None (saved) vs {'lookup': 2} (now)"):
        assert diff in msg
    assert msg.count("(saved) vs") == 3  # the model's settings are the same
    with pytest.raises(ValueError, match="family llada .saved. vs sdar .now."):
        trainer(tmp_path, family="sdar", steps=2).export_saved()
    assert (tmp_path / "run" / "loss.jsonl").read_text() == log  # a refused resume changes nothing
    # exporting needs the same model only; extending the run, saving elsewhere or more often is fine
    trainer(tmp_path, steps=2, lr=1e-3).export_saved()
    t = trainer(tmp_path, steps=3, save_every=1, max_new_tokens=64, name="run")
    t.cfg.out = str(tmp_path / "longer-out")
    t.train()
    assert t.step == 3 and (tmp_path / "longer-out" / "model.safetensors").is_file()


def test_export_replaces_a_stale_sharded_checkpoint_and_keeps_other_files(tmp_path):
    from dllm_engine.models import save_model
    from dllm_engine.models.loader import INDEX_FILE
    t = trainer(tmp_path, steps=2)
    out = tmp_path / "run-out"
    save_model(t.model, out, t.family, max_shard_bytes=20_000)  # an older, sharded export
    assert (out / INDEX_FILE).is_file()
    (out / "README.md").write_text("model card\n")
    assert t.train() == out
    names = sorted(p.name for p in out.iterdir())
    assert INDEX_FILE not in names and not [n for n in names if n.startswith("model-")]
    assert (out / "README.md").read_text() == "model card\n"
    exported = LLM(out).model.state_dict()
    for n, a in t.model.state_dict().items():
        assert torch.equal(a, exported[n]), n
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run", "run-out"]  # no temporary folder left


def test_a_failed_export_keeps_the_previous_checkpoint_whole(tmp_path, monkeypatch):
    import dllm_lab.train.trainer as trainer_module
    t = trainer(tmp_path, steps=2)
    out = t.train()
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    with torch.no_grad():
        for p in t.model.parameters():
            p.add_(1.0)

    def disk_full(*args):
        raise OSError("No space left on device")
    monkeypatch.setattr(trainer_module, "save_tokenizer", disk_full)  # fails after the weights
    with pytest.raises(OSError, match="No space left"):
        t.export()
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run", "run-out"]


def test_save_model_drops_stale_weight_files(tmp_path):
    from dllm_engine.models import load_model, save_model
    t = trainer(tmp_path)
    save_model(t.model, tmp_path / "ckpt", t.family, max_shard_bytes=20_000)
    with torch.no_grad():
        t.model.norm.weight.add_(1.0)
    save_model(t.model, tmp_path / "ckpt", t.family)  # unsharded over the sharded one
    assert sorted(p.name for p in (tmp_path / "ckpt").glob("*.safetensors*")) == ["model.safetensors"]
    assert torch.equal(load_model(tmp_path / "ckpt").norm.weight, t.model.norm.weight)


def test_a_second_signal_stops_at_once_and_threads_train_without_handlers(tmp_path, guarded_signals):
    import os
    import signal
    import threading
    from dllm_lab.train.trainer import Interrupted
    t = trainer(tmp_path)  # save_every=2
    real_step = t.train_step

    def ctrl_c_twice_in_step_3(step):
        if step == 3:
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGINT)
        return real_step(step)
    t.train_step = ctrl_c_twice_in_step_3
    with pytest.raises(Interrupted) as info:
        t.train()
    assert str(info.value) == (f"interrupted again; the state of step 2 is kept in {tmp_path / 'run'}; "
                               f"rerun the same command to resume")
    assert signal.getsignal(signal.SIGINT) is guarded_signals
    assert torch.load(tmp_path / "run" / "state.pt", weights_only=True)["step"] == 2
    results = []
    worker = threading.Thread(target=lambda: results.append(trainer(tmp_path, steps=3).train()))
    worker.start()
    worker.join(timeout=120)
    assert results == [tmp_path / "run-out"]  # signal handlers are the main thread's: none installed
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # an ignored signal stays ignored
    t = trainer(tmp_path, steps=4)
    real_step = t.train_step
    t.train_step = lambda step: (os.kill(os.getpid(), signal.SIGTERM), real_step(step))[1]
    assert t.train() == tmp_path / "run-out" and t.step == 4
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN


def resized_vocab(out, dest, change: int):
    """A copy of checkpoint ``out`` in ``dest`` with ``change`` words fewer (< 0: the last ones
    dropped) or more (> 0: the first ones repeated) in its embedding, head and config."""
    from safetensors.torch import load_file, save_file
    cfg = json.loads((out / "config.json").read_text())
    vocab = cfg["vocab_size"]
    weights = load_file(out / "model.safetensors")
    resized = {n: (w[:change] if change < 0 else torch.cat([w, w[:change]]))
               if w.dim() == 2 and w.shape[0] == vocab else w for n, w in weights.items()}
    assert sum(w.shape != weights[n].shape for n, w in resized.items()) == 2  # embedding and head
    dest.mkdir()
    save_file(resized, dest / "model.safetensors", metadata={"format": "pt"})
    for key in ("vocab_size", "embedding_size"):
        if key in cfg:
            cfg[key] += change
    (dest / "config.json").write_text(json.dumps(cfg))
    return dest


def test_new_rows_first_trains_only_the_new_words(tmp_path):
    """--new-rows-first: the steps before it move only the rows of the words init_from lacks."""
    out = resized_vocab(trainer(tmp_path, steps=1, name="base").train(), tmp_path / "small", -5)
    t = trainer(tmp_path, steps=3, name="grow", init_from=str(out), new_rows_first=2)
    assert t.grown and set(t.grown.values()) == {len(t.tokenizer) - 5}
    loaded = {n: p.detach().clone() for n, p in t.model.named_parameters()}
    for step in range(2):
        t.train_step(step)
    for n, p in t.model.named_parameters():
        rows = t.grown.get(n)
        if rows is None:
            assert torch.equal(p, loaded[n]), n
        else:
            assert torch.equal(p[:rows], loaded[n][:rows]), n
            assert not torch.equal(p[rows:], loaded[n][rows:]), n
    t.train_step(2)
    assert not torch.equal(t.model.lm_head.weight[:-5], loaded["lm_head.weight"][:-5])
    assert any(not torch.equal(p, loaded[n]) for n, p in t.model.named_parameters() if n not in t.grown)


def test_new_rows_first_needs_new_words(tmp_path):
    with pytest.raises(ValueError, match="new_rows_first must be >= 0 and needs init_from"):
        TrainConfig(family="llada", out="x", work="y", new_rows_first=3)
    out = trainer(tmp_path, steps=1, name="base").train()
    with pytest.raises(ValueError, match="has this run's whole vocabulary"):
        trainer(tmp_path, steps=2, name="same", init_from=str(out), new_rows_first=1)


def test_distill_keeps_what_the_teacher_knew_on_the_rows_it_can_read(tmp_path):
    """--distill-from: the KL to the teacher's predictions is 0 for the teacher itself, grows as
    the model moves, and leaves out the rows holding a word the teacher lacks."""
    from dllm_engine.cli import main
    out = trainer(tmp_path, steps=2, name="base").train()
    same = trainer(tmp_path, steps=3, name="same", init_from=str(out), distill_from=str(out))
    b = same.batch(0)
    assert abs(same.distill_loss(b, same.masked_logits(b)).item()) < 1e-6
    assert abs(same.train_step(0)["distill_loss"]) < 1e-6  # the term the step reports, before it moved
    assert same.distill_loss(b, same.masked_logits(b)).item() > 1e-4

    vocab = len(same.tokenizer)
    small = resized_vocab(out, tmp_path / "small", -5)  # the teacher knows 5 words fewer
    t = trainer(tmp_path, steps=3, name="grow", init_from=str(small), distill_from=str(small))
    b = t.batch(0)
    row = int(b.is_masked.sum(1).argmax())
    b.input_ids[row, 0] = vocab - 1  # a word the teacher lacks, in this row's prompt
    logits = t.masked_logits(b).detach().requires_grad_(True)
    t.distill_loss(b, logits).backward()
    slot_rows = torch.arange(len(b.is_masked))[:, None].expand_as(b.is_masked)[b.is_masked]
    assert (logits.grad[slot_rows == row] == 0).all()
    assert logits.grad[slot_rows != row].abs().sum() > 0
    assert logits.grad[slot_rows != row][:, vocab - 5:].sum() > 0  # mass on the teacher's unknown words costs

    with pytest.raises(ValueError, match="distill_weight must be >= 0"):
        TrainConfig(family="llada", out="x", work="y", distill_weight=-1)
    with pytest.raises(ValueError, match="is a llada checkpoint, not sdar"):
        trainer(tmp_path, "sdar", steps=1, name="other", distill_from=str(out))
    big = resized_vocab(out, tmp_path / "big", 5)  # a teacher with 5 words more than the model
    with pytest.raises(ValueError, match=f"has {vocab + 5} words, more than this model's {vocab}"):
        trainer(tmp_path, steps=1, name="big", distill_from=str(big))
    cmd = ["train", "--family", "llada", "--out", str(tmp_path / "cli-out"), "--work", str(tmp_path / "cli"),
           "--init-from", str(out), "--distill-from", str(out), "--distill-weight", "0.5", "--steps", "1",
           "--batch-size", "4", "--hidden-size", "32", "--num-heads", "2", "--num-kv-heads", "2",
           "--num-layers", "2", "--intermediate-size", "64"]
    assert main(cmd) == 0
    saved = torch.load(tmp_path / "cli" / "state.pt", weights_only=False)["config"]
    assert saved["distill_from"] == str(out) and saved["distill_weight"] == 0.5
