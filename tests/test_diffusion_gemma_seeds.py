"""DiffusionGemma's per-request reproducible sampling (``SeededDraws``) and batch-invariant
generation (``generate(batch_invariant=True)``) on a tiny random model built here (no
transformers needed): a row's draws are keyed by its seed, canvas, step, position and draw; its
positions count from its first token; rows that stop leave the forwards, and ``num_steps``
counts exactly the decoder forwards each row was in. On this fixture a prompt gets the same
tokens alone, in a left-padded batch and in any order, which checks all of that at once; that
is not so on every model and prompt (kernels round a row differently in another batch, and
self-conditioning amplifies it: docs/models/diffusion-gemma.md#batch-invariance)."""
import dataclasses

import pytest
import torch

from dllm_engine.decoding.diffusion_gemma import CanvasBatch, DrawKeys, GenerationSettings, SeededDraws, generate
from dllm_engine.errors import UserError
from dllm_engine.models.diffusion_gemma import FULL, SLIDING, DiffusionGemma, config_from_hf
from fixtures import randomize_diffusion_gemma

CANVAS, VOCAB, PAD = 6, 96, 0
LAYER_TYPES = [SLIDING, SLIDING, FULL, SLIDING, FULL]
TEXT = dict(model_type="diffusion_gemma_text", canvas_length=CANVAS, vocab_size=VOCAB, hidden_size=32,
            intermediate_size=40, num_hidden_layers=len(LAYER_TYPES), num_attention_heads=4, num_key_value_heads=2,
            head_dim=8, global_head_dim=16, num_global_key_value_heads=1, sliding_window=4,
            layer_types=LAYER_TYPES, num_experts=4, top_k_experts=2, moe_intermediate_size=12,
            max_position_embeddings=128,
            rope_parameters={SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
                             FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1e6}})
# low temperatures and no stability wait: rows stop early, at different steps
SETTINGS = GenerationSettings(max_new_tokens=3 * CANVAS, max_denoising_steps=6, entropy_bound=1.0, t_min=0.05,
                              t_max=0.5, stability_threshold=0, confidence_threshold=0.8)


@pytest.fixture(scope="module")
def model():
    """Sliding (window 4) and full layers, MoE; every weight random (matrices N(0, 0.2), vectors
    and layer scalars around 1), as test_diffusion_gemma randomizes its checkpoint."""
    return randomize_diffusion_gemma(DiffusionGemma(config_from_hf(TEXT)))


