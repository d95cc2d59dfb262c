"""ES-dLLM early skipping (strategies/early_skip.py): selection math, exactness when nothing is
skipped, partial cache update, batch invariance and the work it saves."""
import copy

import numpy as np
import pytest
import torch

from dllm_engine import LLM, SamplingParams
from dllm_engine.resolve import resolve_params
from dllm_engine.decoding.decoders import StepPlan, plan_step
from dllm_engine.strategies import early_skip
from dllm_engine.models.context import compact
from dllm_engine.strategies.early_skip import (SkipHooks, hidden_delta, importance,
                                               kept_count, layer_fractions, prune_layers,
                                               select_kept)
from fixtures import write_checkpoint

PROMPTS = [[42, 13, 14, 15, 16, 17, 18], [20, 21, 22], [30, 31, 32, 33, 34]]
ES = "dual-cache+early-skip"


@pytest.fixture(scope="module")
def llms(tmp_path_factory):
    """3-layer fixtures (prune after layer 1) and 8-layer ones (after layers 1 and 2)."""
    root = tmp_path_factory.mktemp("ckpt")
    out = {}
    for mt in ("llada", "Dream"):
        out[mt] = LLM(write_checkpoint(root / mt, mt))
        out[mt, 8] = LLM(write_checkpoint(root / f"{mt}8", mt, num_layers=8))
    return out


# -- schedule and selection math against plain references ---------------------------------
def test_layer_schedule_follows_the_paper():
    frac = layer_fractions(32, (1.0, 0.5, 0.25), (0.0, 0.125, 0.25))
    assert frac == [1.0] * 4 + [0.5] * 4 + [0.25] * 24  # LLaDA-8B: layers 0-3, 4-7, 8-31
    assert prune_layers(frac) == [4, 8]
    # 3 layers: 0.25 * 3 <= 1, so layer 1 already keeps a quarter
    assert layer_fractions(3, (1.0, 0.5, 0.25), (0.0, 0.125, 0.25)) == [1.0, 0.25, 0.25]
    # a change at the last layer would only drop logits: never pruned there
    assert prune_layers([1.0, 0.5, 0.25]) == [1]
    assert prune_layers([0.5, 0.5, 0.5]) == [0]
    assert prune_layers([1.0, 1.0, 1.0]) == []


def test_kept_count_has_a_progress_floor():
    assert kept_count(0.25, 32, 0) == 8
    assert kept_count(0.25, 32, 1) == 8
    assert kept_count(0.25, 16, 5) == 7  # last step committed 5: keep 5 + 2
    assert kept_count(0.25, 4, 9) == 4  # never more than the block
    assert kept_count(0.5, 7, 0) == 3  # int() rounds down


def reference_delta(h, prev):
    out = torch.zeros(h.shape[:2], dtype=torch.float64)
    for b in range(h.shape[0]):
        for t in range(h.shape[1]):
            x, y = h[b, t].double(), prev[b, t].double()
            out[b, t] = (x - y).abs().sum() / len(x) / ((y @ y / len(y)).sqrt() + 1e-6)
    return out


def reference_scores(conf, delta, cand, bonus, alpha):
    """ES-dLLM importance, one row and one token at a time."""
    scores = torch.full(conf.shape, -float("inf"), dtype=torch.float64)
    for b in range(conf.shape[0]):
        idx = [t for t in range(conf.shape[1]) if cand[b, t]]
        if not idx:
            continue
        top = max(max(float(delta[b, t]) for t in idx), 1.0)  # the official max(row max, 1)
        top2 = sorted(idx, key=lambda t: (-float(conf[b, t]), t))[:2]
        a = float(alpha[b])
        for t in idx:
            s = a * float(conf[b, t]) + (1 - a) * float(delta[b, t]) / top + float(bonus[b, t])
            if a > 0 and t in top2:
                s += 2.0
            scores[b, t] = s
    return scores


def reference_keep(scores, cand, live, counts):
    keep = torch.zeros(cand.shape, dtype=torch.bool)
    for b in range(cand.shape[0]):
        idx = [t for t in range(cand.shape[1]) if cand[b, t]]
        for t in sorted(idx, key=lambda t: (-float(scores[b, t]), t))[: int(counts[b])]:
            keep[b, t] = True
        for t in range(cand.shape[1]):
            keep[b, t] |= bool(live[b, t] and not cand[b, t])
    return keep


