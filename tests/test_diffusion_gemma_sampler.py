"""DiffusionGemma's sampler (``dllm_engine.decoding.diffusion_gemma``): the same tokens as
transformers' ``DiffusionGemmaForBlockDiffusion.generate`` on the tiny random model of
``test_diffusion_gemma`` (its weights through save_pretrained -> our loader) when both take the
same draws; and the per-step math against hand-computed values.

How the draws are shared: transformers' generation module calls ``torch.randint`` (each new
canvas, each step's renoising) and ``torch.multinomial`` (each step's sample over [B*C, V]
probabilities) through its module-global ``torch``. For the reference run that global is
replaced by a proxy (``TorchWithDraws``) that answers those two calls from a ``ScriptedDraws``
and passes every other attribute to torch; our ``generate`` takes a ``ScriptedDraws`` with the
same seed as its ``Draws``. A ``ScriptedDraws`` makes its token draws from one seeded generator
in call order, and samples step k by inverse CDF with uniforms [B, C] seeded by k, so a sample
depends on the step, the position and the probabilities only: transformers asks for the whole
canvas at once, we ask in chunks of positions. Both sides count their draws, and each test checks
the counts agree: the two loops drew at the same points.
"""
import json
import logging
from dataclasses import replace
from unittest import mock

import pytest
import torch

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "DiffusionGemmaForBlockDiffusion"):
    pytest.skip("transformers >= 5.23 defines DiffusionGemma", allow_module_level=True)
from transformers.models.diffusion_gemma import generation_diffusion_gemma as reference  # noqa: E402

from dllm_engine.decoding import diffusion_gemma as sampler  # noqa: E402
from dllm_engine.decoding.diffusion_gemma import (DrawKeys, GenerationSettings, TorchDraws,  # noqa: E402
                                                  accept_by_entropy, count_repeats, finish_canvas, generate,
                                                  load_generation_settings, sample_and_entropy,
                                                  stable_and_confident, temperatures, token_entropy)
from dllm_engine.errors import UserError  # noqa: E402
from dllm_engine.models.diffusion_gemma import load_diffusion_gemma  # noqa: E402
from test_diffusion_gemma import CANVAS, TINY_TEXT, reference_pair  # noqa: E402

