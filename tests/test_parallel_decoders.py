"""dInfer's parallel decoders as commit rules (``commit_rule="credit"`` / ``"hierarchical"``) on
every base decoder: greedy tokens equal plain re-implementations written here from dInfer's
``python/dinfer/decoding/parallel_strategy.py`` as its docstrings and docs/decoding/
parallel-decoders.md describe it (not from the engine's code).

- ``reference`` (LLaDA) and ``block`` (SDAR): whole plain samplers (a full forward each step;
  the block decoder's prefix recomputed each step, which its cache equals exactly);
- ``prefix-cache`` / ``dual-cache``: their caches are approximations with their own tests
  (test_decoders.py), so here the plain rule is replayed on the logits each engine step had and
  must decide the same tokens, step after step."""
from pathlib import Path

import numpy as np
import pytest
import torch

from dllm_engine import LLM, SamplingParams
from dllm_engine.decoding.commit_rules import rule_instance
from dllm_engine.methods import COMMIT_RULES, DECODERS, check_commit_rule
from dllm_lab.tasks import load_split
from fixtures import write_checkpoint

CHECKPOINTS = Path(__file__).resolve().parents[1] / "checkpoints"
PROMPTS = [[42, 13, 14, 15, 16, 17, 18], [20, 21, 22], [30, 31, 32, 33, 34]]
RULES = [dict(commit_rule="credit", threshold=0.9), dict(commit_rule="credit", threshold=0.3, credit_alpha=2.0),
         dict(commit_rule="hierarchical", threshold=0.9, low_threshold=0.4),
         dict(commit_rule="hierarchical", threshold=0.6, low_threshold=0.05)]


# -- the plain rules, from dInfer's description ------------------------------------------------
class PlainCredit:
    """CreditThresholdParallelDecoder: per block a credit matrix C, decayed by beta each step;
    each masked position adds (its top-1 probability) ** gamma at its top-1 token; decode with
    the threshold rule (>= min(threshold, best - 1e-5)) on logits + alpha * log(C + 1)."""

    def __init__(self, threshold, credit_alpha=0.7, credit_gamma=0.2, credit_beta=0.8, **_):
        self.threshold, self.alpha, self.gamma, self.beta = threshold, credit_alpha, credit_gamma, credit_beta
        self.credit = None

    def new_block(self, block_length, vocab):
        self.credit = torch.zeros(block_length, vocab)

    def step(self, logits, masked):
        """logits [L, V] of the block (mask excluded), masked [L] -> (tokens, chosen [L])."""
        self.credit = self.credit * self.beta
        probs = torch.softmax(logits, -1)
        for i in masked.nonzero()[:, 0].tolist():
            best = int(probs[i].argmax())
            self.credit[i, best] += float(probs[i, best]) ** self.gamma
        fused = logits + self.alpha * torch.log(self.credit + 1)
        x0 = fused.argmax(-1)
        conf = torch.softmax(fused, -1).gather(-1, x0[:, None])[:, 0]
        conf = torch.where(masked, conf, -float("inf"))
        floor = min(self.threshold, float(conf.max()) - 1e-5)
        return x0, masked & (conf >= floor)


class PlainHierarchy:
    """HierarchyDecoder: in each run of consecutive masks, its most confident position if above
    low_threshold; anything above threshold; and the block's most confident position."""

    def __init__(self, threshold, low_threshold=0.4, **_):
        self.threshold, self.low = threshold, low_threshold

    def new_block(self, block_length, vocab):
        pass

    def step(self, logits, masked):
        x0 = logits.argmax(-1)
        conf = torch.softmax(logits, -1).gather(-1, x0[:, None])[:, 0]
        conf = torch.where(masked, conf, -float("inf"))
        chosen = conf > self.threshold
        i, n = 0, masked.numel()
        while i < n:
            if not masked[i]:
                i += 1
                continue
            j = i
            while j < n and masked[j]:
                j += 1
            top = conf[i:j].max()
            chosen[i:j] |= (conf[i:j] == top) & (top > self.low)
            i = j
        chosen[int(conf.argmax())] = True
        return x0, masked & chosen


def plain_rule(rule: dict):
    options = {k: v for k, v in rule.items() if k != "commit_rule"}
    return PlainCredit(**options) if rule["commit_rule"] == "credit" else PlainHierarchy(**options)


def block_logits(model, x, lo, hi, mask_id, full_canvas):
    with torch.no_grad():
        logits = model(x[None] if full_canvas else x[None, :hi])[0, lo:hi].float()
    logits[:, mask_id] = -float("inf")  # the engine's rule: a mask is never a prediction
    return logits