@pytest.mark.parametrize("seed", range(4))
def test_scores_and_selection_match_a_plain_reference(seed):
    g = torch.Generator().manual_seed(seed)
    b, t, d = 4, 12, 8
    h, prev = torch.randn(b, t, d, generator=g), torch.randn(b, t, d, generator=g)
    delta = hidden_delta(h, prev)
    assert torch.allclose(delta.double(), reference_delta(h, prev), rtol=1e-5)
    # coarse confidences and repeated deltas make ties common
    conf = torch.randint(0, 4, (b, t), generator=g).float() / 4
    # row maxima above and below 1 (the official rule divides by max(row max, 1))
    delta = torch.randint(1, 4, (b, t), generator=g).float() * torch.tensor([1.0, 0.2, 1.0, 0.1])[:, None]
    live = torch.arange(t)[None] < torch.tensor([12, 10, 12, 7])[:, None]
    cand = live & (torch.rand(b, t, generator=g) < 0.8)
    cand[2] = False  # a row that does not skip this step (refresh)
    bonus = torch.zeros(b, t)
    bonus[0, 3], bonus[1, 5], bonus[3, 2] = 5.0, 3.0, 5.0
    alpha = torch.tensor([0.5, 0.0, 0.5, 1.0])
    got = importance(conf, delta, cand, bonus, alpha)
    want = reference_scores(conf, delta, cand, bonus, alpha)
    assert torch.equal(got == -float("inf"), want == -float("inf"))
    assert torch.allclose(got[cand].double(), want[cand], atol=1e-6)
    counts = torch.tensor([3, 4, 2, 1])
    keep = select_kept(got, cand, live, counts)
    assert torch.equal(keep, reference_keep(want, cand, live, counts))
    assert torch.equal(keep[2], live[2])  # no candidates: everything live goes on


def test_bonuses_and_ties_on_a_hand_example():
    # one row, 6 block tokens; token 0 committed (conf 0), equal deltas everywhere
    conf = torch.tensor([[0.0, 0.2, 0.9, 0.2, 0.9, 0.1]])
    delta = torch.ones(1, 6)
    cand = torch.ones(1, 6, dtype=torch.bool)
    bonus = torch.tensor([[3.0, 5.0, 0, 0, 0, 0]])  # 0 committed last step, 1 leftmost masked
    score = importance(conf, delta, cand, bonus, torch.tensor([0.5]))
    # 0.5 * conf + 0.5 * 1 + bonuses; tokens 2 and 4 are the top-2 confidences (+2)
    assert score.tolist()[0] == pytest.approx([3.5, 5.6, 2.95, 0.6, 2.95, 0.55])
    keep = select_kept(score, cand, cand, torch.tensor([3]))
    assert keep.tolist() == [[True, True, True, False, False, False]]  # tie 2 vs 4: lower index
    keep = select_kept(score, cand, cand, torch.tensor([4]))
    assert keep.tolist() == [[True, True, True, False, True, False]]
    kept = compact(torch.tensor([[False, True, False, True], [True, False, False, False]]))
    assert kept.index.tolist() == [[1, 3], [0, 1]] and kept.valid.tolist() == [[True, True], [True, False]]
    assert kept.lengths == [2, 1]


# -- end to end -----------------------------------------------------------------------------
def tokens(llm, prompts, **kw):
    # stop_at_eos=False: the official ES-dLLM loop decodes the whole canvas
    kw = dict(dict(max_new_tokens=16, block_length=8, stop_at_eos=False), **kw)
    return llm.generate(prompts, SamplingParams(**kw))


@pytest.mark.slow  # over 2 s on 2 busy cores
@pytest.mark.parametrize("model_type", ["llada", "Dream"])
@pytest.mark.parametrize("threshold", [None, 0.5])
def test_keep_fraction_one_equals_dual_cache(llms, model_type, threshold):
    for llm in (llms[model_type], llms[model_type, 8]):
        want = tokens(llm, PROMPTS, method="dual-cache", threshold=threshold)
        got = tokens(llm, PROMPTS, method=ES, threshold=threshold, keep_fractions=(1.0, 1.0, 1.0),
                     skip_block_start="canvas", delay_eos=False)
        assert [o.token_ids for o in got] == [o.token_ids for o in want]
        assert got.stats.processed_tokens == want.stats.processed_tokens


