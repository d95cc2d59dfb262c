"""ODB-dLLM's full configuration (`dual-cache+adaptive-length+jump-share`) against a plain-PyTorch
re-statement of the official rules (`llada_instruct/generate_alp_jump_share.py`: batch 1, dual
cache, threshold commits, adaptive length), on the shipped tiny-llada and held-out prompts of all
three task families. The re-statement is written from the rules, not from their code: a layer loop
over the model's weights with an explicit stale cache, four whole-block copies until the switch,
then eight copies of the masked positions sharing the committed ones."""
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from dllm_engine import LLM, SamplingParams
from dllm_engine.models.layers import apply_rope, rope_cos_sin
from dllm_lab.tasks import load_split

CHECKPOINT = Path(__file__).resolve().parent.parent / "checkpoints" / "tiny-llada"
THRESHOLD = EOS_THRESHOLD = 0.9
BLOCK = 32
SWITCH = {2: 92, 1: 89, 0: 86}  # block 32: 8 copies once 32 + 3·masks <= this (accepted drafts -> budget)


@pytest.fixture(scope="module")
def llm():
    return LLM(str(CHECKPOINT))


def forward(model, tokens, positions, keys_mask, cache=None, fresh=None):
    """Logits [T, V] of ``tokens`` at RoPE ``positions`` and each layer's (K, V) [1, H, T, D].
    Without ``cache`` the tokens attend to one another (``keys_mask`` None: all). With ``cache``
    (each layer's K/V of the canvas) the keys are the canvas, its slots ``fresh`` [f] replaced by
    the first f tokens' own K/V, then the other tokens' K/V; ``keys_mask`` [T, L + T - f]."""
    cfg = model.config
    t = tokens.numel()
    h = model.embed_tokens(tokens)[None]
    cos, sin = rope_cos_sin(positions[None], cfg.rotary_dim, cfg.rope_theta)
    kv = []
    for i, layer in enumerate(model.layers):
        att = layer.self_attn
        x = layer.input_layernorm(h)
        q, k, v = (proj(x).view(1, t, -1, cfg.head_dim).transpose(1, 2)
                   for proj in (att.q_proj, att.k_proj, att.v_proj))
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        kv.append((k, v))
        if cache is not None:
            n = fresh.numel()
            ck, cv = (c.clone() for c in cache[i])
            ck[:, :, fresh], cv[:, :, fresh] = k[:, :, :n], v[:, :, :n]
            k, v = torch.cat([ck, k[:, :, n:]], 2), torch.cat([cv, v[:, :, n:]], 2)
        mask = None if keys_mask is None else keys_mask[None, None]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        h = h + att.o_proj(out.transpose(1, 2).reshape(1, t, -1))
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    return model.lm_head(model.norm(h))[0].float(), kv


def predictions(logits, mask_id):
    """Greedy token and its probability (the mask never predicted)."""
    logits = logits.clone()
    logits[:, mask_id] = -float("inf")
    conf, tokens = torch.softmax(logits, -1).max(-1)
    return tokens, conf


def commits(conf, masked):
    """The threshold rule over one copy: every masked slot at or above it, at least the best one."""
    c = torch.where(masked, conf, -float("inf"))
    take = (c >= THRESHOLD) & masked
    if masked.any():
        take[c.argmax()] = True
    return take


def top_drafts(conf, masked, k):
    """Block offsets of the k most confident masked slots (ties: the lower offset)."""
    c = torch.where(masked, conf, -float("inf"))
    order = torch.sort(c, descending=True, stable=True).indices
    return order[: min(k, int(masked.sum()))].tolist()


def copy_sets(k_max):
    """The official copy order: (), {1}, {2}, {1,2}, {3}, {1,2,3}, {4}, {1,2,3,4} (draft numbers)."""
    return [(), (1,), (2,), (1, 2), (3,), (1, 2, 3), (4,), (1, 2, 3, 4)][: 2 * k_max]


def official_choice(x0, take, drafts, draft_tokens, ncopies):
    """The copy the official code applies. x0, take: [C, block] predictions and commits."""
    k = len(drafts)

    def ok(copy, j):  # copy commits draft j (1-based) with the drafted token
        return j <= k and bool(take[copy, drafts[j - 1]]) and int(x0[copy, drafts[j - 1]]) == draft_tokens[j - 1]

    one, two, three, four = (ok(0, j) for j in (1, 2, 3, 4))
    both = (one and ok(1, 2)) or (two and ok(2, 1))
    if ncopies == 4:
        return 3 if both or (one and two) else 1 if one else 2 if two else 0
    upto3 = (three and both) or (three and ok(4, 1) and ok(4, 2)) or (both and (ok(1, 3) or ok(2, 3) or ok(3, 3)))
    upto4 = four and (upto3 or (ok(6, 1) and ok(6, 2) and ok(6, 3)))
    if four and both and k == 4 and bool(take[6, drafts[2]]) and int(x0[6, drafts[2]]) == int(x0[4, drafts[0]]):
        upto4 = True  # the official comparison of copy {4}'s d3 with copy {3}'s prediction at d1
    upto4 = upto4 or (upto3 and any(ok(c, 4) for c in (1, 2, 3, 4, 5)))
    if upto4 or (one and two and three and four):
        return 7
    if upto3 or (one and two and three):
        return 5
    if both or (one and two):
        return 3
    return 1 if one else 2 if two else 4 if three else 6 if four else 0


