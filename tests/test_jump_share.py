"""ODB-dLLM jump-share speculative decoding (strategies/jump_share.py)."""
import numpy as np
import pytest
import torch

from dllm_engine import LLM, SamplingParams
from dllm_engine.decoding.commit_rules import GroupCommit
from dllm_engine.decoding.noise import Noise
from dllm_engine.decoding.decoders import plan_step, plan_steps
from dllm_engine.engine.sequence import Sequence, TokenIds
from dllm_engine.methods import FULL_ATTENTION_METHODS
from dllm_engine.resolve import resolve_params
from dllm_engine.strategies.jump_share import (JumpShare, accepted_copy, copy_key_mask, copy_predictions,
                                               draft_sets, make_layout, num_copies, share_plan,
                                               switches_to_eight)
from fixtures import write_checkpoint

PROMPTS = [[42, 13, 14, 15, 16, 17, 18], [20, 21, 22], [30, 31, 32, 33, 34]]
IDS = TokenIds(mask_id=4, eos_id=3, stop_ids=frozenset({3}))


@pytest.fixture(scope="module")
def llms(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    return {mt: LLM(write_checkpoint(root / mt, mt)) for mt in ("llada", "Dream")}


def test_copy_sets_and_copy_count_rule():
    assert draft_sets(0) == [()]
    assert draft_sets(1) == [(), (0,)]
    assert draft_sets(2) == [(), (0,), (1,), (0, 1)]
    assert draft_sets(4) == [(), (0,), (1,), (0, 1), (2,), (0, 1, 2), (3,), (0, 1, 2, 3)]
    # block 32: 8 copies once 32 + 3 n <= 89.6, i.e. n <= 19
    assert num_copies(8, 19, 32) == 8 and num_copies(8, 20, 32) == 4
    assert num_copies(8, 3, 32, first=True) == 4  # a block's first speculative step: 4 (official)
    assert num_copies(4, 3, 32) == 4 and num_copies(1, 3, 32) == 1 and num_copies(2, 30, 32) == 2


@pytest.mark.parametrize("step,masks,drafts,want", [
    (1, 3, 2, False),  # never after the block's first speculative step
    (2, 20, 2, True), (2, 21, 2, False),  # 32 + 3·20 = 92 <= 92 (both drafts accepted)
    (2, 19, 1, True), (2, 20, 1, False),  # 89 (one draft)
    (3, 18, 0, True), (3, 19, 0, False),  # 86 (copy 0)
])
def test_the_official_switch_reads_the_step_that_ran_and_what_it_accepted(step, masks, drafts, want):
    """After a 4-copy step t >= 2 of a block of 32: 8 copies once 32 + 3·(masks step t computed)
    <= 92, 89 or 86 as the accepted copy held 2, 1 or 0 drafts."""
    seq = make_seq(block=32, max_new=32, max_copies=8)
    seq.step = step
    masked = np.arange(3, 3 + masks)
    layout = make_layout(seq, masked, (masked[:2], np.array([50, 51]), np.array([0.9, 0.8], dtype=np.float32)), 4)
    best = {0: 0, 1: 1, 2: 3}[drafts]
    assert switches_to_eight(seq, layout, best) is want
    for other in (dict(max_copies=4), dict(jump_share_switch="current")):
        seq.params = seq.params.replace(**other)
        assert not switches_to_eight(seq, layout, best)


def test_copy_key_mask_isolates_copies():
    """Canvas of 10, block [4, 8) with masks at 5 and 7, two extra copies in slots 10-13."""
    masked = np.array([5, 7])
    base_limit = np.full(4, 10)
    mask = copy_key_mask(base_limit, 10, masked, extra=2)
    assert mask.shape == (4 + 2 * 2, 10 + 2 * 2)
    want = np.zeros((8, 14), dtype=bool)
    want[:4, :10] = True  # base tokens: the canvas, as the base plan's key limits say
    for row, copy in ((4, 0), (5, 0), (6, 1), (7, 1)):
        for key in range(10):
            want[row, key] = key not in (5, 7)  # cache, suffix and shared committed tokens
        own = 10 + 2 * copy
        want[row, own:own + 2] = True  # its own copy only
    assert np.array_equal(mask, want)


def verify(js, seq, positions, logits):
    """A speculative step of ``seq`` alone: its decision (which must not fall back to the base
    rule), applied as at its turn; returns the committed positions."""
    def no_base_rule(seqs, *args):
        assert not seqs, "a verifying step must not fall back to the base rule"
        return GroupCommit(seqs, *args, accounted=False)

    (decision,) = js.decide_rows([seq], [positions], [logits], no_base_rule)
    decision.apply(seq)
    return decision.positions


def make_seq(block=4, max_new=8, **options):
    options = {"threshold": 0.5, **options}
    params = SamplingParams(method="dual-cache+jump-share", max_new_tokens=max_new, block_length=block,
                            steps=block, **options)
    return Sequence(0, [10, 11, 12], resolve_params(params, FULL_ATTENTION_METHODS), IDS)


def test_share_plan_lays_out_shared_and_copied_tokens():
    seq = make_seq(max_copies=4)  # canvas 11, block [3, 7)
    seq.fill(4, 20)  # committed: shared by all copies
    seq.step = 1
    drafts = (np.array([6, 4, 3, 5]), np.array([61, 99, 63, 65]), np.array([0.9, 0.8, 0.7, 0.6], dtype=np.float32))
    base = plan_steps([seq], 0)[0]
    layout = make_layout(seq, base.host_logits, drafts, 4)
    # position 4 is committed now, so the drafts are 6 then 3; copies: (), {6}, {3}, {6, 3}
    assert layout.masked.tolist() == [3, 5, 6]
    assert layout.draft_idx.tolist() == [2, 0] and layout.draft_tokens.tolist() == [61, 63]
    plan = share_plan(seq, base, layout, 0)
    assert plan.positions.tolist() == [3, 4, 5, 6] + [3, 5, 6] * 3
    assert plan.slots.tolist() == [3, 4, 5, 6] + list(range(11, 20))
    m = IDS.mask_id
    assert plan.token_ids.tolist() == [m, 20, m, m] + [m, m, 61] + [63, m, m] + [63, m, 61]
    # logits: copy 0's masks, then each copy's undrafted positions, read at the copy's slots
    assert plan.logit_positions.tolist() == [3, 5, 6] + [3, 5] + [5, 6] + [5]
    assert plan.logit_slots.tolist() == [3, 5, 6] + [11, 12] + [15, 16] + [18]
    assert plan.key_mask.shape == (13, 20)
    assert plan.key_mask[4, 4] and not plan.key_mask[4, 5] and not plan.key_mask[4, 14]


def hand_example(case: str):
    """Copies (), {d0}, {d1}, {d0, d1} over masked positions 0..3; d0 at 1 (token 7), d1 at 3 (8)."""
    draft_idx, draft_tokens = torch.tensor([1, 3]), torch.tensor([7, 8])
    x0 = torch.tensor([[5, 7, 6, 8],  # copy 0 predicts both drafts' tokens
                       [5, -1, 6, 8],
                       [5, 7, 6, -1],
                       [5, -1, 6, -1]])
    commit = torch.zeros(4, 4, dtype=torch.bool)
    if case == "base commits d0":
        commit[0, 1] = True
    elif case == "base commits both":
        commit[0, [1, 3]] = True
    elif case == "jump via d0":  # base commits d0; the copy holding d0 commits d1
        commit[0, 1] = True
        commit[1, 3] = True
    elif case == "d1 only":
        commit[0, 3] = True
    elif case == "unverified chain":  # copy {d0} commits d1, but nobody verified d0
        commit[1, 3] = True
    elif case == "wrong token":
        commit[0, 1] = True
        x0[0, 1] = 9
    return draft_idx, draft_tokens, x0, commit


@pytest.mark.parametrize("case,want", [("nothing", 0), ("base commits d0", 1), ("d1 only", 2),
                                       ("base commits both", 3), ("jump via d0", 3),
                                       ("unverified chain", 0), ("wrong token", 0)])
def test_acceptance_rule_on_hand_built_predictions(case, want):
    assert accepted_copy(*hand_example(case)) == want


def four_drafts(verified: dict[int, list[int]], quirk: bool = False):
    """8 copies over masked positions 0..5, drafts d1..d4 at 0..3 with tokens 10..13; copy c
    commits draft j (0-based) with its token for each j in ``verified[c]``."""
    draft_idx, draft_tokens = torch.tensor([0, 1, 2, 3]), torch.tensor([10, 11, 12, 13])
    x0 = torch.full((8, 6), 99)
    commit = torch.zeros(8, 6, dtype=torch.bool)
    for copy, drafts in verified.items():
        for j in drafts:
            x0[copy, j], commit[copy, j] = 10 + j, True
    if quirk:  # copy {d4} commits d3's slot with the token copy {d3} predicts at d1's
        x0[6, 2], commit[6, 2], x0[4, 0] = 42, True, 42
    return draft_idx, draft_tokens, x0, commit


@pytest.mark.parametrize("verified,quirk,want", [
    ({0: [0, 1, 2, 3]}, False, 7),  # copy 0 confirms all four
    ({0: [0, 2]}, False, 1),  # d1 and d3 alone: {d1}, the earlier singleton
    ({0: [0, 2], 1: [1]}, False, 5),  # {d1, d2} (d2 by copy {d1}) and {d3} (by copy 0) combine
    ({0: [2], 4: [0, 1]}, False, 5),  # copy {d3} confirms d1 and d2
    ({0: [0], 1: [1], 2: [2]}, False, 5),  # {d1, d2} accepted, copy {d2} confirms d3
    ({0: [0, 3], 1: [1]}, False, 3),  # d4 needs {d1, d2, d3} first
    ({0: [0, 1, 3], 1: [1], 3: [2]}, False, 7),  # a4 with {d1, d2, d3} (d3 by copy {d1, d2})
    ({0: [0, 1, 3], 3: [2]}, False, 3),  # the same, but {d1, d2} by copy 0 alone: not a12
    ({0: [3], 6: [0, 1, 2]}, False, 7),  # copy {d4} confirms the other three
    ({0: [0, 1, 2], 1: [1], 5: [3]}, False, 7),  # copy {d1, d2, d3} confirms d4
    ({0: [0, 1, 2], 5: [3]}, False, 5),  # the same, but a1 a2 a3 alone do not set a123
    ({0: [0, 1, 3], 1: [1]}, True, 7),  # the official comparison across two positions
    ({0: [0, 1, 3], 1: [1]}, False, 3),
])
def test_four_drafts_follow_the_official_acceptance(verified, quirk, want):
    assert accepted_copy(*four_drafts(verified, quirk)) == want


def test_accepted_copy_applies_its_drafts_and_its_own_commits(llms):
    seq = make_seq(max_copies=4)
    seq.step = 1
    js = JumpShare(llms["llada"].model)
    js.setup(seq)
    layout = make_layout(seq, seq.masked_index(), (np.array([4, 6]), np.array([7, 8]),
                                                   np.array([0.9, 0.8], dtype=np.float32)), 4)
    seq.strategy_state["jump-share"]["layout"] = layout
    # 4 copies over masked 3..6: d0 = position 4 (token 7), d1 = position 6 (token 8)
    logits = torch.full((4 + 3 + 3 + 2, 96), -1.0)  # a 1.0 logit is ~0.07, a 9.0 logit ~0.996
    rows = {0: [(3, 30, 1.0), (4, 7, 9.0), (5, 31, 1.0), (6, 8, 1.0)],  # base commits d0 only
            1: [(3, 32, 1.0), (5, 33, 1.0), (6, 8, 9.0)],  # copy {d0} commits d1: the jump
            2: [(3, 34, 1.0), (4, 35, 1.0), (5, 36, 1.0)],
            3: [(3, 37, 9.0), (5, 38, 1.0)]}  # copy {d0, d1} commits position 3
    r = 0
    for copy in range(4):
        for _, tok, value in rows[copy]:
            logits[r, tok] = value
            r += 1
    positions = torch.from_numpy(np.concatenate([layout.masked[~layout.drafted[c]] for c in range(4)]))
    committed = verify(js, seq, positions, logits)
    # copy 3 = {d0, d1} is accepted (d0 by copy 0, d1 by copy {d0}); its own commit (3 -> 37) too
    assert sorted(committed.tolist()) == [3, 4, 6]
    assert seq.canvas[3:7].tolist() == [37, 7, IDS.mask_id, 8]
    assert seq.stats.decoded_tokens == 3 and seq.step == 1  # the engine advances after after_commit
    pos, tok, _ = seq.strategy_state["jump-share"]["drafts"]
    assert pos.tolist() == [5] and tok.tolist() == [38]


@pytest.mark.parametrize("method", ["prefix-cache", "dual-cache"])
@pytest.mark.parametrize("threshold", [None, 0.2, 0.9])
def test_one_copy_gives_the_base_decoders_tokens(llms, method, threshold):
    llm = llms["llada"]
    base = SamplingParams(method=method, max_new_tokens=16, block_length=8, threshold=threshold,
                          stop_at_eos=False)
    want = llm.generate(PROMPTS, base)
    got = llm.generate(PROMPTS, base.replace(method=method + "+jump-share", max_copies=1))
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [o.stats.nfe for o in got] == [o.stats.nfe for o in want]


@pytest.mark.parametrize("method", ["prefix-cache", "dual-cache"])
def test_copies_do_not_change_the_base_copy(llms, method):
    """Copy 0's logits in the shared forward equal the base decoder's step logits."""
    llm = llms["llada"]
    engine = llm.engine
    seq = llm.make_sequence(PROMPTS[0], SamplingParams(method=method + "+jump-share", max_new_tokens=16,
                                                       block_length=8, threshold=0.9, max_copies=8))
    engine.add(seq)
    engine.step()  # the block's full first step keeps the drafts
    pipeline = engine.pipeline(seq.params.method)
    cache = engine.caches[engine.group_of[seq.seq_id]].view(0, 1)
    plan = pipeline.plan(seq, plan_step(seq, 0))
    layout = seq.strategy_state["jump-share"]["layout"]
    # 7 masks left in a block of 8: 8 + 3·7 > 2.8·8, so 4 copies over 2 drafts
    assert layout.num_copies == 4 and len(layout.draft_idx) == 2
    with torch.inference_mode():  # as Engine.step
        (pos_js, logits_js), = engine.runner.forward([seq], [plan], cache)
        (pos_base, logits_base), = engine.runner.forward([seq], [plan_step(seq, 0)], cache)
    n = len(layout.masked)
    assert torch.equal(pos_js[:n], pos_base)
    torch.testing.assert_close(logits_js[:n], logits_base, atol=1e-5, rtol=1e-5)
    # the copies holding drafts see different inputs: their predictions differ from copy 0's
    assert not torch.allclose(logits_js[n:2 * n - 1], logits_base[torch.from_numpy(~layout.drafted[1])])
    engine.cancel(seq.seq_id)


@pytest.mark.parametrize("method", ["prefix-cache", "dual-cache"])
def test_jump_share_advances_faster_and_decodes_every_slot_once(llms, method):
    llm = llms["llada"]
    base = SamplingParams(method=method, max_new_tokens=32, block_length=8, threshold=0.3,
                          stop_at_eos=False)
    want = llm.generate(PROMPTS, base)
    got = llm.generate(PROMPTS, base.replace(method=method + "+jump-share"))
    assert sum(o.stats.nfe for o in got) < sum(o.stats.nfe for o in want)
    for o in got:
        assert o.stats.decoded_tokens == 32 and len(o.token_ids) <= 32


@pytest.mark.slow  # over 2 s on 2 busy cores
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_full_odb_configuration_is_batch_invariant(llms, temperature):
    llm = llms["llada"]
    params = SamplingParams(method="dual-cache+adaptive-length+jump-share", max_new_tokens=32,
                            block_length=8, threshold=0.3, stop_token_ids=[25], eos_threshold=0.2,
                            temperature=temperature, seed=3)
    batched = llm.generate(PROMPTS, params)
    for prompt, out in zip(PROMPTS, batched):
        single = llm.generate([prompt], params)[0]
        assert single.token_ids == out.token_ids and single.stats.nfe == out.stats.nfe


def test_full_odb_configuration_beside_other_methods(llms):
    """Sequences of other methods in the same engine steps do not change an ODB sequence."""
    llm = llms["llada"]
    odb = SamplingParams(method="dual-cache+adaptive-length+jump-share", max_new_tokens=32,
                         block_length=8, threshold=0.3, stop_token_ids=[25], eos_threshold=0.2)
    alone = llm.generate(PROMPTS[:1], odb)[0]
    seqs = [llm.make_sequence(PROMPTS[0], odb),
            llm.make_sequence(PROMPTS[1], odb.replace(method="dual-cache")),
            llm.make_sequence(PROMPTS[2], odb.replace(method="prefix-cache+jump-share"))]
    for s in seqs:
        llm.engine.add(s)
    while llm.engine.has_work():
        llm.engine.step()
    assert seqs[0].output_ids() == alone.token_ids and seqs[0].stats.nfe == alone.stats.nfe


def test_jump_share_refuses_a_shifted_model(llms):
    llm = llms["Dream"]
    with pytest.raises(ValueError, match="without logit shift"):
        llm.generate(PROMPTS[:1], SamplingParams(method="dual-cache+jump-share", max_new_tokens=8,
                                                 block_length=4))


def test_strategy_order_in_the_method_string_does_not_matter(llms):
    llm = llms["llada"]
    params = SamplingParams(max_new_tokens=32, block_length=8, threshold=0.3, stop_token_ids=[25],
                            eos_threshold=0.2, stop_at_eos=False)
    a = llm.generate(PROMPTS, params.replace(method="dual-cache+adaptive-length+jump-share"))
    b = llm.generate(PROMPTS, params.replace(method="dual-cache+jump-share+adaptive-length"))
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert [o.stats.nfe for o in a] == [o.stats.nfe for o in b]


def test_drafts_may_cover_every_masked_position(llms):
    """As in the official code: with two masks left and four copies, both are drafted; the copy
    holding both predicts nothing itself and is accepted when the others confirm its drafts."""
    seq = make_seq(max_copies=4)  # block [3, 7)
    seq.fill([3, 5], [20, 21])
    seq.step = 2
    drafts = (np.array([6, 4]), np.array([61, 62]), np.array([0.9, 0.8], dtype=np.float32))
    layout = make_layout(seq, seq.masked_index(), drafts, 4)
    assert layout.draft_idx.tolist() == [1, 0] and layout.counts() == [2, 1, 1, 0]
    js = JumpShare(llms["llada"].model)
    js.setup(seq)
    seq.strategy_state["jump-share"]["layout"] = layout
    logits = torch.full((4, 96), -1.0)
    logits[0, 62], logits[1, 61], logits[2, 62], logits[3, 61] = 9.0, 9.0, 9.0, 9.0
    positions = torch.from_numpy(np.concatenate([layout.masked[~layout.drafted[c]] for c in range(4)]))
    committed = verify(js, seq, positions, logits)
    assert sorted(committed.tolist()) == [4, 6] and seq.canvas[3:7].tolist() == [20, 62, 21, 61]


def plain_copy_predictions(seq, layout, logits):
    """The per-copy rule, one copy at a time: sample (keyed by the copy's positions, its index
    as the salt), confidence, ``select`` on its own positions."""
    from dllm_engine.decoding import confidence, sample_tokens
    p = seq.params
    c, n = layout.drafted.shape
    x0 = torch.full((c, n), -1, dtype=torch.long)
    conf = torch.full((c, n), -float("inf"))
    commit = torch.zeros(c, n, dtype=torch.bool)
    logits = logits.clone()
    logits[:, seq.ids.mask_id] = -float("inf")
    masked = torch.from_numpy(layout.masked)
    for i, rows in enumerate(logits.split(layout.counts())):
        own = torch.from_numpy(~layout.drafted[i])
        if rows.shape[0]:
            noise = None
            if p.temperature != 0 or p.remasking == "random":  # the keys: the request's seed, the position, the forward, the copy as the salt
                m = rows.shape[0]
                noise = Noise(torch.full((m,), seq.seed), masked[own], torch.full((m,), seq.stats.nfe),
                              torch.full((m,), i))
            x0[i, own] = sample_tokens(rows, p.temperature, noise, p.top_k, p.top_p)
            conf[i, own] = confidence(rows, x0[i, own], p.remasking, noise).float()
            commit[i, own] = plain_select(seq, conf[i, own])
    return x0, conf, commit


def on_grid(layout, x0, conf_bits, chosen):
    """``copy_predictions``' flat values (each copy's own candidates, copy after copy) on the
    [C, n] grid of ``plain_copy_predictions``."""
    c, n = layout.drafted.shape
    own = torch.from_numpy(layout.own_index())
    grid = (torch.full((c * n,), -1, dtype=torch.long), torch.full((c * n,), -float("inf")),
            torch.zeros(c * n, dtype=torch.bool))
    grid[0][own], grid[1][own] = x0, conf_bits.int().view(torch.float32)
    grid[2][own] = chosen.bool()
    return [g.view(c, n) for g in grid]


def plain_select(seq, conf):
    """The decoder's rule on one sequence's candidates, as the single-row definitions state it."""
    import math
    from dllm_engine.decoding import factor_select, threshold_select, topk_select
    from dllm_engine.decoding.decide import threshold_rule
    rule = threshold_rule(seq)
    if rule is None:
        return factor_select(conf, seq.params.factor)
    threshold, k = rule
    return topk_select(conf, k) if threshold == math.inf else threshold_select(conf, threshold, min_k=k)


@pytest.mark.parametrize("options", [dict(), dict(threshold=None), dict(threshold=None, factor=1.0),
                                     dict(temperature=0.7, remasking="random"),
                                     dict(temperature=1.5, top_k=5, top_p=0.9),
                                     dict(remasking="topk_margin"), dict(remasking="entropy"),
                                     dict(threshold=0.05)])
def test_copy_predictions_of_all_copies_equal_the_per_copy_rule(options):
    """Copy predictions made in one pass over every copy's logits equal the per-copy rule, copy
    by copy (threshold, top-k and factor rules; sampled copies with their own keys; a copy that
    predicts nothing itself)."""
    torch.manual_seed(0)
    for committed in ([4, 7], [3, 4, 5, 6, 7, 8]):  # 6 masks left; 2 masks, both drafted
        seq = make_seq(block=8, max_new=8, max_copies=8, **options)
        seq.step = 2
        seq.stats.nfe = 3
        seq.fill(committed, np.arange(20, 20 + len(committed)))
        drafts = (np.array([9, 5, 3, 10, 6, 8]), np.array([50, 51, 52, 53, 54, 55]), torch.rand(6).numpy())
        layout = make_layout(seq, seq.masked_index(), drafts, 8)
        logits = torch.randn(sum(layout.counts()), 96) * 3
        want = plain_copy_predictions(seq, layout, logits)
        seq.stats.nfe -= 1  # copy_predictions keys the forward the turn will account (nfe + 1)
        positions = torch.from_numpy(np.concatenate([layout.masked[~d] for d in layout.drafted]))
        _, predicted = copy_predictions([seq], [layout], [len(positions)], positions, logits.clone())
        got = on_grid(layout, *predicted)
        for a, b in zip(got, want):
            assert torch.equal(a, b)
    assert layout.counts()[-1] == 0  # the last copy holds both drafts and predicts nothing