@pytest.mark.slow  # over 2 s on 2 busy cores
@pytest.mark.parametrize("model_type", ["llada", "Dream"])
def test_refresh_every_step(llms, model_type):
    """block_refresh=1 with canvas block starts: nothing is ever skipped (= dual-cache);
    prompt_refresh=1: every step after the first recomputes [0, block end) (the official refresh)."""
    llm = llms[model_type, 8]
    dual = tokens(llm, PROMPTS, method="dual-cache")
    got = tokens(llm, PROMPTS, method=ES, block_refresh=1, skip_block_start="canvas", delay_eos=False)
    assert [o.token_ids for o in got] == [o.token_ids for o in dual]
    got = tokens(llm, PROMPTS, method=ES, prompt_refresh=1)
    # 16 one-token steps over two blocks of 8: the full first forward, 7 x [0, P + 8), 8 x [0, P + 16)
    want = sum(16 + 7 * (len(p) + 8) + 8 * (len(p) + 16) for p in PROMPTS)
    assert got.stats.nfe == 16 * len(PROMPTS) and got.stats.processed_tokens == want


@pytest.mark.slow  # over 2 s on 2 busy cores
@pytest.mark.parametrize("model_type", ["llada", "Dream"])
def test_block_start_forwards_from_the_last_commits(llms, model_type, monkeypatch):
    """Without refresh_blocks (the reference's policy) a block's first step is no cache rebuild:
    it computes from the leftmost position committed at the previous step (whose K/V were
    computed while it was masked) to the block end, against the cache."""
    llm = llms[model_type, 8]
    shift = 1 if model_type == "Dream" else 0
    seen = []
    original = early_skip.EarlySkip.plan_rows

    def spy(self, seqs, plans):
        lasts = [early_skip.state(seq).last_committed.copy() for seq in seqs]
        out = original(self, seqs, plans)
        for seq, last, plan in zip(seqs, lasts, out):
            seen.append((seq.block_idx, seq.step, last, plan.positions.clone(), seq.block))
        return out

    monkeypatch.setattr(early_skip.EarlySkip, "plan_rows", spy)
    kw = dict(max_new_tokens=24, block_length=8, keep_fractions=(1.0,), skip_depths=(0.0,),
              stop_at_eos=False)
    got = tokens(llm, [PROMPTS[0]], method=ES, skip_block_start="last-commits", **kw)[0]
    starts = [s for s in seen if s[1] == 0]
    assert [s[0] for s in starts] == [0, 1, 2]
    assert starts[0][3].tolist() == list(range(len(PROMPTS[0]) + 24))  # the first forward: all
    for _, _, last, positions, (start, end) in starts[1:]:
        assert last.size and int(last.max()) < start  # committed in the previous block
        lo = min(int(last.min()), start - shift)
        assert positions.tolist() == list(range(lo, end))
    dual = tokens(llm, [PROMPTS[0]], method="dual-cache", **kw)[0]
    assert got.stats.processed_tokens < dual.stats.processed_tokens
    assert got.stats.nfe == dual.stats.nfe


def test_skipping_changes_the_work_and_is_exercised(llms):
    llm = llms["llada", 8]
    dual = tokens(llm, PROMPTS, method="dual-cache")
    got = tokens(llm, PROMPTS, method=ES)
    assert got.stats.processed_tokens < dual.stats.processed_tokens
    assert got.stats.nfe == dual.stats.nfe  # one token per step either way (fixed steps)


@pytest.mark.slow  # over 2 s on 2 busy cores
@pytest.mark.parametrize("model_type", ["llada", "Dream"])
def test_processed_tokens_on_a_long_block(llms, model_type):
    """Block 32, one commit per step: at least 3 tokens go on. 8 layers, p = (1, .5, .25) at
    depths (0, 1, 2): layers 0-1 run the block, layer 2 half of it, layers 3-7 a quarter."""
    llm = llms[model_type, 8]
    prompt = PROMPTS[0]
    canvas, extra = len(prompt) + 64, (1 if model_type == "Dream" else 0)  # Dream: token before block
    kw = dict(max_new_tokens=64, block_length=32)
    dual = tokens(llm, [prompt], method="dual-cache", **kw)[0].stats
    got = tokens(llm, [prompt], method=ES, skip_block_start="canvas", **kw)[0].stats
    per_step = (2 * 32 + 16 + 5 * 8) / 8 + extra
    assert dual.processed_tokens == 2 * (canvas + 31 * (32 + extra)) - len(prompt)
    assert got.processed_tokens == pytest.approx(2 * (canvas + 31 * per_step) - len(prompt))
    assert got.processed_tokens < 0.55 * dual.processed_tokens


