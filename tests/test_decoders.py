"""Baseline decoders: equal to plain re-implementations of the reference samplers."""

import pytest
import torch

from dllm_engine import LLM, SamplingParams
from dllm_engine.decoding import factor_select, num_transfer_tokens, threshold_select, topk_select
from fixtures import write_checkpoint

PROMPTS = [[42, 13, 14, 15, 16, 17, 18], [20, 21, 22], [30, 31, 32, 33, 34]]


@pytest.fixture(scope="module")
def llms(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    return {mt: LLM(write_checkpoint(root / mt, mt)) for mt in ("llada", "Dream", "sdar")}


def llada_reference(model, prompt, gen_length, block_length, steps, mask_id, cfg_scale=0.0):
    """LLaDA generate.py: full forward each step, fixed-k low confidence,
    optional classifier-free guidance (second copy with the prompt masked)."""
    x = torch.tensor(prompt + [mask_id] * gen_length)
    p = len(prompt)
    for b in range(gen_length // block_length):
        lo, hi = p + b * block_length, p + (b + 1) * block_length
        schedule = num_transfer_tokens(int((x[lo:hi] == mask_id).sum()), steps)
        for k in schedule:
            with torch.no_grad():
                logits = model(x[None])[0]
                if cfg_scale > 0:
                    un_x = x.clone()
                    un_x[:p] = mask_id
                    un = model(un_x[None])[0]
                    logits = un + (cfg_scale + 1) * (logits - un)
            logits[:, mask_id] = -float("inf")  # the engine never predicts a mask
            x0 = logits.argmax(-1)
            conf = torch.softmax(logits, -1).gather(-1, x0[:, None])[:, 0]
            cand = torch.full_like(conf, -float("inf"))
            cand[lo:hi] = torch.where(x[lo:hi] == mask_id, conf[lo:hi], -float("inf"))
            idx = torch.topk(cand, k).indices
            x[idx] = x0[idx]
    return x[p:].tolist()


def sdar_reference(model, prompt, gen_length, block_length, threshold, mask_id, stop_ids):
    """SDAR block_diffusion_generate without a cache: every step recomputes the whole prefix."""
    total = -(-(len(prompt) + gen_length) // block_length) * block_length
    x = torch.tensor(prompt + [mask_id] * (total - len(prompt)))
    for lo in range((len(prompt) // block_length) * block_length, total, block_length):
        hi = lo + block_length
        while (x[lo:hi] == mask_id).any():
            with torch.no_grad():
                logits = model(x[None, :hi])[0, lo:hi]  # block-causal mask from the model
            logits[:, mask_id] = -float("inf")
            x0 = logits.argmax(-1)
            conf = torch.softmax(logits, -1).gather(-1, x0[:, None])[:, 0]
            masked = x[lo:hi] == mask_id
            chosen = masked & (conf >= threshold)
            if not chosen.any():
                chosen[torch.where(masked, conf, -1.0).argmax()] = True
            x[lo:hi] = torch.where(chosen, x0, x[lo:hi])
        if any(t in stop_ids for t in x[max(lo, len(prompt)):hi].tolist()):
            x[hi:] = stop_ids[0]
            break
    return x[len(prompt):len(prompt) + gen_length].tolist()


@pytest.mark.parametrize("model_type", ["llada", "Dream"])
def test_reference_decoder_equals_plain_llada_sampler(llms, model_type):
    llm = llms[model_type]
    # stop_at_eos=False: LLaDA's generate.py decodes the whole canvas
    params = SamplingParams(method="reference", max_new_tokens=16, block_length=8, steps=4,
                            stop_at_eos=False)
    for prompt in PROMPTS:
        want = llada_reference(llm.model, prompt, 16, 8, 4, llm.token_ids.mask_id)
        got = llm.generate([prompt], params)[0]
        seq_canvas = got.token_ids
        assert want[: len(seq_canvas)] == seq_canvas
        assert len(seq_canvas) == 16 or want[len(seq_canvas)] in llm.token_ids.stop_ids


def test_classifier_free_guidance_equals_plain_sampler(llms):
    llm = llms["llada"]
    params = SamplingParams(method="reference", max_new_tokens=8, block_length=8, steps=4,
                            cfg_scale=1.5, stop_at_eos=False)
    for prompt in PROMPTS[:2]:
        want = llada_reference(llm.model, prompt, 8, 8, 4, llm.token_ids.mask_id, cfg_scale=1.5)
        got = llm.generate([prompt], params)[0].token_ids
        assert want[: len(got)] == got
    plain = llm.generate(PROMPTS[:1], params.replace(cfg_scale=0.0))[0].token_ids
    assert llm.generate(PROMPTS[:1], params)[0].token_ids != plain  # guidance changes the output


@pytest.mark.slow  # over 2 s on 2 busy cores
def test_block_decoder_with_cache_equals_recomputing_the_prefix(llms):
    check_block_cache_is_exact(llms["sdar"])


def check_block_cache_is_exact(llm):
    """`block` with its committed-block cache == recomputing the whole prefix every step."""
    stop = sorted(llm.token_ids.stop_ids)
    for prompt in PROMPTS:
        for threshold in (0.3, 0.9):
            params = SamplingParams(method="block", max_new_tokens=12, block_length=4, threshold=threshold)
            want = sdar_reference(llm.model, prompt, 12, 4, threshold, llm.token_ids.mask_id,
                                  [llm.token_ids.eos_id] + stop)
            got = llm.generate([prompt], params)[0].token_ids
            cut = next((i for i, t in enumerate(want) if t in llm.token_ids.stop_ids), len(want))
            assert got == want[:cut]


@pytest.mark.parametrize("method", ["prefix-cache", "dual-cache"])
@pytest.mark.parametrize("model_type", ["llada", "Dream"])
def test_cached_decoders_match_reference_on_the_first_step_of_every_block(llms, method, model_type):
    """With one step per block every step is a block's first step: tokens must be identical."""
    llm = llms[model_type]
    ref = llm.generate(PROMPTS, SamplingParams(method="reference", max_new_tokens=16, block_length=4, steps=1))
    got = llm.generate(PROMPTS, SamplingParams(method=method, max_new_tokens=16, block_length=4, steps=1))
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]


@pytest.mark.slow  # over 2 s on 2 busy cores
@pytest.mark.parametrize("method,model_type", [("reference", "llada"), ("prefix-cache", "llada"),
                                               ("dual-cache", "llada"), ("dual-cache", "Dream"),
                                               ("block", "sdar")])
@pytest.mark.parametrize("threshold", [None, 0.5])
def test_batch_invariance(llms, method, model_type, threshold):
    llm = llms[model_type]
    params = SamplingParams(method=method, max_new_tokens=16, block_length=8, threshold=threshold)
    batched = llm.generate(PROMPTS, params)
    for prompt, out in zip(PROMPTS, batched):
        assert llm.generate([prompt], params)[0].token_ids == out.token_ids


def test_sampling_is_seeded_and_batch_invariant(llms):
    llm = llms["llada"]
    params = SamplingParams(method="dual-cache", max_new_tokens=16, block_length=8, temperature=1.0, seed=7)
    a = llm.generate(PROMPTS, params)
    b = llm.generate(PROMPTS[:1], params)
    assert a[0].token_ids == b[0].token_ids
    c = llm.generate(PROMPTS[:1], params.replace(seed=8))
    assert c[0].token_ids != b[0].token_ids


def test_stats_follow_the_spec(llms):
    llm = llms["llada"]
    out = llm.generate(PROMPTS, SamplingParams(method="reference", max_new_tokens=16, block_length=8,
                                               stop_at_eos=False))
    for prompt, o in zip(PROMPTS, out):
        s = o.stats
        assert s.nfe == 16 and s.decoded_tokens == 16
        assert s.prefill_tokens == len(prompt)
        # every reference step computes the whole canvas; the first pass over the prompt is prefill
        assert s.processed_tokens == 16 * (len(prompt) + 16) - len(prompt)
        assert s.redundancy == pytest.approx(s.processed_tokens / 16)
        assert s.output_tokens == len(o.token_ids)
    assert out.stats.decoded_tokens == 48 and out.stats.nfe == 48


def test_dual_cache_processes_only_the_block_after_the_first_step(llms):
    llm = llms["llada"]
    out = llm.generate([PROMPTS[0]], SamplingParams(method="dual-cache", max_new_tokens=16,
                                                    block_length=8, stop_at_eos=False))[0]
    canvas = len(PROMPTS[0]) + 16
    # per block: one full forward + 7 block-only forwards
    assert out.stats.processed_tokens == 2 * canvas + 14 * 8 - len(PROMPTS[0])


def test_commit_rules_on_hand_computed_examples():
    conf = torch.tensor([0.95, 0.2, 0.91, 0.5, 0.89])
    assert threshold_select(conf, 0.9).tolist() == [True, False, True, False, False]
    assert threshold_select(conf, 0.99).tolist() == [True, False, False, False, False]  # top-1 kept
    assert threshold_select(conf, 0.99, min_k=2).tolist() == [True, False, True, False, False]
    # factor 1: n=1 needs >= 0.5, n=2 >= 0.667, n=3 >= 0.75 (0.89 ok), n=4 >= 0.8 (0.5 fails)
    assert factor_select(conf, 1.0).tolist() == [True, False, True, False, True]
    assert factor_select(torch.tensor([0.3, 0.2]), 0.5).tolist() == [True, False]
    assert topk_select(conf, 2).tolist() == [True, False, True, False, False]
    assert num_transfer_tokens(10, 4) == [3, 3, 2, 2]

def test_batched_selection_equals_each_rule_alone():
    """``GroupRules.select`` (every commit path's selection) picks, per row, exactly what the
    rule picks for that sequence alone: ties to the lower index, thresholds hit exactly, k past
    the row, fixed-k, threshold with a minimum k and the factor rule in one group."""
    from dllm_engine.decoding.decide import GroupRules
    from dllm_engine.engine.sequence import Sequence, TokenIds
    from dllm_engine.resolve import resolve_params
    ids = TokenIds(mask_id=4, eos_id=3, stop_ids=frozenset({3}))
    torch.manual_seed(0)
    options = [("dual-cache", dict(threshold=0.9)), ("dual-cache", dict(threshold=0.5)),
               ("dual-cache", dict(steps=3)), ("block", dict(threshold=0.95)), ("dual-cache", dict(factor=1.0)),
               ("reference", dict(steps=8)), ("block", dict(threshold=0.75)), ("dual-cache", dict(factor=0.3))]
    seqs = [Sequence(i, [10, 11, 12], resolve_params(SamplingParams(method=m, max_new_tokens=8, block_length=8, **o),
                                                     (m,)), ids) for i, (m, o) in enumerate(options)]
    counts = [5, 1, 8, 3, 8, 4, 6, 7]
    conf = torch.randint(0, 5, (sum(counts),)).float() / 4  # many ties
    conf[:3] = torch.tensor([0.9, 0.9, 0.5])  # exactly at a float32 threshold
    conf[sum(counts[:4]): sum(counts[:5])] = torch.tensor([0.9, 0.5, 0.89, 0.2, 0.1, 0.76, 0.3, 0.1])
    chosen = GroupRules(seqs, counts, [0] * len(seqs), conf.device).select(conf)
    assert chosen.shape == conf.shape and chosen.dtype == torch.bool
    for seq, c, got in zip(seqs, conf.split(counts), chosen.split(counts)):
        p = seq.params
        if p.factor is not None and p.threshold is None:
            want = factor_select(c, p.factor)
        elif p.threshold is None:
            want = topk_select(c, seq.tokens_this_step())
        else:
            want = threshold_select(c, p.threshold, min_k=1)
        assert torch.equal(got, want), (p.method, c, got, want)
    assert chosen[sum(counts[:4]): sum(counts[:5])].sum() == 3  # factor 1: the top 3 (0.9, 0.89, 0.76)



@pytest.mark.slow  # over 2 s on 2 busy cores
@pytest.mark.parametrize("method", ["reference", "prefix-cache", "dual-cache", "dual-cache+adaptive-length"])
def test_llada_decoders_stop_after_the_stop_block_unless_asked_not_to(llms, method):
    """Every decoder stops after the finished block holding the first stop token by default;
    ``stop_at_eos=False`` decodes the whole canvas, as LLaDA's generate.py and Fast-dLLM do."""
    llm = llms["llada"]
    # token 25 is often predicted by the random model: as a stop id it ends sequences early
    params = SamplingParams(method=method, max_new_tokens=32, block_length=4, threshold=0.3,
                            stop_token_ids=[25], eos_threshold=1.5)
    default = llm.generate(PROMPTS, params)
    stopping = llm.generate(PROMPTS, params.replace(stop_at_eos=True))
    whole = llm.generate(PROMPTS, params.replace(stop_at_eos=False))
    assert any(a.stats.decoded_tokens < b.stats.decoded_tokens for a, b in zip(stopping, whole))
    assert all(o.stats.decoded_tokens == 32 for o in whole)
    assert [o.stats.nfe for o in default] == [o.stats.nfe for o in stopping]
    # stopping early never changes what the user receives
    assert [o.token_ids for o in stopping] == [o.token_ids for o in whole]


def test_block_diffusion_stops_after_a_block_with_a_stop_token(llms):
    params = SamplingParams(method="block", max_new_tokens=32, block_length=4, threshold=0.3,
                            stop_token_ids=[25])
    default = llms["sdar"].generate(PROMPTS, params)
    whole = llms["sdar"].generate(PROMPTS, params.replace(stop_at_eos=False))
    assert any(a.stats.nfe < b.stats.nfe for a, b in zip(default, whole))
    assert [o.token_ids for o in default] == [o.token_ids for o in whole]


def test_top_k_and_top_p_keep_what_a_plain_sort_keeps():
    from dllm_engine.decoding.rules import keep_top
    torch.manual_seed(0)
    logits, temperature = torch.randn(6, 50, dtype=torch.float64) * 3, 0.7
    for top_k, top_p in ((5, 1.0), (0, 0.6), (8, 0.3), (0, 1e-9)):
        kept = torch.isfinite(keep_top(logits, temperature, top_k, top_p))
        for row, mask in zip(logits, kept):
            order = row.argsort(descending=True).tolist()
            order = order[:top_k] if top_k else order
            probs = torch.softmax(row[order] / temperature, -1)  # top-p after top-k, renormalised (as HF)
            # the smallest prefix of the ranking whose mass reaches top_p (one token at least)
            n = next(i + 1 for i in range(len(order)) if probs[: i + 1].sum() >= top_p or i + 1 == len(order))
            assert set(mask.nonzero()[:, 0].tolist()) == set(order[:n]), (top_k, top_p)


def keys(n: int, seed: int = 0):
    """Noise keys of n rows: one request, positions 0..n-1, its first forward."""
    from dllm_engine.decoding.noise import Noise
    return Noise(torch.full((n,), seed), torch.arange(n), torch.ones(n, dtype=torch.long))


def test_sampling_draws_only_inside_top_k():
    from dllm_engine.decoding import sample_tokens
    logits = torch.tensor([[4.0, 3.9, 3.8, 0.0, -1.0]]).repeat(2000, 1)
    drawn = set(sample_tokens(logits, 1.0, keys(2000), top_k=2).tolist())
    assert drawn == {0, 1}
    assert set(sample_tokens(logits, 1.0, keys(2000)).tolist()) >= {0, 1, 2, 3}  # without it, the tail is drawn too


@pytest.mark.parametrize("temperature", [1e3, 1e30, 1e300])
def test_a_huge_temperature_never_draws_an_excluded_token(temperature):
    """logits / T vanish at a large T; the draw stays among the allowed tokens (the mask and what
    top-k leaves out have logit -inf), never a NaN's index."""
    from dllm_engine.decoding import sample_tokens
    logits = torch.randn(500, 6, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    logits[:, 0] = -float("inf")  # the mask column
    assert 0 not in set(sample_tokens(logits, temperature, keys(500)).tolist())
    kept = set(sample_tokens(logits, temperature, keys(500, seed=1), top_k=2).tolist())
    assert kept and all(t != 0 for t in kept)
    top2 = logits.topk(2, dim=-1).indices
    drawn = sample_tokens(logits, temperature, keys(500, seed=2), top_k=2)
    assert bool((drawn[:, None] == top2).any(1).all())


def test_a_commit_never_overwrites_or_writes_the_mask(llms):
    llm = llms["llada"]
    seq = llm.make_sequence([42, 13], SamplingParams(max_new_tokens=8, block_length=8))
    mask = seq.ids.mask_id
    seq.commit(torch.tensor([2, 3]), torch.tensor([5, 6]))
    with pytest.raises(RuntimeError, match="overwrite a committed slot or write the mask token"):
        seq.commit(torch.tensor([3, 4]), torch.tensor([7, 8]))  # slot 3 is taken
    with pytest.raises(RuntimeError, match="overwrite a committed slot or write the mask token"):
        seq.commit(torch.tensor([5]), torch.tensor([mask]))
    assert seq.stats.decoded_tokens == 2 <= seq.canvas_len - seq.prompt_len


def test_offline_logprobs_are_those_of_the_committed_tokens(llms):
    llm = llms["llada"]
    params = SamplingParams(max_new_tokens=16, block_length=8, logprobs=3, stop_at_eos=False)
    out = llm.generate([PROMPTS[0]], params)[0]
    assert len(out.logprobs) == len(out.token_ids) and out.token_ids
    for token, (logprob, top_ids, top_values) in zip(out.token_ids, out.logprobs):
        assert top_ids[0] == token and logprob == pytest.approx(top_values[0])  # greedy: the argmax
        assert len(top_ids) == 3 and top_values == sorted(top_values, reverse=True) and top_values[0] <= 0
    assert llm.generate([PROMPTS[0]], params.replace(logprobs=None))[0].logprobs is None


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_the_commit_rule_leaves_the_callers_logits_as_they_were(llms, temperature):
    """Every commit path excludes the mask on its own tensor: the group's decision and the
    pipeline's, whose owner (jump-share) also reads the drafts' predictions."""
    from dllm_engine.decoding.commit_rules import GroupCommit
    from dllm_engine.strategies.base import Pipeline
    llm = llms["llada"]
    for method in ("dual-cache", "dual-cache+jump-share"):
        seqs = [llm.make_sequence(p, SamplingParams(method=method, max_new_tokens=8, block_length=8,
                                                    temperature=temperature)) for p in PROMPTS[:2]]
        pipeline = Pipeline.named(method.split("+")[1:], llm.model)
        for seq in seqs:
            pipeline.setup(seq)
        logits = [torch.randn(8, llm.model.config.vocab_size) for _ in seqs]
        before = [lg.clone() for lg in logits]
        ready = [(s, s.masked_positions(), lg) for s, lg in zip(seqs, logits)]
        GroupCommit(*map(list, zip(*ready)), accounted=False).read()
        pipeline.decide_rows(*map(list, zip(*ready)))
        assert all(torch.equal(a, b) for a, b in zip(logits, before))