VOCAB = TINY_TEXT["vocab_size"]
PAD = 0


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(transformers' model, ours loaded from its save_pretrained folder, the folder)."""
    return reference_pair(tmp_path_factory.mktemp("diffusion_gemma_sampler"))


def inverse_cdf(probs, u):
    """The token whose cumulative probability first reaches u: probs [..., V], u [...]."""
    return (probs.cumsum(-1) < u[..., None]).sum(-1).clamp(max=probs.shape[-1] - 1)


class ScriptedDraws:
    """Draws that transformers (through ``TorchWithDraws``) and our sampler take alike."""

    def __init__(self, batch: int, seed: int = 0):
        self.tokens = torch.Generator().manual_seed(seed)
        self.batch, self.seed = batch, seed
        self.num_steps = self.num_token_draws = 0
        self.slices = []

    def canvas_tokens(self, keys, canvas_length, vocab_size):  # ours: the keys are not read
        return self.token_draw(len(keys), canvas_length, vocab_size)

    renoise_tokens = canvas_tokens  # transformers draws both with one call: one stream, in call order

    def token_draw(self, batch, canvas_length, vocab_size):  # both sides'
        assert (batch, canvas_length, vocab_size) == (self.batch, CANVAS, VOCAB)
        self.num_token_draws += 1
        return torch.randint(0, vocab_size, (batch, canvas_length), generator=self.tokens)

    def uniforms(self):
        g = torch.Generator().manual_seed(1000 * self.seed + self.num_steps)
        return torch.rand(self.batch, CANVAS, generator=g)

    def sample(self, scaled_logits, positions, keys):  # ours: [B, c, V] logits of some positions
        self.num_steps += positions.start == 0
        self.slices.append((positions.start, positions.stop))
        return inverse_cdf(scaled_logits.softmax(-1, dtype=torch.float32), self.uniforms()[:, positions])

    def multinomial(self, probs):  # transformers': [B*C, V] probabilities
        self.num_steps += 1
        return inverse_cdf(probs, self.uniforms().reshape(-1))


class TorchWithDraws:
    """transformers' generation module's ``torch``, its two random calls answered by ``draws``."""

    def __init__(self, draws: ScriptedDraws):
        self.draws = draws

    def __getattr__(self, name):
        return getattr(torch, name)

    def randint(self, low, high, size, device=None):
        assert low == 0 and len(size) == 2
        return self.draws.token_draw(size[0], size[1], high)

    def multinomial(self, probs, num_samples):
        assert num_samples == 1 and probs.shape[-1] == VOCAB
        return self.draws.multinomial(probs)[:, None]


def run_transformers(ref, prompt, mask, settings: GenerationSettings, seed: int):
    draws = ScriptedDraws(prompt.shape[0], seed)
    masked = {} if mask is None else {"attention_mask": mask}  # transformers reads a None mask as a tensor
    with mock.patch.object(reference, "torch", TorchWithDraws(draws)):
        out = ref.generate(
            prompt, **masked, max_new_tokens=settings.max_new_tokens,
            max_denoising_steps=settings.max_denoising_steps,
            sampler_config=reference.EntropyBoundSamplerConfig(entropy_bound=float(settings.entropy_bound)),
            t_min=settings.t_min, t_max=settings.t_max, stability_threshold=settings.stability_threshold,
            confidence_threshold=float(settings.confidence_threshold),
            eos_token_id=list(settings.eos_token_ids) or None, pad_token_id=settings.pad_token_id)
    return out.sequences[:, prompt.shape[1]:], draws


def same_as_transformers(models, prompt, mask, settings, seed=0):
    """Our Generation, checked token for token (and draw for draw) against transformers'."""
    ref, model, _ = models
    theirs, their_draws = run_transformers(ref, prompt, mask, settings, seed)
    ours_draws = ScriptedDraws(prompt.shape[0], seed)
    ours = generate(model, prompt, settings, ours_draws, attention_mask=mask)
    assert (ours_draws.num_steps, ours_draws.num_token_draws) == (their_draws.num_steps, their_draws.num_token_draws)
    assert ours.token_ids.shape == theirs.shape
    assert torch.equal(ours.token_ids, theirs)
    assert ours.num_steps.sum().item() <= ours_draws.num_steps * prompt.shape[0]
    return ours


def prompts(batch, length, seed, pad=0):
    ids = torch.randint(3, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones(batch, length, dtype=torch.long)
    mask[1:, :pad] = 0
    return ids.masked_fill(mask == 0, PAD), mask


def accepted_counts(monkeypatch):
    """Spy: the number of positions accepted per row at each of our steps."""
    counts = []
    accept = sampler.accept_by_entropy

    def spy(entropy, bound):
        accepted = accept(entropy, bound)
        counts.extend(accepted.sum(-1).tolist())
        return accepted

    monkeypatch.setattr(sampler, "accept_by_entropy", spy)
    return counts


# -- parity with transformers' generate -----------------------------------------------------------
def test_one_prompt_matches_transformers(models, monkeypatch):
    prompt, _ = prompts(1, 5, seed=1)
    settings = GenerationSettings(max_new_tokens=CANVAS, max_denoising_steps=5, entropy_bound=1.0)
    counts = accepted_counts(monkeypatch)
    out = same_as_transformers(models, prompt, None, settings)
    assert out.num_steps.tolist() == [[5]]  # no early stop at the release's thresholds
    assert any(1 < n < CANVAS for n in counts)  # entropy-bound acceptance took some, not all


def test_left_padded_batch_of_two_matches_transformers(models, monkeypatch):
    prompt, mask = prompts(2, 7, seed=2, pad=3)
    counts = accepted_counts(monkeypatch)
    out = same_as_transformers(models, prompt, mask, GenerationSettings(max_new_tokens=CANVAS, max_denoising_steps=5))
    assert not torch.equal(out.token_ids[0], out.token_ids[1])
    assert min(counts) == 1 and max(counts) < CANVAS  # the release's bound 0.1: few positions a step


def test_several_canvases_match_transformers(models):
    """max_new_tokens 15 over canvases of 6: three canvases, each encoded before the next."""
    prompt, mask = prompts(2, 7, seed=3, pad=2)
    settings = GenerationSettings(max_new_tokens=2 * CANVAS + 3, max_denoising_steps=3, entropy_bound=2.0)
    out = same_as_transformers(models, prompt, mask, settings)
    assert out.token_ids.shape == (2, 3 * CANVAS) and out.num_steps.tolist() == [[3, 3, 3], [3, 3, 3]]


@pytest.mark.parametrize("stability, confidence, temps, bound, steps, prompt_seed, pad, seed", [
    (1, 0.8, (0.02, 0.2), 1.0, 10, 3, 3, 1),  # stable for a step and confident: row 1 stops in canvas 1
    (0, 0.8, (0.05, 0.5), 1.0, 8, 4, 2, 2),  # confident alone: both rows stop, each canvas ends early
])
def test_early_stop_matches_transformers(models, stability, confidence, temps, bound, steps, prompt_seed, pad,
                                         seed):
    """Rows stop at different steps (a stopped row keeps its canvas and self-conditioning while
    the other runs); a canvas ends once every row has stopped."""
    prompt, mask = prompts(2, 7, seed=prompt_seed, pad=pad)
    settings = GenerationSettings(max_new_tokens=2 * CANVAS, max_denoising_steps=steps, entropy_bound=bound,
                                  t_min=temps[0], t_max=temps[1], stability_threshold=stability,
                                  confidence_threshold=confidence)
    out = same_as_transformers(models, prompt, mask, settings, seed=seed)
    per_canvas = out.num_steps.T.tolist()  # [canvas][row]
    assert any(min(rows) < steps and rows[0] != rows[1] for rows in per_canvas)  # one row stopped, one ran on
    if stability == 0:
        assert all(max(rows) < steps for rows in per_canvas)


def test_eos_finishes_a_row_and_then_the_generation(models):
    prompt, mask = prompts(2, 7, seed=3, pad=2)
    base = GenerationSettings(max_new_tokens=3 * CANVAS, max_denoising_steps=3, entropy_bound=2.0,
                              pad_token_id=PAD)
    free = same_as_transformers(models, prompt, mask, base).token_ids
    row0, row1 = free[0].tolist(), free[1].tolist()
    eos0 = next(t for t in row0[1:CANVAS - 1] if t not in row1 and t != PAD)
    cut = row0.index(eos0) + 1
    one = same_as_transformers(models, prompt, mask, replace(base, eos_token_ids=(eos0,)))
    assert one.token_ids[0].tolist() == row0[:cut] + [PAD] * (3 * CANVAS - cut)  # pad after EOS and later canvases
    assert torch.equal(one.token_ids[1], free[1])  # the other row runs on
    eos1 = next(t for t in row1[:CANVAS] if t not in row0[:cut - 1] and t != PAD)
    both = same_as_transformers(models, prompt, mask,
                                replace(base, eos_token_ids=(eos0, eos1)))
    assert both.token_ids.shape == (2, CANVAS)  # both rows finished in canvas 0: no canvas 1
    assert both.token_ids[0].tolist() == row0[:cut] + [PAD] * (CANVAS - cut)


# -- the per-step math ------------------------------------------------------------------------------
def test_entropy_bound_acceptance_by_hand_and_against_a_loop():
    # sorted: 0.01 0.02 0.05 0.3 | 0.5, the sums before each 0 .01 .03 .08 | .38
    entropy = torch.tensor([[0.05, 0.3, 0.01, 0.02, 0.5],
                            [1.0, 2.0, 0.5, 0.4, 3.0],  # only the lowest (0.4): 0.4 before the next
                            [0.5, 0.25, 0.25, 0.75, 1.0]])  # sums before 0 .25 .5 (= the bound: in) | 1.0
    bounds = torch.tensor([0.1, 0.1, 0.5])
    got = torch.stack([accept_by_entropy(entropy[i:i + 1], bounds[i].item())[0] for i in range(3)])
    assert got.tolist() == [[True, True, True, True, False], [False, False, False, True, False],
                            [True, True, True, False, False]]
    g = torch.Generator().manual_seed(0)
    random = torch.rand(8, 12, generator=g) * torch.rand(8, 1, generator=g)
    accepted = accept_by_entropy(random, 0.3)
    for row, mask in zip(random.tolist(), accepted.tolist()):  # plain Python: the lowest first
        total, expected = 0.0, [False] * len(row)
        for i in sorted(range(len(row)), key=row.__getitem__):
            if total > 0.3:
                break
            expected[i], total = True, total + row[i]
        assert mask == expected


def test_temperature_schedule_by_hand_and_as_transformers():
    settings = GenerationSettings(max_denoising_steps=4, t_min=0.4, t_max=0.8)
    got = temperatures(settings, torch.arange(4))  # steps already run 0..3: n = 4, 3, 2, 1
    assert got.dtype == torch.float32
    assert got.tolist() == pytest.approx([0.8, 0.7, 0.6, 0.5], abs=1e-7)
    release = GenerationSettings()
    processor = reference.LinearTemperatureScheduleLogitsProcessor(0.4, 0.8, 48)
    ones = torch.ones(1)
    for done in range(48):  # transformers divides by its temperature; the same bits
        theirs = processor(None, ones, cur_step=torch.tensor(48 - done, dtype=torch.int32))
        assert torch.equal(ones / temperatures(release, torch.tensor([done])), theirs)


def test_stability_counts_and_confidence():
    a, b = torch.tensor([[1, 2, 3]]), torch.tensor([[1, 2, 4]])
    repeats, seen = torch.tensor([-1]), []
    previous = torch.tensor([[7, 7, 7]])  # the random first canvas: never a stable comparison
    for argmax in (a, a, b, b, b):
        repeats = count_repeats(previous, argmax, repeats)
        previous = argmax
        seen.append(repeats.item())
    assert seen == [0, 1, 0, 1, 2]
    entropy = torch.tensor([[0.001, 0.003], [0.001, 0.003], [0.01, 0.0]])  # means .002 .002 .005
    settings = GenerationSettings(stability_threshold=2, confidence_threshold=0.005)
    assert stable_and_confident(torch.tensor([2, 1, 3]), entropy, settings).tolist() == [True, False, False]
    always = GenerationSettings(stability_threshold=0, confidence_threshold=0.005)
    assert stable_and_confident(torch.tensor([0, 0, 0]), entropy, always).tolist() == [True, True, False]


def test_finish_canvas_pads_after_eos_and_finished_rows():
    canvas = torch.tensor([[5, 1, 7, 1, 9], [4, 4, 4, 4, 4], [3, 8, 3, 3, 3]])
    before = torch.tensor([False, False, True])
    settings = GenerationSettings(eos_token_ids=(1, 8), pad_token_id=0)
    ids, finished = finish_canvas(canvas, before, settings)
    assert ids.tolist() == [[5, 1, 0, 0, 0], [4, 4, 4, 4, 4], [0, 0, 0, 0, 0]]
    assert finished.tolist() == [True, False, True]
    ids, finished = finish_canvas(canvas, before, GenerationSettings(eos_token_ids=(1,)))  # no pad id
    assert torch.equal(ids, canvas) and finished.tolist() == [True, False, True]


def test_sampling_and_entropy_run_in_chunks_of_positions():
    logits = 3 * torch.randn(2, CANVAS, VOCAB, generator=torch.Generator().manual_seed(5))
    chunked, whole = ScriptedDraws(2), ScriptedDraws(2)
    keys = DrawKeys.at(torch.arange(2), 0, 0)
    sampled, entropy = sample_and_entropy(logits, chunked, keys, chunk_elements=2 * VOCAB * 4)  # 4 positions
    assert chunked.slices == [(0, 4), (4, CANVAS)]
    sampled_whole, entropy_whole = sample_and_entropy(logits, whole, keys)
    assert whole.slices == [(0, CANVAS)]
    assert torch.equal(sampled, sampled_whole) and torch.equal(entropy, entropy_whole)
    assert torch.equal(entropy, torch.distributions.Categorical(logits=logits).entropy())
    assert torch.equal(token_entropy(logits[:, :1]), entropy[:, :1])


# -- settings and input errors ------------------------------------------------------------------------
def test_defaults_are_transformers_and_the_release_config_reads():
    defaults = reference.DiffusionGemmaGenerationConfig._get_default_generation_params()
    ours = GenerationSettings()
    assert {k: getattr(ours, k) for k in defaults if k != "sampler_config"} == \
        {k: v for k, v in defaults.items() if k != "sampler_config"}
    assert ours.entropy_bound == defaults["sampler_config"].entropy_bound
    release = {"max_new_tokens": 512, "max_denoising_steps": 32, "t_min": 0.3, "t_max": 0.9,
               "sampler_config": {"_cls_name": "EntropyBoundSamplerConfig", "entropy_bound": 0.2},
               "stability_threshold": 2, "confidence_threshold": 0.01, "eos_token_id": [1, 106],
               "pad_token_id": 0, "bos_token_id": 2, "transformers_version": "5.25.0"}
    got = GenerationSettings.from_generation_config(release)
    assert got == GenerationSettings(512, 32, 0.2, 0.3, 0.9, 2, 0.01, (1, 106), 0)
    assert got.num_canvases(256) == 2


def test_a_saved_generation_config_with_nulls_takes_the_defaults(models, caplog):
    _, model, folder = models
    assert json.loads((folder / "generation_config.json").read_text())["t_min"] is None
    cfg = model.config
    settings = load_generation_settings(folder, cfg.eos_token_ids, cfg.pad_token_id)
    assert settings == GenerationSettings(eos_token_ids=(1,), pad_token_id=0)
    (folder / "other").mkdir()
    (folder / "other" / "generation_config.json").write_text(json.dumps({"top_k": 5, "eos_token_id": 3}))
    with caplog.at_level(logging.WARNING, logger="dllm_engine.decoding.diffusion_gemma"):
        settings = load_generation_settings(folder / "other", (1,), 0)
    assert settings.eos_token_ids == (3,) and "ignoring ['top_k']" in caplog.text


@pytest.mark.parametrize("change, match", [
    ({"t_min": 0.8, "t_max": 0.4}, "t_max 0.4 must be greater than t_min 0.8"),
    ({"max_denoising_steps": 0}, "max_denoising_steps must be a positive integer, got 0"),
    ({"max_new_tokens": 2.5}, "max_new_tokens must be a positive integer, got 2.5"),
    ({"stability_threshold": -1}, "stability_threshold must be an integer >= 0, got -1"),
    ({"confidence_threshold": 0}, "confidence_threshold must be a number > 0, got 0"),
    ({"sampler_config": {"_cls_name": "TopKSamplerConfig", "k": 2}}, "'TopKSamplerConfig' is not supported"),
    ({"sampler_config": {"_cls_name": "EntropyBoundSamplerConfig"}}, "needs an \"entropy_bound\""),
    ({"sampler_config": {"entropy_bound": -0.1}}, "entropy_bound must be a number > 0, got -0.1"),
])
def test_bad_generation_config_values_are_refused(change, match):
    with pytest.raises(UserError, match=match) as info:
        GenerationSettings.from_generation_config(change, source="gen.json")
    assert str(info.value).startswith("gen.json: ")


def test_generate_refuses_bad_prompts(models):
    _, model, _ = models
    with pytest.raises(UserError, match=r"prompt_ids must be a \[batch, length\] tensor"):
        generate(model, torch.tensor([5, 6, 7]))
    with pytest.raises(UserError, match="attention_mask has shape"):
        generate(model, torch.tensor([[5, 6, 7]]), attention_mask=torch.ones(1, 2))


def test_torch_draws_on_a_bfloat16_model(models):
    """The default draws (torch's generators) on a bf16 model: self-conditioning in bf16, the
    same tokens from the same generator seed."""
    _, _, folder = models
    model = load_diffusion_gemma(folder, dtype="bfloat16")
    prompt, mask = prompts(2, 5, seed=6, pad=1)
    settings = GenerationSettings(max_new_tokens=2 * CANVAS, max_denoising_steps=3)
    runs = [generate(model, prompt, settings, TorchDraws(torch.Generator().manual_seed(7)), attention_mask=mask)
            for _ in range(2)]
    assert torch.equal(runs[0].token_ids, runs[1].token_ids) and runs[0].token_ids.shape == (2, 2 * CANVAS)
    assert 0 <= runs[0].token_ids.min() and runs[0].token_ids.max() < VOCAB
    other = generate(model, prompt, settings, TorchDraws(torch.Generator().manual_seed(8)), attention_mask=mask)
    assert not torch.equal(other.token_ids, runs[0].token_ids)