def test_refresh_counts_steps_across_the_generation(llms):
    """Two blocks of 8 steps = 16 forwards, counted 0..15 (block_idx * 8 + step, as the official
    code counts); full-canvas forwards at 0 and 8 (block starts)."""
    llm = llms["llada", 8]
    prompt = PROMPTS[1]
    canvas = len(prompt) + 16
    skipped = (8 + 8 + 4 + 5 * 3) / 8  # block 8: max(int(p * 8), 3) -> 8, 8, 4, 3 x 5
    full, block, base = canvas, 8, -len(prompt)
    # prompt_refresh 3: [0, block end) at 3, 6 (block 0: P + 8) and 9, 12, 15 (block 1: the whole
    # canvas), full canvas at 0 and 8 -> 5 full, 2 x (P + 8), 9 skipped
    got = tokens(llm, [prompt], method=ES, prompt_refresh=3, skip_block_start="canvas")[0].stats
    assert got.processed_tokens == pytest.approx(base + 5 * full + 2 * (len(prompt) + 8) + 9 * skipped)
    # block_refresh 3: full at 0 and 8; block-only unskipped at 3, 6, 9, 12, 15; 9 skipped
    got = tokens(llm, [prompt], method=ES, block_refresh=3, skip_block_start="canvas")[0].stats
    assert got.processed_tokens == pytest.approx(base + 2 * full + 5 * block + 9 * skipped)


@pytest.mark.slow  # over 2 s on 2 busy cores
@pytest.mark.parametrize("model_type", ["llada", "Dream"])
@pytest.mark.parametrize("threshold", [None, 0.5])
def test_batch_invariance(llms, model_type, threshold):
    llm = llms[model_type, 8]
    params = dict(method=ES, threshold=threshold)
    batched = tokens(llm, PROMPTS, **params)
    for prompt, out in zip(PROMPTS, batched):
        alone = tokens(llm, [prompt], **params)[0]
        assert alone.token_ids == out.token_ids
        assert alone.stats.processed_tokens == out.stats.processed_tokens


@pytest.mark.slow  # over 2 s on 2 busy cores
def test_mixed_schedules_in_one_batch(llms):
    """Sequences with different options share one forward, each with its own kept set."""
    llm = llms["llada", 8]
    eng = llm.engine
    a = llm.make_sequence(PROMPTS[0], SamplingParams(method=ES, max_new_tokens=16, block_length=8,
                                                     stop_at_eos=False))
    b = llm.make_sequence(PROMPTS[1], SamplingParams(method=ES, max_new_tokens=16, block_length=8,
                                                     keep_fractions=(1.0,), skip_depths=(0.0,),
                                                     skip_block_start="canvas", delay_eos=False,
                                                     stop_at_eos=False))
    c = llm.make_sequence(PROMPTS[2], SamplingParams(method=ES, max_new_tokens=16, block_length=4,
                                                     skip_alpha=0.2, stop_at_eos=False))
    for s in (a, b, c):
        eng.add(s)
    while eng.has_work():
        eng.step()
    alone = tokens(llm, [PROMPTS[1]], method="dual-cache")[0]
    assert b.output_ids() == alone.token_ids  # b never skips even when batched with a
    assert a.output_ids() == tokens(llm, [PROMPTS[0]], method=ES)[0].token_ids
    alone = tokens(llm, [PROMPTS[2]], method=ES, block_length=4, skip_alpha=0.2)[0]
    assert c.output_ids() == alone.token_ids and c.stats.processed_tokens == alone.stats.processed_tokens


# -- partial cache update ----------------------------------------------------------------------
def one_step(llm, seq, saved_state, cache):
    """One forward of ``seq`` (no commit) from a saved strategy state, on ``cache``."""
    seq.strategy_state = copy.deepcopy(saved_state)
    pipe = llm.engine.pipeline(seq.params.method)
    plans = [pipe.plan(seq, plan_step(seq, llm.engine.runner.shift))]
    hooks = pipe.layer_hooks([seq], plans)
    return llm.engine.runner.forward([seq], plans, cache.view(0, 1), hooks)[0]


