"""The masked-diffusion log-likelihood bound (eval/likelihood.py) against plain-PyTorch references."""
import itertools
import math

import pytest
import torch

from dllm_engine.eval.likelihood import (LikelihoodConfig, draw_masks, loglikelihood, mask_counts,
                                         segments)
from fixtures import IDS, random_llada2_model, random_model

MASK = IDS["mask_token_id"]
PROMPT = [5, 17, 30, 22, 9, 41]
TARGET = [12, 60, 33, 7, 70, 18, 25]  # 7 tokens: with block_size 4 and the prompt's 6, three blocks


def reference_term(model, ids: list[int], masked: list[int], prompt_len: int, cfg_scale: float) -> float:
    """sum over masked positions of log p(token), from the plain forward over the whole sequence
    (Dream's shift applied by ``forward``; nothing truncated)."""
    x = torch.tensor([ids])
    noisy = x.clone()
    noisy[0, masked] = MASK
    with torch.no_grad():
        logits = model(noisy)
        if cfg_scale > 0:  # LLaDA's guidance: the unconditional copy has its prompt masked
            uncond = noisy.clone()
            uncond[0, :prompt_len] = MASK
            un = model(uncond)
            logits = un + (cfg_scale + 1) * (logits - un)
        logp = logits.log_softmax(-1)
    return sum(float(logp[0, i, ids[i]]) for i in masked)


def reference_loglikelihood(model, cfg: LikelihoodConfig) -> float:
    """LLaDA's estimator written out: per segment, per sample, -CE / mask ratio, averaged; draws come
    from the same generator in the same order as the engine's code."""
    ids = PROMPT + TARGET
    gen = torch.Generator().manual_seed(cfg.seed)
    total = 0.0
    for start, end in segments(model, len(PROMPT), len(ids)):
        n = end - start
        for _ in range(cfg.mc_num // cfg.mc_batch):
            for row in draw_masks(n, cfg.mc_batch, gen):
                masked = [start + i for i in range(n) if row[i]]
                term = reference_term(model, ids, masked, len(PROMPT), cfg.cfg_scale)
                total += term / (len(masked) / n) / cfg.mc_num
    return total


@pytest.mark.parametrize("family,cfg_scale", [("llada", 0.0), ("llada", 1.5), ("Dream", 0.0),
                                              ("sdar", 0.0), ("llada2_moe", 0.0)])
def test_matches_plain_pytorch_reference(family, cfg_scale):
    model = (random_llada2_model(seed=3) if family == "llada2_moe"
             else random_model(family, seed=3, block_size=4))
    cfg = LikelihoodConfig(mc_num=4, mc_batch=2, cfg_scale=cfg_scale, seed=7)
    got = loglikelihood(model, PROMPT, TARGET, MASK, cfg)
    assert got.value == pytest.approx(reference_loglikelihood(model, cfg), rel=1e-4)
    num_spans = 3 if model.config.is_block_causal else 1  # block size 4, continuation at 6..13
    assert got.nfe == num_spans * 2 * (2 if cfg_scale else 1)


def test_sdar_spans_follow_its_blocks():
    model = random_model("sdar", block_size=4)
    assert segments(model, 6, 13) == [(6, 8), (8, 12), (12, 13)]
    assert segments(random_model("llada"), 6, 13) == [(6, 13)]


def test_deterministic_for_a_seed():
    model = random_model("llada", seed=1)
    cfg = LikelihoodConfig(mc_num=8, mc_batch=4, seed=0)
    first = loglikelihood(model, PROMPT, TARGET, MASK, cfg).value
    assert loglikelihood(model, PROMPT, TARGET, MASK, cfg).value == first
    assert loglikelihood(model, PROMPT, TARGET, MASK, LikelihoodConfig(8, 4, seed=1)).value != first


def test_mask_counts_spread_evenly_over_one_to_n():
    """LLaDA's stratification: ``num`` counts n/num apart from a random start, wrapped into 1..n."""
    gen = torch.Generator().manual_seed(0)
    starts = set()
    for _ in range(8):
        counts = mask_counts(5, 5, gen).tolist()
        assert sorted(counts) == [1, 2, 3, 4, 5]
        starts.add(counts[0])
        spaced = mask_counts(10, 5, gen).tolist()
        assert all((b - a) % 10 == 2 for a, b in zip(spaced, spaced[1:])), spaced
    assert len(starts) > 1  # the start is random
    masks = draw_masks(5, 5, gen)
    assert sorted(masks.sum(1).tolist()) == [1, 2, 3, 4, 5]


def test_expectation_is_the_exact_bound():
    """Averaged over many samples the estimate approaches the bound computed exactly by enumerating
    every mask: E_k~U{1..n} E_{|M|=k} [sum_{i in M} log p(x_i | x without M)] * n / k."""
    model = random_model("llada", seed=2)
    target = TARGET[:3]
    n, ids = len(target), PROMPT + target
    exact = 0.0
    for k in range(1, n + 1):
        subsets = list(itertools.combinations(range(len(PROMPT), len(ids)), k))
        mean = sum(reference_term(model, ids, list(s), len(PROMPT), 0.0) for s in subsets) / len(subsets)
        exact += mean * n / k / n
    estimate = loglikelihood(model, PROMPT, target, MASK, LikelihoodConfig(mc_num=600, mc_batch=60))
    assert math.isclose(estimate.value, exact, rel_tol=0.01), (estimate.value, exact)


@pytest.mark.parametrize("kwargs,msg", [(dict(mc_num=10, mc_batch=4), "mc_num .10. must be a positive multiple"),
                                        (dict(cfg_scale=-1.0), "cfg_scale must be >= 0")])
def test_bad_config(kwargs, msg):
    with pytest.raises(ValueError, match=msg):
        LikelihoodConfig(**kwargs)


def test_empty_continuation_is_refused():
    with pytest.raises(ValueError, match="non-empty prompt and a non-empty continuation"):
        loglikelihood(random_model("llada"), PROMPT, [], MASK)


def test_a_sequence_longer_than_the_context_is_refused():
    """Positions past the model's context were scored as if they fitted: callers cut the prompt."""
    model = random_model("llada", max_position_embeddings=len(PROMPT) + len(TARGET) - 1)
    with pytest.raises(ValueError, match="exceed the model's context of 12 tokens"):
        loglikelihood(model, PROMPT, TARGET, MASK, LikelihoodConfig(4, 4))