def plain_llada(model, prompt, gen_length, block_length, mask_id, rule):
    """LLaDA semi-AR blocks, a full forward over the whole canvas each step (``reference``)."""
    x = torch.tensor(prompt + [mask_id] * gen_length)
    for lo in range(len(prompt), len(x), block_length):
        hi = lo + block_length
        rule.new_block(block_length, model.config.vocab_size)
        while (x[lo:hi] == mask_id).any():
            masked = x[lo:hi] == mask_id
            x0, chosen = rule.step(block_logits(model, x, lo, hi, mask_id, full_canvas=True), masked)
            x[lo:hi] = torch.where(chosen, x0, x[lo:hi])
    return x[len(prompt):].tolist()


def plain_sdar(model, prompt, gen_length, block_length, mask_id, stop_ids, rule):
    """SDAR block diffusion: blocks aligned to 0, the prefix recomputed each step, stop after a
    block holding a stop token."""
    total = -(-(len(prompt) + gen_length) // block_length) * block_length
    x = torch.tensor(prompt + [mask_id] * (total - len(prompt)))
    for lo in range((len(prompt) // block_length) * block_length, total, block_length):
        hi = lo + block_length
        rule.new_block(block_length, model.config.vocab_size)
        while (x[lo:hi] == mask_id).any():
            masked = x[lo:hi] == mask_id
            x0, chosen = rule.step(block_logits(model, x, lo, hi, mask_id, full_canvas=False), masked)
            x[lo:hi] = torch.where(chosen, x0, x[lo:hi])
        if any(t in stop_ids for t in x[max(lo, len(prompt)):hi].tolist()):
            break
    out = x[len(prompt):len(prompt) + gen_length].tolist()
    return out[: next((i for i, t in enumerate(out) if t in stop_ids), len(out))]


# -- end to end: reference and block --------------------------------------------------------------
@pytest.fixture(scope="module")
def llms(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    return {mt: LLM(write_checkpoint(root / mt, mt)) for mt in ("llada", "sdar")}


def check_reference(llm, prompts, rule, gen_length=16, block_length=8):
    params = SamplingParams(method="reference", max_new_tokens=gen_length, block_length=block_length,
                            stop_at_eos=False, **rule)
    outs = llm.generate(prompts, params)
    for prompt, out in zip(prompts, outs):
        want = plain_llada(llm.model, prompt, gen_length, block_length, llm.token_ids.mask_id, plain_rule(rule))
        assert out.token_ids == want[: len(out.token_ids)]
        assert len(out.token_ids) == gen_length or want[len(out.token_ids)] in llm.token_ids.stop_ids
    return outs


def check_block(llm, prompts, rule, gen_length=12, block_length=4):
    params = SamplingParams(method="block", max_new_tokens=gen_length, block_length=block_length, **rule)
    outs = llm.generate(prompts, params)
    stops = llm.token_ids.stop_ids
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == plain_sdar(llm.model, prompt, gen_length, block_length, llm.token_ids.mask_id,
                                           stops, plain_rule(rule))
    return outs


@pytest.mark.parametrize("rule", RULES)
def test_reference_decoder_with_the_rule_equals_the_plain_sampler(llms, rule):
    check_reference(llms["llada"], PROMPTS, rule)


@pytest.mark.parametrize("rule", RULES)
def test_block_decoder_with_the_rule_equals_the_plain_sampler(llms, rule):
    check_block(llms["sdar"], PROMPTS, rule)


def test_the_rules_change_the_commits(llms):
    """Not the threshold rule under another name: on the random model (low confidences) the
    hierarchy commits one mask per run and credit lifts repeated predictions over the threshold,
    so both need fewer forwards than the threshold rule alone."""
    llm = llms["llada"]
    base = SamplingParams(method="reference", max_new_tokens=16, block_length=8, stop_at_eos=False, threshold=0.3)
    nfe = {name: llm.generate(PROMPTS, base.replace(**rule)).stats.nfe
           for name, rule in [("threshold", {}), ("credit", dict(commit_rule="credit", credit_alpha=3.0)),
                              ("hierarchical", dict(commit_rule="hierarchical", low_threshold=0.0))]}
    assert nfe["credit"] < nfe["threshold"] and nfe["hierarchical"] < nfe["threshold"], nfe


# -- prefix-cache / dual-cache: the plain rule replayed on each step's logits ---------------------
@pytest.fixture
def recorded(monkeypatch):
    """Each row a named rule decided: (sequence id, block index, candidate positions, a copy of
    the logits, the canvas at the candidates before, the canvas at them after the commit)."""
    calls = []
    for name in COMMIT_RULES:
        rule = rule_instance(name)
        original = rule.decide

        def decide(seqs, rules, positions, logits, reweigh, original=original):
            counts = np.bincount(rules.row, minlength=len(seqs)).tolist()
            copies = logits.clone()  # the rule may write the concatenation it is handed
            decision = original(seqs, rules, positions, logits, reweigh)
            for seq, pos, lg, chosen, x0 in zip(seqs, positions.split(counts), copies.split(counts),
                                                decision.chosen.split(counts), decision.x0.split(counts)):
                before = seq.tokens(pos)
                calls.append((seq.seq_id, seq.block_idx, pos.clone(), lg, before, torch.where(chosen, x0, before)))
            return decision

        monkeypatch.setattr(rule, "decide", decide)
    return calls


@pytest.mark.parametrize("method", ["prefix-cache", "dual-cache"])
@pytest.mark.parametrize("rule", RULES[:1] + RULES[2:3])
def test_cached_decoders_decide_as_the_plain_rule_on_their_logits(llms, recorded, method, rule):
    llm = llms["llada"]
    params = SamplingParams(method=method, max_new_tokens=16, block_length=8, stop_at_eos=False, **rule)
    llm.generate(PROMPTS, params)
    assert len(recorded) >= 2 * len(PROMPTS)
    replay_in_block_rows(recorded, rule, 8, llm.token_ids.mask_id)


def replay_in_block_rows(calls, rule, block_length, mask_id):
    """``replay`` with each candidate at its row of the block (its offset from the block start,
    recovered from the first call of the block, when the whole block is masked)."""
    starts = {}
    fixed = []
    for seq_id, block, positions, logits, before, after in calls:
        start = starts.setdefault((seq_id, block), int(positions.min()))
        fixed.append((seq_id, block, positions - start, logits, before, after))
    plains, blocks = {}, {}
    for seq_id, block, rows, logits, before, after in fixed:
        plain = plains.setdefault(seq_id, plain_rule(rule))
        if blocks.get(seq_id) != block:
            plain.new_block(block_length, logits.shape[-1])
            blocks[seq_id] = block
        logits = logits.float().clone()  # the engine's tensors are inference tensors
        logits[:, mask_id] = -float("inf")
        full = torch.zeros(block_length, logits.shape[-1])
        full[rows] = logits
        masked = torch.zeros(block_length, dtype=torch.bool)
        masked[rows] = before == mask_id
        x0, chosen = plain.step(full, masked)
        assert torch.equal(torch.where(chosen[rows], x0[rows], before), after), (seq_id, block)


# -- the embedded checkpoints ---------------------------------------------------------------------
def task_prompts(llm, n=3):
    return [llm.apply_chat_template(e.chat()) for e in load_split(["copy"], limit=1)[:n]]


@pytest.mark.parametrize("rule", [RULES[0], RULES[2]])
def test_embedded_tiny_llada_equals_the_plain_sampler(rule):
    llm = LLM(CHECKPOINTS / "tiny-llada")
    check_reference(llm, task_prompts(llm), rule, gen_length=32, block_length=16)


@pytest.mark.parametrize("rule", [RULES[0], RULES[2]])
def test_embedded_tiny_sdar_equals_the_plain_sampler(rule):
    llm = LLM(CHECKPOINTS / "tiny-sdar")
    check_block(llm, task_prompts(llm), rule, gen_length=32, block_length=32)


# -- how they compose ---------------------------------------------------------------------------------
def test_every_base_runs_the_rules():
    assert all(COMMIT_RULES[r].bases == tuple(DECODERS.values()) for r in ("credit", "hierarchical"))
    for base in DECODERS:
        check_commit_rule(base, [], "credit")


@pytest.mark.parametrize("method", ["dual-cache+early-skip", "dual-cache+adaptive-length", "dual-cache+focus"])
@pytest.mark.parametrize("rule", ["credit", "hierarchical"])
def test_the_rules_run_beside_strategies(llms, method, rule):
    out = llms["llada"].generate(PROMPTS[:2], SamplingParams(method=method, max_new_tokens=16, block_length=8,
                                                             commit_rule=rule))
    assert out.stats.decoded_tokens == 2 * 16 and all(len(o.token_ids) <= 16 for o in out)


def test_jump_share_replaces_the_commit_rule_and_refuses_a_named_one():
    with pytest.raises(ValueError, match="'jump-share' replaces the commit rule; drop it or commit_rule 'credit'"):
        SamplingParams(method="dual-cache+jump-share", commit_rule="credit")


def test_batched_requests_keep_their_own_credit(llms):
    llm = llms["llada"]
    params = SamplingParams(method="dual-cache", max_new_tokens=16, block_length=8, commit_rule="credit",
                            threshold=0.3, credit_alpha=2.0)
    batched = llm.generate(PROMPTS, params)
    for prompt, out in zip(PROMPTS, batched):
        assert llm.generate([prompt], params)[0].token_ids == out.token_ids
