"""FOCUS token eviction: the selection math against plain re-implementations written
from the spec, the delayed in-block cache against a plain cached sampler, and engine behaviour
(only kept tokens commit, batch invariance, lower redundancy)."""
import dataclasses
import math

import numpy as np
import pytest
import torch

from dllm_engine import LLM, SamplingParams
from dllm_engine.engine.kv_cache import KVCache
from dllm_engine.models.context import ForwardContext, compact
from dllm_engine.strategies.base import Pipeline
from dllm_engine.strategies.focus import (EvictionHooks, PredictorCounts, PredictorProbe,
                                          TokenEviction, apply_structure_rules, block_state, delayed_cache_ready, eviction_budget, keep_all_if_empty,
                                          keep_left_neighbours, keep_placeholders, masked_importance,
                                          select_candidates, select_kept)
from fixtures import write_checkpoint

PROMPTS = [[42, 13, 14, 15, 16, 17, 18], [20, 21, 22], [30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40]]
NO_EVICTION = 1e9  # alpha so large that the budget always covers every masked token


@pytest.fixture(scope="module")
def llms(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    return {mt: LLM(write_checkpoint(root / mt, mt)) for mt in ("llada", "Dream", "sdar")}


# -- plain references written from the paper ---------------------------------------------------
def plain_importance(q, k, masked):
    """One row, one head at a time: S = q_M k_Mᵀ/√d, window-3 max over keys, softmax, sums."""
    b, h, _, d = q.shape
    rep = h // k.shape[1]
    out = []
    for row in range(b):
        idx = masked[row].nonzero()[:, 0]
        total = torch.zeros(len(idx))
        for head in range(h):
            s = q[row, head, idx].double() @ k[row, head // rep, idx].double().T / math.sqrt(d)
            pooled = torch.stack([s[:, max(j - 1, 0): j + 2].max(1).values for j in range(len(idx))], 1) \
                if len(idx) else s
            total += torch.softmax(pooled, 1).sum(0).float()
        out.append(total)
    return out


def plain_budget(avg, num_masked, alpha):
    return min(max(math.ceil(alpha * max(avg, 1.0)), 1), num_masked)


def plain_select(delta, budget):
    """One row: top-K (ties to the lower index), or all with delta >= mean + std if >= K of them."""
    n = len(delta)
    if n <= budget:
        return [True] * n
    order = sorted(range(n), key=lambda j: (-delta[j], j))
    mean = sum(delta) / n
    std = (sum((x - mean) ** 2 for x in delta) / n) ** 0.5
    strong = [x >= mean + std for x in delta]
    if sum(strong) >= budget:
        return strong
    return [j in order[:budget] for j in range(n)]


def plain_rules(kept, positions, never_processed):
    """One row: left neighbour of every kept token; all if none; placeholders left of the last."""
    n = len(kept)
    out = list(kept)
    for j in range(1, n):
        if kept[j] and positions[j - 1] == positions[j] - 1:
            out[j - 1] = True
    if not any(out):
        out = [True] * n
    last = max((p for p, k in zip(positions, out) if k), default=-1)
    return [out[j] or (never_processed[j] and positions[j] < last) for j in range(n)]


def ragged(rows, fill):
    width = max(len(r) for r in rows)
    values = torch.tensor([r + [fill] * (width - len(r)) for r in rows])
    valid = torch.tensor([[True] * len(r) + [False] * (width - len(r)) for r in rows])
    return values, valid


# -- selection math ---------------------------------------------------------------------------
def test_importance_matches_plain_reference_with_gqa_and_ragged_rows():
    torch.manual_seed(0)
    b, h, hkv, t, d = 4, 4, 2, 9, 8
    q, k = torch.randn(b, h, t, d), torch.randn(b, hkv, t, d)
    masked = torch.zeros(b, t, dtype=torch.bool)
    masked[0, [0, 2, 3, 7, 8]] = True  # scattered
    masked[1, :] = True  # all masked
    masked[2, 5] = True  # a single token: importance = number of heads
    # row 3: nothing masked
    kept = compact(masked)
    index, valid = kept.index, kept.valid
    got = EvictionHooks.importance(q, k, index, valid)
    want = plain_importance(q, k, masked)
    for row in range(b):
        n = int(masked[row].sum())
        torch.testing.assert_close(got[row, :n], want[row], rtol=1e-5, atol=1e-5)
        assert (got[row, n:] == 0).all()
    assert got[2, 0].item() == pytest.approx(h)  # softmax over one key is 1, summed over heads
    # each query's softmax sums to 1: a row's importances add up to heads x masked tokens
    assert got[0].sum().item() == pytest.approx(h * 5, rel=1e-5)


def test_importance_padding_never_wins_the_max_pool():
    """A padded key next to a real one must not leak into the window max (pad with -inf)."""
    q = torch.randn(1, 2, 3, 4)
    k = torch.randn(1, 2, 3, 4)
    valid = torch.tensor([[True, True, False]])
    got = masked_importance(q, k, valid)
    want = plain_importance(q, k, valid)[0]
    torch.testing.assert_close(got[0, :2], want, rtol=1e-5, atol=1e-5)
    assert got[0, 2] == 0


@pytest.mark.parametrize("avg,num_masked,alpha", [(0.0, 10, 1.5), (1.0, 10, 1.5), (3.0, 10, 1.5),
                                                  (2.5, 10, 1.0), (4.0, 3, 2.0), (1.0, 0, 1.5),
                                                  (7.3, 64, 1.2)])
def test_budget_matches_the_formula(avg, num_masked, alpha):
    got = eviction_budget(np.array([avg]), np.array([num_masked]), alpha)
    assert got.tolist() == [plain_budget(avg, num_masked, alpha)]


def test_budget_is_per_row():
    got = eviction_budget(np.array([0.5, 3.0, 2.0]), np.array([8, 8, 2]), np.array([1.5, 1.5, 3.0]))
    assert got.tolist() == [2, 5, 2]


def test_selection_top_k_and_variance_branch_on_hand_examples():
    delta, valid = ragged([[0.1, 0.5, 0.3, 0.2, 0.4],  # plain top-2: indices 1 and 4
                           [10.0, 10.0, 10.0, 0, 0, 0, 0, 0, 0, 0],  # 3 outliers >= mean+std, K=2
                           [1.0, 1.0, 1.0, 0.0],  # three-way tie, none >= mean + std: lower index wins
                           [0.3, 0.1]], 0.0)  # |M| = K: nothing evicted
    budget = torch.tensor([2, 2, 2, 2])
    got = select_candidates(delta, valid, budget)
    assert got[0, :5].tolist() == [False, True, False, False, True]
    assert got[1].tolist() == [True] * 3 + [False] * 7
    assert got[2, :4].tolist() == [True, True, False, False]
    kept = select_kept(delta, torch.arange(10).expand(4, 10), valid, torch.zeros_like(valid), budget)
    assert kept[3, :2].tolist() == [True, True]


def test_selection_matches_plain_reference_on_random_ragged_rows():
    gen = torch.Generator().manual_seed(1)
    for trial in range(30):
        lengths = torch.randint(0, 12, (5,), generator=gen).tolist()
        rows = [torch.randn(n, generator=gen).tolist() for n in lengths]
        if trial % 3 == 0:  # heavy tails make the variance branch fire
            rows = [[x ** 3 for x in r] for r in rows]
        budgets = torch.randint(1, 6, (5,), generator=gen)
        delta, valid = ragged(rows, 0.0)
        positions = torch.arange(delta.shape[1]).expand_as(delta)
        got = select_kept(delta, positions, valid, torch.zeros_like(valid), budgets)
        for r, row in enumerate(rows):
            want = plain_rules(plain_select(row, int(budgets[r])), list(range(len(row))), [False] * len(row))
            assert got[r, : len(row)].tolist() == want
            assert not got[r, len(row):].any()


def test_structure_rules_on_hand_examples():
    positions, valid = ragged([[5, 6, 8, 9], [5, 7], [1, 2, 3], [4, 5, 6], [10, 11, 12, 13, 14, 15]], -1)
    kept = torch.tensor([[False, True, False, True, False, False],
                         [False, True, False, False, False, False],
                         [False, False, True, False, False, False],
                         [False, False, False, False, False, False],
                         [False, False, False, False, True, False]])
    never = torch.tensor([[False] * 6, [False] * 6, [False] * 6, [True] * 6,
                          [True, True, False, False, False, True]])
    left = keep_left_neighbours(kept, positions, valid)
    assert left[0, :4].tolist() == [True, True, True, True]  # 5 for 6, 8 for 9
    assert left[1, :2].tolist() == [False, True]  # 5 is not 7's neighbour
    assert left[2, :3].tolist() == [False, True, True]  # one pass: 1 is not added for 2
    assert keep_all_if_empty(left, valid)[3, :3].tolist() == [True, True, True]
    got = apply_structure_rules(kept, positions, valid, never)
    # row 4: 14 kept -> 13 (neighbour); 10, 11 never processed and left of 14 -> re-kept;
    # 12 was processed before -> stays evicted; 15 is right of the rightmost kept -> evicted
    assert got[4].tolist() == [True, True, False, True, True, False]
    assert not keep_placeholders(kept, positions, valid, never)[4, 5]


def test_structure_rules_match_plain_reference_on_random_rows():
    gen = torch.Generator().manual_seed(2)
    for _ in range(40):
        rows, keeps, nevers = [], [], []
        for _ in range(4):
            n = int(torch.randint(0, 10, (1,), generator=gen))
            pos = sorted(torch.randperm(16, generator=gen)[:n].tolist())
            rows.append(pos)
            keeps.append((torch.rand(n, generator=gen) < 0.25).tolist())
            nevers.append((torch.rand(n, generator=gen) < 0.5).tolist())
        positions, valid = ragged(rows, -1)
        kept, _ = ragged(keeps, False)
        never, _ = ragged(nevers, False)
        got = apply_structure_rules(kept, positions, valid, never)
        for r in range(4):
            assert got[r, : len(rows[r])].tolist() == plain_rules(keeps[r], rows[r], nevers[r])
            assert not got[r, len(rows[r]):].any()


def test_delayed_cache_ready_needs_the_right_neighbour():
    committed = np.array([True, True, False, True, False, True, True])
    # 0: right neighbour committed; 1: 2 masked; 3: 4 masked; 5: ok; 6: last counts as ready
    assert delayed_cache_ready(committed).tolist() == [True, False, False, False, False, True, True]


def test_never_processed_evicted_slots_are_hidden_from_attention():
    ctx = ForwardContext(positions=torch.tensor([[4, 5, 6, 7]]), token_valid=torch.ones(1, 4, dtype=torch.bool),
                         key_limit=torch.full((1, 4), 8))
    hidden = EvictionHooks.unprocessed_keys(ctx, torch.tensor([[False, False, True, False]]))
    kept = ctx.keep(compact(torch.ones(1, 4, dtype=torch.bool), hidden_keys=hidden))
    assert kept.attn_mask.shape == (1, 1, 4, 8)
    assert kept.attn_mask[0, 0].tolist() == [[True] * 6 + [False, True]] * 4
    assert ctx.attn_mask is None  # the context it came from is unchanged


def test_a_context_is_never_changed_in_place():
    """Hooks return what they keep; ``keep`` makes a new context and the old one stays."""
    ctx = ForwardContext(positions=torch.tensor([[4, 5, 6, 7]]), token_valid=torch.ones(1, 4, dtype=torch.bool))
    with pytest.raises(dataclasses.FrozenInstanceError):
        ctx.positions = torch.tensor([[4]])
    kept = ctx.keep(compact(torch.tensor([[False, True, False, True]])))
    assert kept.positions.tolist() == [[5, 7]] and kept.token_index.tolist() == [[1, 3]]
    assert kept.live_counts() == [2] and ctx.live_counts() == [4]
    assert ctx.positions.tolist() == [[4, 5, 6, 7]] and ctx.token_index.tolist() == [[0, 1, 2, 3]]


# -- the engine -------------------------------------------------------------------------------
def delayed_block_reference(model, prompt, gen_length, block_length, threshold, mask_id, stop_ids):
    """SDAR block decoding with FOCUS's delayed in-block cache and no eviction, written plainly:
    a block position is recomputed each step until it and its right neighbour were committed
    before the step; frozen positions are read from the cache. Returns (tokens, processed)."""
    cfg = model.config
    total = -(-(len(prompt) + gen_length) // block_length) * block_length
    x = torch.tensor(prompt + [mask_id] * (total - len(prompt)))
    cache = KVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, torch.float32, "cpu")
    cache.arrange([0], total)
    final_below, processed = 0, 0
    for lo in range((len(prompt) // block_length) * block_length, total, block_length):
        hi = lo + block_length
        frozen = torch.zeros(block_length, dtype=torch.bool)
        while (x[lo:hi] == mask_id).any():
            pos = torch.cat([torch.arange(final_below, lo), torch.arange(lo, hi)[~frozen]])
            ctx = ForwardContext(positions=pos[None], token_valid=torch.ones(1, len(pos), dtype=torch.bool),
                                 key_limit=((pos // block_length + 1) * block_length)[None], cache=cache)
            with torch.no_grad():
                logits = model.logits(model.forward_context(x[pos][None], ctx))[0]
            processed += len(pos)
            final_below = lo
            done = (x[lo:hi] != mask_id).tolist() + [True]  # past the block counts as committed
            frozen |= torch.tensor([done[j] and done[j + 1] for j in range(block_length)])
            masked = (x[pos] == mask_id)
            logits = logits[masked]
            logits[:, mask_id] = -float("inf")
            conf, x0 = torch.softmax(logits, -1).max(-1)
            chosen = conf >= threshold
            if not chosen.any():
                chosen[conf.argmax()] = True
            x[pos[masked][chosen]] = x0[chosen]
        if any(t in stop_ids for t in x[max(lo, len(prompt)):hi].tolist()):
            break
    out = x[len(prompt):len(prompt) + gen_length].tolist()
    cut = next((i for i, t in enumerate(out) if t in stop_ids), len(out))
    return out[:cut], processed - len(prompt)


@pytest.mark.slow  # over 2 s on 2 busy cores
@pytest.mark.parametrize("threshold", [0.3, 0.9])
def test_eviction_off_equals_plain_delayed_cache_sampler(llms, threshold):
    llm = llms["sdar"]
    ids = llm.token_ids
    params = SamplingParams(method="block+focus", max_new_tokens=24, block_length=8, threshold=threshold,
                            focus_alpha=NO_EVICTION)
    for prompt in PROMPTS:
        want, processed = delayed_block_reference(llm.model, prompt, 24, 8, threshold, ids.mask_id,
                                                  sorted(ids.stop_ids))
        out = llm.generate([prompt], params)[0]
        assert out.token_ids == want
        assert out.stats.processed_tokens == processed


def delayed_dual_cache_reference(model, prompt, gen_length, block_length, threshold, mask_id, stop_ids):
    """Fast-dLLM dual cache with FOCUS's delayed in-block cache and no eviction, written plainly:
    the whole canvas at a block's first step, then the block's positions not yet frozen (Dream:
    plus the token before the block, whose output predicts the block's first slot)."""
    cfg = model.config
    shift = int(cfg.logit_shift)
    x = torch.tensor(prompt + [mask_id] * gen_length)
    n = len(x)
    cache = KVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, torch.float32, "cpu")
    cache.arrange([0], n)
    processed = 0
    for lo in range(len(prompt), n, block_length):
        hi = lo + block_length
        frozen = torch.zeros(block_length, dtype=torch.bool)
        first = True
        while (x[lo:hi] == mask_id).any():
            if first:
                pos = torch.arange(n)
            else:
                pos = torch.cat([torch.arange(lo - shift, lo), torch.arange(lo, hi)[~frozen]])
            first = False
            ctx = ForwardContext(positions=pos[None], token_valid=torch.ones(1, len(pos), dtype=torch.bool),
                                 key_limit=torch.full((1, len(pos)), n), cache=cache)
            with torch.no_grad():
                out = model.logits(model.forward_context(x[pos][None], ctx))[0]
            processed += len(pos)
            done = (x[lo:hi] != mask_id).tolist() + [True]
            frozen |= torch.tensor([done[j] and done[j + 1] for j in range(block_length)])
            where = {p: i for i, p in enumerate(pos.tolist())}
            cand = [p for p in range(lo, hi) if x[p] == mask_id]
            logits = out[[where[p - shift] for p in cand]]
            logits[:, mask_id] = -float("inf")
            conf, x0 = torch.softmax(logits, -1).max(-1)
            chosen = conf >= threshold
            if not chosen.any():
                chosen[conf.argmax()] = True
            x[torch.tensor(cand)[chosen]] = x0[chosen]
    out = x[len(prompt):].tolist()
    cut = next((i for i, t in enumerate(out) if t in stop_ids), len(out))
    return out[:cut], processed - len(prompt)


@pytest.mark.slow  # over 2 s on 2 busy cores
@pytest.mark.parametrize("model_type", ["llada", "Dream"])
def test_dual_cache_eviction_off_equals_plain_delayed_cache_sampler(llms, model_type):
    check_eviction_off_equals_delayed_sampler(llms[model_type], max_new_tokens=24)


def check_eviction_off_equals_delayed_sampler(llm, max_new_tokens: int) -> None:
    """``dual-cache+focus`` that never evicts gives the plain delayed-cache sampler's tokens and
    processed-token count on every prompt (blocks of 8, threshold 0.5). ``stop_at_eos=False``:
    the plain sampler decodes the whole canvas, as Fast-dLLM's does."""
    ids = llm.token_ids
    params = SamplingParams(method="dual-cache+focus", max_new_tokens=max_new_tokens, block_length=8,
                            threshold=0.5, focus_alpha=NO_EVICTION, stop_at_eos=False)
    for prompt in PROMPTS:
        want, processed = delayed_dual_cache_reference(llm.model, prompt, max_new_tokens, 8, 0.5, ids.mask_id,
                                                       sorted(ids.stop_ids))
        out = llm.generate([prompt], params)[0]
        assert (out.token_ids, out.stats.processed_tokens) == (want, processed)


@pytest.mark.slow  # over 2 s on 2 busy cores
def test_delayed_cache_strategy_is_focus_without_eviction(llms):
    """``block+delayed-cache`` (the paper's DC+ ablation) against a plain loop of its rule."""
    llm = llms["sdar"]
    ids = llm.token_ids
    params = SamplingParams(method="block+delayed-cache", max_new_tokens=24, block_length=8, threshold=0.9)
    out = llm.generate(PROMPTS, params)
    for prompt, o in zip(PROMPTS, out):
        want, processed = delayed_block_reference(llm.model, prompt, 24, 8, 0.9, ids.mask_id, sorted(ids.stop_ids))
        assert o.token_ids == want and o.stats.processed_tokens == processed


class RecordingEviction(TokenEviction):
    """TokenEviction that checks, at every commit, that only kept tokens were committed."""

    def __init__(self, model):
        super().__init__(model)
        self.evicted_steps = 0
        self.planned = {}  # sequence -> tokens its plan computes this step

    def plan(self, seq, plan):
        plan = super().plan(seq, plan)
        self.planned[id(seq)] = len(plan)
        return plan

    def after_commit(self, seq, committed):
        state = seq.strategy_state["focus"]
        kept = state.kept_positions()
        if kept is not None:
            assert np.isin(committed, kept).all()  # host positions: the group was decided at once
            self.evicted_steps += int(len(kept) < self.planned[id(seq)])
        super().after_commit(seq, committed)


def run_with(llm, strategy, prompts, params):
    llm.engine.pipelines[params.method] = Pipeline([strategy])
    try:
        return llm.generate(prompts, params)
    finally:
        del llm.engine.pipelines[params.method]


@pytest.mark.slow  # over 2 s on 2 busy cores
@pytest.mark.parametrize("model_type,method", [("sdar", "block+focus"), ("llada", "dual-cache+focus"),
                                               ("Dream", "dual-cache+focus")])
def test_only_kept_tokens_are_committed(llms, model_type, method):
    llm = llms[model_type]
    spy = RecordingEviction(llm.model)
    params = SamplingParams(method=method, max_new_tokens=32, block_length=16, threshold=0.9, stop_at_eos=False)
    out = run_with(llm, spy, PROMPTS, params)
    assert spy.evicted_steps > 0
    assert all(len(o.token_ids) == 32 or o.finish_reason == "stop" for o in out)
    assert all(t != llm.token_ids.mask_id for o in out for t in o.token_ids)


@pytest.mark.slow  # over 2 s on 2 busy cores
def test_eviction_lowers_redundancy_below_block_and_delayed_cache(llms):
    llm = llms["sdar"]
    base = SamplingParams(method="block", max_new_tokens=64, block_length=32, threshold=0.9, stop_at_eos=False)
    block = llm.generate(PROMPTS, base).stats
    delayed = llm.generate(PROMPTS, base.replace(method="block+focus", focus_alpha=NO_EVICTION)).stats
    focus = llm.generate(PROMPTS, base.replace(method="block+focus")).stats
    assert focus.decoded_tokens == block.decoded_tokens
    assert focus.processed_tokens < delayed.processed_tokens < block.processed_tokens
    assert focus.redundancy < block.redundancy


@pytest.mark.slow  # over 2 s on 2 busy cores
@pytest.mark.parametrize("model_type,method", [("sdar", "block+focus"), ("llada", "dual-cache+focus"),
                                               ("Dream", "dual-cache+focus")])
@pytest.mark.parametrize("alpha", [1.0, 1.5])
def test_batch_invariance(llms, model_type, method, alpha):
    llm = llms[model_type]
    params = SamplingParams(method=method, max_new_tokens=32, block_length=16, threshold=0.9, focus_alpha=alpha)
    batched = llm.generate(PROMPTS, params)
    for prompt, out in zip(PROMPTS, batched):
        alone = llm.generate([prompt], params)[0]
        assert alone.token_ids == out.token_ids
        assert alone.stats.processed_tokens == out.stats.processed_tokens


# -- the predictor probe (diagnostic) ---------------------------------------------------------
def test_predictor_counts_on_hand_examples():
    counts = PredictorCounts()
    counts.add(torch.tensor([0.95, 0.5, 0.92, 0.1]), torch.tensor([False, True, True, False]), 0.9)
    counts.add(torch.tensor([0.2, 0.99]), torch.tensor([False, True]), 0.9)
    assert counts.summary() == {"probed_steps": 2, "kept_share": 0.5, "top_kept": 0.5,
                                "top_kept_by_chance": 0.5, "confident_kept": round(2 / 3, 4)}
    assert PredictorCounts().summary()["top_kept"] == 0.0  # nothing probed: no division by zero


class FirstSelection:
    """Mixin: the masked block positions kept at each sequence's first step."""

    def __init__(self, model):
        super().__init__(model)
        self.first = {}

    def after_forward_rows(self, seqs, outputs):
        for seq in seqs:
            self.record_first(seq)
        return super().after_forward_rows(seqs, outputs)

    def record_first(self, seq):
        state = block_state(seq)
        if id(seq) not in self.first:
            if state.would_keep is not None:
                masked, kept = state.would_keep
                self.first[id(seq)] = sorted(masked[kept].tolist())
            elif state.evicted is not None:
                start, end = seq.block
                self.first[id(seq)] = sorted(p for p in state.kept_positions().tolist()
                                             if start <= p < end and seq.undecided[p])


class FirstKept(FirstSelection, TokenEviction):
    pass


class FirstProbed(FirstSelection, PredictorProbe):
    pass


@pytest.mark.slow  # over 2 s on 2 busy cores
@pytest.mark.parametrize("model_type,method", [("sdar", "block+focus"), ("llada", "dual-cache+focus")])
def test_probe_scores_the_selection_focus_makes_but_evicts_nothing(llms, model_type, method):
    llm = llms[model_type]
    params = SamplingParams(method=method, max_new_tokens=32, block_length=16, threshold=0.9, stop_at_eos=False)
    focus, probe = FirstKept(llm.model), FirstProbed(llm.model)
    run_with(llm, focus, PROMPTS, params)
    probed = run_with(llm, probe, PROMPTS, params)
    # the first step has the same inputs under both: the probe saw FOCUS's own selection
    assert sorted(focus.first.values()) == sorted(probe.first.values()) and len(probe.first) == len(PROMPTS)
    # ... and it evicted nothing: the delayed cache's tokens and work
    delayed = llm.generate(PROMPTS, params.replace(method=params.base_method + "+delayed-cache"))
    for a, b in zip(probed, delayed):
        assert a.token_ids == b.token_ids and a.stats.processed_tokens == b.stats.processed_tokens
    d = probed.diagnostics["focus-probe"].summary()
    assert d["probed_steps"] > 0 and 0 < d["kept_share"] < 1


def test_focus_rejects_other_bases_and_small_alpha(llms):
    with pytest.raises(ValueError, match="focus_alpha must be >= 1"):
        SamplingParams(method="block+focus", focus_alpha=0.5)
    with pytest.raises(ValueError, match="strategy 'focus' runs on block, dual-cache, not on 'prefix-cache'"):
        llms["llada"].generate([PROMPTS[0]], SamplingParams(method="prefix-cache+focus"))


def test_block_step_on_a_hand_example():
    """``block_step``: of the computed positions, those in the block, the candidates (undecided
    block positions), the candidates never processed in this block, and the block positions
    whose K/V are final after the step (``delayed_cache_ready`` of the block's committed ones)."""
    from dllm_engine.strategies.focus import block_step
    positions = np.array([3, 4, 5, 6, 7, 8, 9, 10])  # a prefix token, the block [4, 10), one after
    undecided = np.array([False, True, True, False, False, True])
    processed = np.array([True, True, False, False, True, False])
    in_block, candidate, never, ready = block_step(positions, 4, undecided, processed)
    assert in_block.tolist() == [False] + [True] * 6 + [False]
    assert candidate.tolist() == [False, False, True, True, False, False, True, False]
    assert never.tolist() == [False, False, False, True, False, False, True, False]
    assert ready.tolist() == [False, False, False, True, False, False]