def prompt(length: int, seed: int) -> list[int]:
    return torch.randint(3, VOCAB, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def left_padded(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, rows))
    ids = torch.tensor([[PAD] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    return ids, mask


def alone(model, row: list[int], seed: int, settings=SETTINGS):
    return generate(model, torch.tensor([row]), settings, SeededDraws([seed]), batch_invariant=True)


@pytest.fixture
def forwards(model, monkeypatch):
    """Spy: ("encode" | "decode", rows in the forward, the positions given) for each forward of ``model``."""
    seen = []
    for name in ("encode", "decode"):
        run = getattr(model, name)

        def spy(ids, *args, _run=run, _name=name, **kwargs):
            seen.append((_name, ids.shape[0], kwargs.get("positions")))
            return _run(ids, *args, **kwargs)
        monkeypatch.setattr(model, name, spy)
    return seen


def decoder_rows_per_canvas(seen) -> list[list[int]]:
    """The rows of each decoder forward, one list per canvas (an encoder forward starts one)."""
    canvases = []
    for name, rows, _ in seen:
        if name == "encode":
            canvases.append([])
        else:
            canvases[-1].append(rows)
    return canvases


# -- the draws ------------------------------------------------------------------------------------
def test_seeded_draws_are_keyed_by_seed_canvas_step_position_and_draw():
    draws = SeededDraws([11, 22, 33, 22])
    keys = DrawKeys.at(torch.arange(4), canvas=1, step=2)
    base = draws.canvas_tokens(keys, CANVAS, VOCAB)
    assert base.shape == (4, CANVAS) and 0 <= base.min() and base.max() < VOCAB
    assert torch.equal(base[1], base[3])  # keyed by the seed, not the row's index
    assert not torch.equal(base[0], base[1])
    some = DrawKeys(torch.tensor([2, 0]), keys.canvas[:2], keys.step[:2])  # a subset, in another order
    assert torch.equal(draws.canvas_tokens(some, CANVAS, VOCAB), base[[2, 0]])
    assert torch.equal(draws.canvas_tokens(keys, CANVAS, VOCAB), base)  # no state: the same again
    for other in (DrawKeys.at(torch.arange(4), canvas=2, step=2), DrawKeys.at(torch.arange(4), canvas=1, step=3)):
        assert (draws.canvas_tokens(other, CANVAS, VOCAB) != base).float().mean() > 0.8
    assert (draws.renoise_tokens(keys, CANVAS, VOCAB) != base).float().mean() > 0.8  # another draw
    assert (SeededDraws([12, 22, 33, 22]).canvas_tokens(keys, CANVAS, VOCAB)[0] != base[0]).float().mean() > 0.8


def test_seeded_samples_do_not_depend_on_the_chunk_and_differ_by_position_and_draw():
    draws = SeededDraws([3, 4])
    keys = DrawKeys.at(torch.arange(2), canvas=0, step=1)
    logits = torch.zeros(2, CANVAS, VOCAB)  # uniform: the draw alone picks the token
    whole = draws.sample(logits, slice(0, CANVAS), keys)
    assert torch.equal(draws.sample(logits[:, 2:5], slice(2, 5), keys), whole[:, 2:5])
    assert len(set(whole[0].tolist())) > CANVAS // 2  # the same logits at each position, not the same token
    assert not torch.equal(whole[0], whole[1])
    later = DrawKeys.at(torch.arange(2), canvas=0, step=2)
    assert (draws.sample(logits, slice(0, CANVAS), later) != whole).float().mean() > 0.8


def test_seeded_draws_follow_their_distributions():
    """Gumbel-max over the scaled logits is a draw from their softmax; the uniform tokens are uniform."""
    n = 20_000  # positions of one row: n independent keys
    keys = DrawKeys.at(torch.zeros(1, dtype=torch.long), canvas=0, step=0)
    draws = SeededDraws([9])
    scaled = torch.tensor([2.0, 1.0, 0.0, -1.0, 0.5])
    sampled = draws.sample(scaled.expand(1, n, 5), slice(0, n), keys)[0]
    freq = torch.bincount(sampled, minlength=5).float() / n
    assert torch.allclose(freq, scaled.softmax(-1), atol=0.015)
    tokens = draws.canvas_tokens(keys, n, 7)[0]
    assert torch.allclose(torch.bincount(tokens, minlength=7).float() / n, torch.full((7,), 1 / 7), atol=0.015)


# -- batch invariance ------------------------------------------------------------------------------
def test_a_prompt_gives_the_same_tokens_alone_padded_and_in_any_order(model):
    rows, seeds = [prompt(5, 1), prompt(9, 2), prompt(7, 3)], [101, 202, 303]
    solo = [alone(model, r, s) for r, s in zip(rows, seeds)]
    assert len({tuple(o.token_ids[0].tolist()) for o in solo}) == 3
    for order in ([0, 1, 2], [2, 1, 0], [1, 0, 2]):
        ids, mask = left_padded([rows[i] for i in order])
        out = generate(model, ids, SETTINGS, SeededDraws([seeds[i] for i in order]), attention_mask=mask,
                       batch_invariant=True)
        for j, i in enumerate(order):
            assert torch.equal(out.token_ids[j], solo[i].token_ids[0]), (order, i)
            assert torch.equal(out.num_steps[j], solo[i].num_steps[0])
    assert len({tuple(o.num_steps[0].tolist()) for o in solo}) > 1  # the rows stopped at different steps


def test_a_padded_row_counts_its_positions_from_its_first_token(model, forwards):
    """RoPE scores depend on position differences only, so the reference's positions (padding
    counted) change a padded row's numbers by rounding alone; batch_invariant gives each row
    exactly the positions it has alone, in both passes."""
    rows = [prompt(5, 1), prompt(9, 2)]
    ids, mask = left_padded(rows)
    generate(model, ids, SETTINGS, SeededDraws([1, 2]), attention_mask=mask, batch_invariant=True)
    prompt_pass, first_decode = forwards[0], forwards[1]
    assert prompt_pass[2][0, 4:].tolist() == list(range(5)) and prompt_pass[2][1].tolist() == list(range(9))
    assert first_decode[2].tolist() == [list(range(5, 5 + CANVAS)), list(range(9, 9 + CANVAS))]
    canvas_pass = next(f for f in forwards if f[0] == "encode" and f is not prompt_pass)
    assert canvas_pass[2].tolist() == [list(range(5, 5 + CANVAS)), list(range(9, 9 + CANVAS))]
    forwards.clear()
    generate(model, ids, SETTINGS, SeededDraws([1, 2]), attention_mask=mask)  # the reference: the model's own
    assert all(f[2] is None for f in forwards)


def test_the_same_seed_gives_the_same_tokens_and_another_seed_others(model):
    row = prompt(6, 4)
    first, again, other = alone(model, row, 7), alone(model, row, 7), alone(model, row, 8)
    assert torch.equal(first.token_ids, again.token_ids) and torch.equal(first.num_steps, again.num_steps)
    assert (first.token_ids != other.token_ids).float().mean() > 0.5


# -- dropping rows that stopped --------------------------------------------------------------------
def test_dropping_stopped_rows_gives_the_same_tokens_with_fewer_decoder_rows(model, forwards):
    ids = torch.tensor([prompt(7, 10 + i) for i in range(4)])  # one length: the same positions either way
    draws = SeededDraws([1, 2, 3, 4])
    kept = generate(model, ids, SETTINGS, draws)
    kept_rows = decoder_rows_per_canvas(forwards)
    forwards.clear()
    dropped = generate(model, ids, SETTINGS, draws, batch_invariant=True)
    dropped_rows = decoder_rows_per_canvas(forwards)
    assert torch.equal(dropped.token_ids, kept.token_ids) and torch.equal(dropped.num_steps, kept.num_steps)
    steps = dropped.num_steps.T.tolist()  # [canvas][row]
    assert sum(len(set(rows)) > 1 for rows in steps) >= 2, steps  # rows stop at different steps
    for canvas, rows in enumerate(dropped_rows):  # the j-th forward ran the rows with >= j steps
        assert rows == [sum(n >= j for n in steps[canvas]) for j in range(1, max(steps[canvas]) + 1)]
        assert kept_rows[canvas] == [4] * max(steps[canvas])  # the reference runs every row every step
    assert sum(map(sum, dropped_rows)) == dropped.num_steps.sum().item() < sum(map(sum, kept_rows))


def test_a_row_finished_at_eos_leaves_the_forwards_and_changes_no_other_row(model, forwards):
    ids = torch.tensor([prompt(7, 10 + i) for i in range(4)])
    draws = SeededDraws([1, 2, 3, 4])
    free = generate(model, ids, SETTINGS, draws, batch_invariant=True).token_ids
    others = set(free[1:].flatten().tolist())
    eos = next(t for t in free[0, :CANVAS].tolist() if t not in others)  # only row 0 holds it
    cut = free[0].tolist().index(eos) + 1
    settings = GenerationSettings(**{**SETTINGS.__dict__, "eos_token_ids": (eos,), "pad_token_id": PAD})
    forwards.clear()
    out = generate(model, ids, settings, draws, batch_invariant=True)
    assert out.token_ids[0].tolist() == free[0, :cut].tolist() + [PAD] * (3 * CANVAS - cut)
    assert torch.equal(out.token_ids[1:], free[1:])
    assert out.num_steps[0, 1:].tolist() == [0, 0]  # no forwards after its canvas
    encoder_rows = [rows for name, rows, _ in forwards if name == "encode"]
    assert encoder_rows == [4, 3, 3]  # the prompt, then the canvases of the other rows
    assert sum(rows for name, rows, _ in forwards if name == "decode") == out.num_steps.sum().item()
    reference = generate(model, ids, settings, draws)  # runs row 0 on, as pad
    assert torch.equal(reference.token_ids, out.token_ids)


# -- bad input ------------------------------------------------------------------------------------
def test_seeds_and_padding_are_checked(model):
    ids = torch.tensor([prompt(5, 1), prompt(5, 2)])
    with pytest.raises(UserError, match="SeededDraws has 1 seeds for 2 prompts: give one seed per prompt"):
        generate(model, ids, SETTINGS, SeededDraws([1]))
    for bad in (-1, 2**63, 1.5, True):
        with pytest.raises(UserError, match=r"seeds must be integers in \[0, 2\^63\)"):
            SeededDraws([3, bad])
    with pytest.raises(UserError, match="needs one seed per prompt; got none"):
        SeededDraws([])
    mask = torch.tensor([[1, 1, 1, 1, 1], [0, 1, 0, 1, 1]])
    with pytest.raises(UserError, match="attention_mask row 1 has padding after its first token"):
        generate(model, ids, SETTINGS, SeededDraws([1, 2]), attention_mask=mask, batch_invariant=True)


def assert_rows_alone(model, run: CanvasBatch, rows, seeds, limits) -> None:
    """Each of ``run``'s rows kept the canvases, and took the steps, it gets alone."""
    for i, (row, seed, limit) in enumerate(zip(rows, seeds, limits)):
        want = alone(model, row, seed, dataclasses.replace(SETTINGS, max_new_tokens=limit))
        got = run.rows[i]
        assert got.num_steps == want.num_steps[0].tolist()[:len(got.num_steps)]
        assert [t for c in got.token_ids for t in c] == want.token_ids[0].tolist()[:CANVAS * len(got.token_ids)]
        assert len(got.token_ids) == got.canvases or got.finished


def test_rows_joining_at_any_denoising_step_get_their_tokens_alone(model):
    """``CanvasBatch.run_step`` (the server's loop): rows join a running batch between any two
    denoising steps, each row ends its canvas when it stops (not when the slowest row does),
    encodes it alone and goes on to its next while the others denoise (its cache rows grown and
    merged back right-aligned), and leaves when done: each row gets its tokens alone."""
    rows, seeds = [prompt(5, 1), prompt(9, 2), prompt(3, 3), prompt(20, 4)], [11, 12, 13, 14]
    limits = [3 * CANVAS, 2 * CANVAS, 3 * CANVAS, CANVAS]
    steps = []  # (canvas index, denoising step) of each row in each decoder step
    run = CanvasBatch(model, SETTINGS, SeededDraws(seeds[:1]),
                      observe=lambda canvas, _, state: steps.append(list(zip(canvas.tolist(), state.num_steps.tolist()))))
    assert run.add(rows[:1], limits[:1]) == [0]
    left = run.run_step() + run.run_step()
    assert run.add(rows[1:3], limits[1:3], seeds=seeds[1:3]) == [1, 2]  # mid-canvas: row 0 is at its third step
    left += run.run_step()
    assert run.add(rows[3:], limits[3:], seeds=seeds[3:]) == [3]
    widths = []
    while len(run):
        left += run.run_step()
        if run.live is not None:  # no column is padding in every row: a long row's leave trims them
            assert int(run.live.padding.min()) == 0
            widths.append(run.cache.length)
    assert sorted(left) == [0, 1, 2, 3]
    assert any(b < a for a, b in zip(widths, widths[1:]))  # the cache narrowed when the long prompt's row left
    assert any(len({s for _, s in rows_at}) > 1 for rows_at in steps)  # rows at different steps in one forward
    assert any(len({c for c, _ in rows_at}) > 1 for rows_at in steps)  # and at different canvases
    assert_rows_alone(model, run, rows, seeds, limits)


def test_rows_joining_and_leaving_between_canvases_get_their_tokens_alone(model):
    """Continuous batching by canvas (``CanvasBatch``, the server's loop): rows join a running
    batch at a canvas boundary (their cache rows merged right-aligned beside rows one or two
    canvases further on: a shorter prompt padded on the left, and a longer one, whose width
    pads the running rows), each with its own seed and max_new_tokens, and leave when done."""
    rows, seeds = [prompt(5, 1), prompt(9, 2), prompt(3, 3), prompt(20, 4)], [11, 12, 13, 14]
    limits = [3 * CANVAS, 2 * CANVAS, 3 * CANVAS, CANVAS]
    steps = []  # the canvas index of each row in each decoder step
    run = CanvasBatch(model, SETTINGS, SeededDraws(seeds[:1]), observe=lambda canvas, _, __: steps.append(canvas.tolist()))
    assert run.add(rows[:1], limits[:1]) == [0]
    assert run.run_canvas() == [] and len(run) == 1
    assert run.add(rows[1:3], limits[1:3], seeds=seeds[1:3]) == [1, 2]  # a longer prompt and a shorter one
    left = run.run_canvas()
    assert run.add(rows[3:], limits[3:], seeds=seeds[3:]) == [3]
    while len(run):
        left += run.run_canvas()
    assert sorted(left) == [0, 1, 2, 3]
    assert any(len(set(canvases)) > 1 for canvases in steps)  # decoder steps held rows of two canvases
    assert_rows_alone(model, run, rows, seeds, limits)