def test_skipped_positions_keep_their_kv_and_stay_attended(llms):
    llm = llms["llada", 8]
    params = SamplingParams(method=ES, max_new_tokens=16, block_length=16)
    seq = llm.make_sequence(PROMPTS[0], params)
    llm.engine.add(seq)
    for _ in range(3):  # a full forward, then two skipping steps
        llm.engine.step()
    assert seq.step == 3 and len(llm.engine.running) == 1
    before = copy.deepcopy(llm.engine.caches[llm.engine.group_of[seq.seq_id]])
    saved = copy.deepcopy(seq.strategy_state)
    wanted = plan_step(seq, 0).logit_positions

    cache_a = copy.deepcopy(before)
    pos_a, logits_a = one_step(llm, seq, saved, cache_a)
    skipped = wanted[~torch.isin(wanted, pos_a)]
    assert skipped.numel() >= 8 and pos_a.numel() >= 3  # 16-token block, 3 go on to the end
    start, end = seq.block
    for layer in range(8):
        k_new, k_old = cache_a.k[layer][0], before.k[layer][0]
        if layer == 1:  # computed for the whole block before the first prune
            assert not torch.allclose(k_new[:, start + 1:end], k_old[:, start + 1:end])
        if layer >= 3:  # after both prunes: skipped positions keep their K/V, survivors change
            assert torch.equal(k_new[:, skipped], k_old[:, skipped])
            assert torch.equal(cache_a.v[layer][0][:, skipped], before.v[layer][0][:, skipped])
            assert not torch.allclose(k_new[:, pos_a], k_old[:, pos_a])
        # outside the block nothing is ever written on a normal step
        assert torch.equal(k_new[:, :start], k_old[:, :start])
        assert torch.equal(k_new[:, end:], k_old[:, end:])

    # the hidden-state cache of the last prune layer is updated for the survivors only
    lo = early_skip.state(seq).window_lo
    # (held as the step's pending update, applied after its commit so a replay sees the old ones)
    (h_new, row), (h_old, old_row) = early_skip.state(seq).pending[2], saved[early_skip.KEY].hidden[2]
    h_new, h_old = h_new[row], h_old[old_row]
    assert torch.equal(early_skip.state(seq).hidden[2][0][old_row], h_old)
    assert torch.equal(h_new[skipped - lo], h_old[skipped - lo])
    assert not torch.allclose(h_new[pos_a - lo], h_old[pos_a - lo])

    # the survivors attend to the skipped positions' cached K/V: perturb them, outputs change
    cache_b = copy.deepcopy(before)
    for layer in range(3, 8):
        cache_b.k[layer][0][:, skipped] += 1.0
        cache_b.v[layer][0][:, skipped] += 1.0
    pos_b, logits_b = one_step(llm, seq, saved, cache_b)
    assert torch.equal(pos_b, pos_a)  # same kept set (chosen at layers 1-2)
    assert not torch.allclose(logits_b, logits_a)
    seq.strategy_state = saved
    llm.engine.cancel(seq.seq_id)


@pytest.mark.slow  # over 2 s on 2 busy cores
def test_each_row_keeps_its_own_set_and_dream_keeps_the_token_before_the_block(llms, monkeypatch):
    llm = llms["Dream", 8]
    seen = []
    original = SkipHooks.after_layer

    def spy(self, layer, hidden, ctx):
        out = original(self, layer, hidden, ctx)
        if out is not None:
            for b, seq in enumerate(self.seqs):
                if not early_skip.state(seq).skip:  # a block's first step: computed in full
                    continue
                slots = ctx.gather(ctx.slots, out[0])[b][out[1][b]]
                live = ctx.slots[b][ctx.token_valid[b]]
                seen.append((layer, seq.block, live.tolist(), slots.tolist(),
                             len(early_skip.state(seq).last_committed)))
        return out

    monkeypatch.setattr(SkipHooks, "after_layer", spy)
    tokens(llm, PROMPTS, method=ES, max_new_tokens=32, block_length=16, threshold=0.5)
    assert {layer for layer, *_ in seen} == {1, 2}
    for layer, (start, end), live, kept, last in seen:
        assert start - 1 in kept  # it gives the first block position's logits
        count = kept_count(0.5 if layer == 1 else 0.25, 16, last)
        block_live = [p for p in live if start <= p < end]
        assert len([p for p in kept if start <= p < end]) == min(count, len(block_live))