def official_odb(model, prompt, gen_length, mask_id, eos_id, stop_ids):
    """Generated tokens (cut at the first stop) and forwards of the official jump-share loop."""
    x = torch.tensor(prompt + [mask_id] * gen_length)
    p, nfe, b = len(prompt), 0, 0
    num_blocks = gen_length // BLOCK
    while b < num_blocks:
        lo, hi = p + b * BLOCK, p + (b + 1) * BLOCK
        with torch.no_grad():
            logits, cache = forward(model, x, torch.arange(x.numel()), None)
        nfe += 1
        x0, conf = predictions(logits, mask_id)
        # adaptive length: cut after the block of the first confident stop prediction from here on
        hits = [i for i in range(lo, x.numel()) if int(x0[i]) in stop_ids and float(conf[i]) >= EOS_THRESHOLD]
        if hits:
            x = x[: lo + (hits[0] - lo + BLOCK) // BLOCK * BLOCK]
            cache = [(k[:, :, : x.numel()], v[:, :, : x.numel()]) for k, v in cache]
            num_blocks = (x.numel() - p) // BLOCK
        masked = x[lo:hi] == mask_id
        take = commits(conf[lo:hi], masked)
        x[lo:hi] = torch.where(take, x0[lo:hi], x[lo:hi])
        block_x0, block_conf = x0[lo:hi], conf[lo:hi]  # the drafts' source: this step's predictions
        eight, step = False, 1
        while (x[lo:hi] == mask_id).any():
            masked = x[lo:hi] == mask_id
            ncopies = 8 if eight else 4
            drafts = top_drafts(block_conf, masked, ncopies // 2)
            draft_tokens = [int(block_x0[d]) for d in drafts]
            sets = copy_sets(4 if eight else 2)
            block_now = x[lo:hi].clone()
            copies = []
            for s in sets:
                c = block_now.clone()
                for j in s:
                    if j <= len(drafts):
                        c[drafts[j - 1]] = draft_tokens[j - 1]
                copies.append(c)
            offsets = torch.arange(BLOCK)
            mpos = offsets[masked]  # the masked offsets, ascending
            # the step's tokens: copy 0 (the block), then each copy: whole (4) or its masked slots (8)
            per_copy = offsets if ncopies == 4 else mpos
            tokens = torch.cat([copies[0]] + [c[per_copy] for c in copies[1:]])
            positions = torch.cat([offsets] + [per_copy] * (ncopies - 1)) + lo
            width, r = x.numel(), per_copy.numel()
            keys = torch.zeros(tokens.numel(), width + r * (ncopies - 1), dtype=torch.bool)
            keys[:BLOCK, :width] = True  # the block sees the canvas: stale prefix and suffix, itself fresh
            hidden = offsets + lo if ncopies == 4 else mpos + lo  # what a copy does not see of copy 0
            for c in range(1, ncopies):
                rows = slice(BLOCK + (c - 1) * r, BLOCK + c * r)
                keys[rows, :width] = True
                keys[rows, hidden] = False
                keys[rows, width + (c - 1) * r: width + c * r] = True
            with torch.no_grad():
                logits, _ = forward(model, tokens, positions, keys, cache, fresh=torch.arange(lo, hi))
            nfe += 1
            x0s = torch.full((ncopies, BLOCK), -1)
            confs = torch.full((ncopies, BLOCK), -float("inf"))
            takes = torch.zeros(ncopies, BLOCK, dtype=torch.bool)
            for c in range(ncopies):
                rows = slice(0, BLOCK) if c == 0 else slice(BLOCK + (c - 1) * r, BLOCK + c * r)
                tok, cf = predictions(logits[rows], mask_id)
                own = copies[c][per_copy if c else offsets] == mask_id  # its own masked slots
                at = (per_copy if c else offsets)[own]
                x0s[c, at], confs[c, at] = tok[own], cf[own]
                takes[c] = commits(confs[c], copies[c] == mask_id)
            choice = official_choice(x0s, takes, drafts, draft_tokens, ncopies)
            new = copies[choice].clone()
            new[takes[choice]] = x0s[choice][takes[choice]]
            x[lo:hi] = new
            held = len([j for j in sets[choice] if j <= len(drafts)])
            if not eight and step >= 2 and BLOCK + 3 * int(masked.sum()) <= SWITCH[held]:
                eight = True
            block_x0, block_conf = x0s[choice], confs[choice]
            step += 1
        generated = x[max(lo, p):hi].tolist()
        if any(t in stop_ids for t in generated):
            x[hi:] = torch.where(x[hi:] == mask_id, eos_id, x[hi:])
            break
        b += 1
    out = x[p:].tolist()
    cut = next((i for i, t in enumerate(out) if t in stop_ids), len(out))
    return out[:cut], nfe


def held_out(per_task):
    return [ex for fam in ("copy", "worked", "phrased") for ex in load_split(fam, limit=per_task)]


@pytest.mark.slow  # 30 prompts (two per task) through the engine and the re-statement
def test_tokens_and_forwards_equal_the_official_rules(llm):
    params = SamplingParams(method="dual-cache+adaptive-length+jump-share", threshold=THRESHOLD,
                            eos_threshold=EOS_THRESHOLD, max_new_tokens=256, block_length=BLOCK)
    examples = held_out(2)
    outs = llm.chat([ex.chat() for ex in examples], params)
    ids = llm.make_sequence(outs[0].prompt_token_ids, params).ids
    differ = []
    for ex, out in zip(examples, outs):
        want, nfe = official_odb(llm.model, out.prompt_token_ids, 256, ids.mask_id, ids.eos_id, ids.stop_ids)
        if out.token_ids != want or out.stats.nfe != nfe:
            differ.append((ex.id, out.stats.nfe, nfe))
    assert not differ, differ
