"""ODB-dLLM adaptive length prediction (strategies/adaptive_length.py)."""
import dataclasses

import pytest
import torch

from dllm_engine import LLM, SamplingParams
from dllm_engine.engine.sequence import Sequence, TokenIds
from dllm_engine.strategies.adaptive_length import NO_STOP, AdaptiveLength, cut_at, first_stops
from fixtures import random_model, write_checkpoint

PROMPTS = [[42, 13, 14, 15, 16, 17, 18], [20, 21, 22], [30, 31, 32, 33, 34]]
IDS = TokenIds(mask_id=4, eos_id=3, stop_ids=frozenset({3, 9}))


@pytest.fixture(scope="module")
def llms(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    return {mt: LLM(write_checkpoint(root / mt, mt)) for mt in ("llada", "Dream", "sdar")}


def make_seq(prompt_len=3, max_new=16, block=4, **options) -> Sequence:
    params = SamplingParams(method="dual-cache+adaptive-length", max_new_tokens=max_new,
                            block_length=block, steps=block, seed=0, **options)
    return Sequence(0, list(range(10, 10 + prompt_len)), params, IDS)


def predictions_at(seq, hits: dict[int, tuple[int, float]]):
    """Every masked generation slot predicts token 50 at 0.99, except ``hits``: pos -> (tok, conf)."""
    positions = torch.from_numpy(seq.undecided.nonzero()[0])
    tokens = torch.full_like(positions, 50)
    conf = torch.full(positions.shape, 0.99)
    for pos, (tok, c) in hits.items():
        i = int((positions == pos).nonzero())
        tokens[i], conf[i] = tok, c
    return positions, tokens, conf


def cut_length(seq, positions, tokens, conf):
    """The engine's rule for one sequence: ``first_stops`` over one row, then ``cut_at``."""
    first, = first_stops([seq], [0], positions, tokens, conf, torch.zeros_like(positions), [positions.numel()]).tolist()
    return None if first == NO_STOP else cut_at(seq, first)


def reference_cut(seq, positions, tokens, conf):
    """Adaptive length's cut rule written plainly, one sequence: the end of the block holding the first confident
    stop at or after prompt_len + min_length, never before the block of the last committed
    non-stop token; None when nothing is cut."""
    p = seq.params
    stops = torch.tensor(sorted(seq.ids.stop_ids))
    hits = [int(x) for x, t, c in zip(positions, tokens, conf)
            if int(t) in stops.tolist() and float(c) >= p.eos_threshold and int(x) >= seq.prompt_len + p.min_length]
    if not hits:
        return None
    end = next(e for s, e in seq.blocks if s <= min(hits) < e)
    gen = seq.canvas[seq.prompt_len:].tolist()
    kept = [seq.prompt_len + i for i, t in enumerate(gen) if t != seq.ids.mask_id and t not in stops.tolist()]
    if kept:
        end = max(end, next(e for s, e in seq.blocks if s <= max(kept) < e))
    return end if end < seq.canvas_len else None


def test_cut_at_the_block_boundary_after_the_first_confident_stop():
    seq = make_seq()  # prompt 3, blocks [3,7) [7,11) [11,15) [15,19)
    assert cut_length(seq, *predictions_at(seq, {8: (3, 0.95), 12: (3, 0.99)})) == 11
    # a configured stop token counts like EOS; the first hit wins
    assert cut_length(seq, *predictions_at(seq, {5: (9, 0.91), 12: (3, 0.99)})) == 7
    # below tau: no cut; a confident non-stop token: no cut
    assert cut_length(seq, *predictions_at(seq, {8: (3, 0.85)})) is None
    assert cut_length(seq, *predictions_at(seq, {})) is None
    # a hit in the last block would not shorten anything
    assert cut_length(seq, *predictions_at(seq, {16: (3, 0.99)})) is None


def test_tau_above_one_never_cuts():
    seq = make_seq(eos_threshold=1.01)
    assert cut_length(seq, *predictions_at(seq, {4: (3, 1.0), 8: (3, 1.0)})) is None


def test_never_cuts_below_min_length():
    seq = make_seq(min_length=6)  # slots before 3 + 6 = 9 are ignored
    assert cut_length(seq, *predictions_at(seq, {4: (3, 0.99), 8: (3, 0.99)})) is None
    assert cut_length(seq, *predictions_at(seq, {4: (3, 0.99), 9: (3, 0.99)})) == 11
    for min_length in range(0, 16):
        seq = make_seq(min_length=min_length)
        hits = {p: (3, 0.99) for p in range(3, 19)}
        new_len = cut_length(seq, *predictions_at(seq, hits))
        assert new_len is None or new_len - 3 > min_length


def test_never_cuts_at_or_before_a_committed_non_eos_token():
    seq = make_seq()
    seq.fill(slice(3, 7), torch.tensor([20, 21, 22, 3]))  # block 0 committed (ends with EOS)
    seq.fill(12, 23)  # a committed non-EOS token in block 2
    new_len = cut_length(seq, *predictions_at(seq, {8: (3, 0.99)}))
    assert new_len == 15 and new_len > 12
    # committed EOS tokens do not hold the cut back
    seq.fill(12, 3)
    assert cut_length(seq, *predictions_at(seq, {8: (3, 0.99)})) == 11


def test_the_batched_rule_is_cut_length_for_every_row():
    """``first_stops`` + ``cut_at`` over rows with their own tau, min_length and stop ids, in one
    pass, decide what the plain rule (``reference_cut``) decides for each row alone."""
    cases = [(make_seq(), {8: (3, 0.95), 12: (3, 0.99)}), (make_seq(), {5: (9, 0.91), 12: (3, 0.99)}),
             (make_seq(), {8: (3, 0.85)}), (make_seq(), {}), (make_seq(), {16: (3, 0.99)}),
             (make_seq(eos_threshold=1.01), {4: (3, 1.0)}), (make_seq(min_length=6), {4: (3, 0.99), 9: (3, 0.99)}),
             (make_seq(eos_threshold=0.8), {8: (3, 0.85)})]
    other = dataclasses.replace(IDS, stop_ids=frozenset({3, 7}))  # its own stop id 7, not 9
    cases.append((Sequence(1, [10, 11, 12], cases[0][0].params, other), {5: (9, 0.99), 9: (7, 0.99)}))
    seqs = [seq for seq, _ in cases]
    preds = [predictions_at(seq, hits) for seq, hits in cases]
    counts = [p[0].numel() for p in preds]
    owner = torch.cat([torch.full((n,), j) for j, n in enumerate(counts)])
    positions, tokens, conf = (torch.cat(parts) for parts in zip(*preds))
    firsts = first_stops(seqs, list(range(len(seqs))), positions, tokens, conf, owner, counts).tolist()
    expected = [reference_cut(seq, *p) for seq, p in zip(seqs, preds)]
    assert [None if f == NO_STOP else cut_at(seq, f) for seq, f in zip(seqs, firsts)] == expected
    assert expected == [11, 7, None, None, None, None, 11, 11, 11]


def test_after_forward_inspects_everything_but_commits_only_the_block():
    model = random_model("llada")
    alp = AdaptiveLength(model)
    seq = make_seq()
    alp.setup(seq)
    from dllm_engine.decoding.decoders import plan_step
    plan = alp.plan(seq, plan_step(seq, 0))
    # step 0 of block 0: the block's 4 slots, then every other masked slot of the canvas
    assert plan.logit_positions.tolist() == list(range(3, 19))
    logits = torch.zeros(16, 96)
    logits[:, 50] = 10.0
    logits[8 - 3, 50], logits[8 - 3, 3] = 0.0, 12.0  # position 8 predicts EOS at ~0.998
    positions, kept = alp.after_forward(seq, plan.logit_positions, logits)
    assert positions.tolist() == [3, 4, 5, 6] and torch.equal(kept, logits[:4])
    assert seq.canvas_len == 19  # the cut waits for the sequence's turn in the commit loop
    alp.after_commit(seq, positions[:0])
    assert seq.canvas_len == 11 and seq.blocks == [(3, 7), (7, 11)]
    assert seq.strategy_state["adaptive-length"]["cuts"] == [8]
    # later steps of the block are untouched
    seq.step = 1
    plan = alp.plan(seq, plan_step(seq, 0))
    assert plan.logit_positions.tolist() == [3, 4, 5, 6]


@pytest.mark.slow  # over 2 s on 2 busy cores
@pytest.mark.parametrize("method,model_type", [("reference", "llada"), ("prefix-cache", "llada"),
                                               ("dual-cache", "llada"), ("dual-cache", "Dream"),
                                               ("block", "sdar")])
def test_tau_above_one_gives_the_base_decoders_tokens(llms, method, model_type):
    llm = llms[model_type]
    # ALP ends a sequence at its first finished block holding a stop token; without cuts it is
    # the base decoder with that stop turned on
    base = SamplingParams(method=method, max_new_tokens=16, block_length=4, threshold=0.3,
                          stop_token_ids=[25, 73], stop_at_eos=True)
    want = llm.generate(PROMPTS, base)
    got = llm.generate(PROMPTS, base.replace(method=method + "+adaptive-length", eos_threshold=1.5))
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [o.stats.nfe for o in got] == [o.stats.nfe for o in want]


def test_tau_above_one_with_classifier_free_guidance(llms):
    llm = llms["llada"]
    base = SamplingParams(method="reference", max_new_tokens=8, block_length=4, steps=2, cfg_scale=1.0)
    want = llm.generate(PROMPTS[:2], base)
    got = llm.generate(PROMPTS[:2], base.replace(method="reference+adaptive-length", eos_threshold=1.5))
    assert [o.token_ids for o in got] == [o.token_ids for o in want]


def run_sequences(llm, params):
    seqs = [llm.make_sequence(p, params) for p in PROMPTS]
    for s in seqs:
        llm.engine.add(s)
    while llm.engine.has_work():
        llm.engine.step()
    return seqs


@pytest.mark.parametrize("method", ["reference", "prefix-cache", "dual-cache"])
def test_a_confident_stop_prediction_cuts_the_canvas(llms, method):
    """Token 25 is often predicted by the random model: as a stop id with a low tau it cuts."""
    llm = llms["llada"]
    params = SamplingParams(method=method + "+adaptive-length", max_new_tokens=32, block_length=8,
                            threshold=0.3, stop_token_ids=[25], eos_threshold=0.2, min_length=4,
                            stop_at_eos=False)
    seqs = run_sequences(llm, params)
    full = llm.generate(PROMPTS, params.replace(method=method))
    assert any(s.strategy_state["adaptive-length"]["cuts"] for s in seqs)
    for seq, base in zip(seqs, full):
        gen_len = seq.canvas_len - seq.prompt_len
        assert seq.finished and gen_len % 8 == 0 and 4 < gen_len <= 32
        assert not seq.undecided.any() and int((seq.canvas == seq.ids.mask_id).sum()) == 0
        # nothing committed was thrown away: every slot of the final canvas was decoded once
        assert seq.stats.decoded_tokens == gen_len
        if gen_len < 32:
            assert seq.stats.nfe < base.stats.nfe
            assert seq.stats.processed_tokens < base.stats.processed_tokens


def test_min_length_holds_end_to_end(llms):
    llm = llms["llada"]
    params = SamplingParams(method="dual-cache+adaptive-length", max_new_tokens=32, block_length=8,
                            threshold=0.3, stop_token_ids=[25], eos_threshold=0.05, min_length=17,
                            stop_at_eos=False)
    for seq in run_sequences(llm, params):
        assert seq.canvas_len - seq.prompt_len >= 24  # the block boundary after slot 17


@pytest.mark.slow  # over 2 s on 2 busy cores
def test_adaptive_length_is_batch_invariant(llms):
    llm = llms["llada"]
    params = SamplingParams(method="dual-cache+adaptive-length", max_new_tokens=32, block_length=8,
                            threshold=0.3, stop_token_ids=[25], eos_threshold=0.2)
    batched = llm.generate(PROMPTS, params)
    for prompt, out in zip(PROMPTS, batched):
        single = llm.generate([prompt], params)[0]
        assert single.token_ids == out.token_ids and single.stats.nfe == out.stats.nfe