@pytest.mark.parametrize("model_type", ["llada", "Dream"])
@pytest.mark.parametrize("alpha", [0.5, 1.0])
def test_per_token_inputs_follow_the_predicted_position(llms, model_type, alpha):
    """conf_prev and the leftmost-masked bonus follow the position a token predicts (Dream: the
    next one); +3 goes to the token committed last step (only when alpha < 1); Dream's token
    before the block is not a candidate."""
    llm = llms[model_type]
    shift = llm.model.config.logit_shift
    seq = llm.make_sequence(PROMPTS[1], SamplingParams(method=ES, max_new_tokens=16, block_length=8,
                                                       skip_alpha=alpha))
    strategy = llm.engine.pipeline(ES).strategies[0]
    strategy.setup(seq)
    start, end = seq.block
    seq.fill(slice(start, start + 2), 7)  # committed: the leftmost masked position is start + 2
    seq.step = 1
    st = early_skip.state(seq)
    st.conf[:] = np.arange(seq.canvas_len) / 100
    st.conf[start:start + 2] = 0.0
    st.last_committed = np.array([start + 1])
    plan = strategy.plan(seq, plan_step(seq, shift))
    assert st.skip
    longer = StepPlan(torch.arange(start - shift, end + 2), torch.full((end + 2 - start + shift,), 99),
                      plan.logit_positions, host_positions=np.arange(start - shift, end + 2))
    got = {k: v[0] for k, v in strategy.row_values([seq, seq], [plan, longer])[0].items()}  # padded row
    pos = plan.positions.tolist()
    assert pos == list(range(start - shift, end))
    assert got["candidate"].tolist() == [start <= p < end for p in pos] + [False, False]
    assert got["conf"].tolist() == pytest.approx([float(st.conf[p + shift]) for p in pos] + [0, 0])
    bonus = [5.0 * (p + shift == start + 2) + 3.0 * (p == start + 1 and alpha < 1) for p in pos]
    assert got["bonus"].tolist() == bonus + [0, 0]


@pytest.mark.parametrize("model_type", ["llada", "Dream"])
def test_row_values_of_a_group_equal_each_sequence_alone(llms, model_type):
    """The batched per-token inputs of a mixed group (other blocks, steps, alphas, commits; some
    rows not skipping) equal, row by row, what each sequence gets alone."""
    llm = llms[model_type]
    shift = llm.model.config.logit_shift
    strategy = llm.engine.pipeline(ES).strategies[0]
    seqs, plans = [], []
    for i, (prompt, block, alpha) in enumerate([(PROMPTS[0], 8, 0.5), (PROMPTS[1], 4, 1.0),
                                                (PROMPTS[2], 8, 0.2), (PROMPTS[1], 8, 0.5)]):
        seq = llm.make_sequence(prompt, SamplingParams(method=ES, max_new_tokens=16, block_length=block,
                                                       skip_alpha=alpha))
        strategy.setup(seq)
        start, end = seq.block
        seq.fill(slice(start, start + i), 7)  # the first i block positions committed
        seq.step = 0 if i == 3 else 1  # the last one is at a block start: no skipping
        st = early_skip.state(seq)
        st.conf[:] = np.random.default_rng(i).random(seq.canvas_len)
        st.last_committed = np.array([start + i - 1] if i else [], dtype=np.int64)
        seqs.append(seq)
        plans.append(strategy.plan(seq, plan_step(seq, shift)))
    together = strategy.row_values(seqs, plans)[0]
    for i, (seq, plan) in enumerate(zip(seqs, plans)):
        alone = strategy.row_values([seq], [plan])[0]
        t = len(plan)
        for key in ("candidate", "conf", "bonus"):
            assert torch.equal(together[key][i, :t], alone[key][0])
            assert not together[key][i, t:].any()


# -- the official defaults -------------------------------------------------------------------
def test_delay_eos_follows_the_official_rule():
    """An EOS predicted while its left in-block neighbour is masked and no EOS is committed yet
    gets confidence 0 (the official delay_eos_generation), for the commit rule and the skip score."""
    from dllm_engine.engine.sequence import Sequence, TokenIds
    ids = TokenIds(mask_id=4, eos_id=3, stop_ids=frozenset({3}))
    params = SamplingParams(method=ES, max_new_tokens=16, block_length=8)
    p = resolve_params(params, ("dual-cache",))
    seq = Sequence(0, [10, 11, 12], p, ids)  # block [3, 11)
    seq.fill(5, 20)  # committed: left neighbour of 6
    positions = torch.tensor([3, 4, 6, 7, 8])
    eos = torch.full((5,), 3)
    # 3: left is the prompt; 4: left (3) masked; 6: left (5) committed; 7: left (6) masked
    assert early_skip.delayed_eos(seq, positions, eos).tolist() == [False, True, False, True, True]
    assert not early_skip.delayed_eos(seq, positions, torch.full((5,), 9)).any()  # not an EOS
    seq.fill(9, 3)  # an EOS exists: nothing is delayed any more
    assert not early_skip.delayed_eos(seq, positions, eos).any()
    seq.fill(9, 4)
    seq.params = seq.params.replace(delay_eos=False)
    assert not early_skip.delayed_eos(seq, positions, eos).any()


def test_delay_eos_of_a_group_equals_each_sequence_alone():
    """``delayed_eos_flat`` over a mixed group (prompts, blocks, an EOS committed, the option off,
    ragged candidates laid out row after row) gives each sequence what ``delayed_eos`` gives it
    alone."""
    from dllm_engine.engine.sequence import Sequence, TokenIds
    ids = TokenIds(mask_id=4, eos_id=3, stop_ids=frozenset({3}))
    p = resolve_params(SamplingParams(method=ES, max_new_tokens=16, block_length=8), ("dual-cache",))
    seqs = [Sequence(i, prompt, p, ids) for i, prompt in enumerate([[10, 11, 12], [10] * 6, [10, 11], [10] * 5])]
    seqs[0].fill(5, 20)
    seqs[1].fill(12, 3)  # an EOS committed
    seqs[2].params = seqs[2].params.replace(delay_eos=False)
    seqs[3].block_idx = 1  # the second block
    positions = [torch.tensor([3, 4, 6, 7, 8]), torch.tensor([6, 7, 8]), torch.tensor([2, 3, 4, 5]),
                 torch.tensor([13, 14, 15, 16, 17, 18, 19, 20])]
    tokens = [torch.tensor([3, 3, 3, 9, 3]), torch.full((3,), 3), torch.full((4,), 3), torch.full((8,), 3)]
    counts = [len(pos) for pos in positions]
    flat = early_skip.delayed_eos_flat(seqs, counts, torch.cat(positions), torch.cat(tokens))
    together = flat.split(counts)
    for seq, pos, tok, got in zip(seqs, positions, tokens, together):
        assert torch.equal(got, early_skip.delayed_eos(seq, pos, tok))
    assert together[0].tolist() == [False, True, False, False, True]
    assert not together[1].any() and not together[2].any() and together[3].any()


@pytest.mark.parametrize("model_type", ["llada", "Dream"])
def test_block_starts_recompute_the_prefix_by_default(llms, model_type, monkeypatch):
    """The official schedule: every block start recomputes [0, block end) without skipping."""
    llm = llms[model_type, 8]
    seen = []
    original = early_skip.EarlySkip.plan_rows

    def spy(self, seqs, plans):
        out = original(self, seqs, plans)
        for seq, plan in zip(seqs, out):
            seen.append((seq.block_idx, seq.step, plan.positions.tolist(), seq.block, early_skip.state(seq).skip))
        return out

    monkeypatch.setattr(early_skip.EarlySkip, "plan_rows", spy)
    tokens(llm, [PROMPTS[0]], method=ES, max_new_tokens=24, block_length=8)
    starts = [s for s in seen if s[1] == 0]
    assert [s[0] for s in starts] == [0, 1, 2]
    assert starts[0][2] == list(range(len(PROMPTS[0]) + 24))  # the first forward: the canvas
    for _, _, positions, (start, end), skip in starts[1:]:
        assert positions == list(range(end)) and not skip
    assert any(s[4] for s in seen if s[1] > 0)  # later steps do skip
