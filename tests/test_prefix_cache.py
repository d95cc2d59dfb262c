"""Exact prefix reuse for block-causal families (``engine/prefix_cache.py``): requests whose
prompts start with blocks an earlier request finalised get the tokens they get without the
store, at batch 1 and 8, for every block decoder's method; an evicted prefix is recomputed
exactly; a memory budget evicts stored blocks before it makes a request wait; full-attention
families store nothing; the counts say what was reused."""
import numpy as np
import pytest

from dllm_engine import LLM, SamplingParams
from dllm_engine.engine.prefix_cache import PrefixStore, block_keys, reusable_blocks
from dllm_engine.spec import parse_spec
from fixtures import write_checkpoint, write_llada2_checkpoint

BLOCK = 4
HEADER = [(i % 80) + 11 for i in range(13)]  # a shared prefix of three whole blocks and a part
PROMPTS = [HEADER + tail for tail in ([20, 21], [30, 31, 32, 33, 34], [40], [50, 51, 52], [20, 21, 22, 23],
                                      [60, 61, 62, 63, 64, 65, 66], [70, 71], [80])]
METHODS = ["block:threshold=0.9", "block:steps=2", "block+focus:threshold=0.9", "block+adaptive-length:threshold=0.9",
           "block:commit_rule=joint-threshold,preset=S", "block:threshold=0.9,temperature=0.7,seed=3"]


# every method at batch 1 and 8 on SDAR; the MoE family for one
CASES = [("sdar", spec, batch) for spec in METHODS for batch in (1, 8)] + [("llada2_moe", METHODS[4], 8)]


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """family -> (LLM with the prefix store, LLM without) on one random block-causal checkpoint."""
    made = {}

    def pair(family: str):
        if family not in made:
            folder = tmp_path_factory.mktemp(family)
            if family == "sdar":
                write_checkpoint(folder, "sdar", block_size=BLOCK)
            else:
                write_llada2_checkpoint(folder, block_size=BLOCK)
            made[family] = LLM(folder), LLM(folder, prefix_cache=False)
        return made[family]
    return pair


def run(llm: LLM, spec: str, batch: int) -> list:
    params = parse_spec(spec, max_new_tokens=12, block_length=BLOCK)
    return [o for i in range(0, len(PROMPTS), batch) for o in llm.generate(PROMPTS[i:i + batch], params)]


@pytest.mark.parametrize("family,spec,batch", CASES)
def test_reused_prefixes_give_the_tokens_computed_ones_give(pairs, family, spec, batch):
    on, off = pairs(family)
    on.engine.prefix_store = PrefixStore()  # cold: the first pass stores, the second reuses
    first, again, want = run(on, spec, batch), run(on, spec, batch), run(off, spec, batch)
    assert [o.token_ids for o in first] == [o.token_ids for o in want]
    assert [o.token_ids for o in again] == [o.token_ids for o in want]
    # the second pass reused every whole block of its prompts (their answers' too: none of
    # them is a prompt's prefix here); the reused tokens are not prefilled
    whole = [reusable_blocks(len(p), BLOCK) * BLOCK for p in PROMPTS]
    assert [o.stats.cached_tokens for o in again] == whole
    assert [o.stats.prefill_tokens for o in again] == [len(p) - w for p, w in zip(PROMPTS, whole)]
    work = [sum(o.stats.processed_tokens + o.stats.prefill_tokens for o in outs) for outs in (again, want)]
    assert work[0] == pytest.approx(work[1] - sum(whole))  # the same steps, less the reused prompt tokens
    # each prompt after the first finds the header stored: one at a time, or in a batch, whose
    # others wait a step for the first to compute it (Engine.prefixes_in_flight)
    assert [o.stats.cached_tokens for o in first] == [0] + [12] * (len(PROMPTS) - 1)


@pytest.mark.parametrize("family", ["sdar", "llada2_moe"])
def test_an_evicted_prefix_is_recomputed_exactly(pairs, family):
    """A store of one block: most lookups miss or hit a part, every answer is the same."""
    on, off = pairs(family)
    block_bytes = on.engine.kv_position_bytes * BLOCK  # K and V of every layer
    on.engine.prefix_store = PrefixStore(capacity=block_bytes)
    got, want = run(on, METHODS[0], 1), run(off, METHODS[0], 1)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    store = on.engine.prefix_store
    assert store.nbytes <= block_bytes and store.blocks <= 1
    assert sum(o.stats.cached_tokens for o in got) <= BLOCK * (len(PROMPTS) - 1)


def test_a_memory_budget_evicts_stored_blocks_before_a_request_waits(tmp_path):
    folder = write_checkpoint(tmp_path, "sdar", block_size=BLOCK)
    probe = LLM(folder)
    params = parse_spec(METHODS[0], max_new_tokens=12, block_length=BLOCK)
    one = probe.engine.memory_needed([probe.make_sequence(PROMPTS[5], params)], fresh=True)
    llm = LLM(folder, kv_cache_memory=2 * one)  # two sequences' room: the store fills what is left
    outs = llm.generate(PROMPTS, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in LLM(folder, prefix_cache=False).generate(PROMPTS, params)]
    engine = llm.engine
    assert engine.prefix_store.nbytes <= engine.memory_budget
    assert engine.prefix_store.blocks > 0  # it kept what fitted


def test_full_attention_families_store_nothing(tmp_path):
    llm = LLM(write_checkpoint(tmp_path, "llada"))
    params = SamplingParams(max_new_tokens=8, block_length=4)
    outs = [o for _ in range(2) for o in llm.generate(PROMPTS[:3], params)]  # the second call finds nothing
    assert llm.engine.prefix_store.blocks == 0 and all(o.stats.cached_tokens == 0 for o in outs)


def test_block_keys_chain_every_token_before_a_block():
    tokens = np.arange(12)
    keys = block_keys(tokens, 4, 3)
    assert len(set(keys)) == 3
    changed = tokens.copy()
    changed[1] = 99  # a token of block 0 changes every key after it
    assert all(a != b for a, b in zip(keys, block_keys(changed, 4, 3)))
    assert block_keys(tokens, 4, 2) == keys[:2] and block_keys(tokens, 2, 2) != block_keys(tokens, 4, 2)[:2]
    assert reusable_blocks(13, 4) == 3 and reusable_blocks(12, 4) == 3 and reusable_blocks(3, 4) == 0


@pytest.mark.slow  # a live server
def test_a_server_reuses_a_shared_header_and_says_so(tmp_path):
    """Chat requests that start with one header: answers as without the store, each after the
    first reusing the header's blocks (usage.prompt_tokens_details.cached_tokens), and the load
    test's shared-prefix workload reports what was computed and reused."""
    import httpx
    from dllm_engine.bench.serve import run_serve_bench, shared_header
    from dllm_lab.tasks import load_split
    from test_server import NAME, metric, serving
    folder = write_checkpoint(tmp_path, "sdar", block_size=BLOCK)
    params = SamplingParams(method="block", threshold=0.9, max_new_tokens=8, block_length=BLOCK)
    examples = load_split("sort", limit=4)
    header = shared_header(40, examples)
    chats = [[{"role": "user", "content": f"{header}\n{e.prompt}"}] for e in examples]
    with serving(LLM(folder), defaults=params) as (url, _), \
            serving(LLM(folder, prefix_cache=False), defaults=params) as (off, _):
        got = [httpx.post(url + "/v1/chat/completions", json={"model": NAME, "messages": chat}, timeout=60).json()
               for chat in chats]
        levels = run_serve_bench(url, [4], 8, tmp_path / "load", tasks=["sort"], shared_prefix=40,
                                 progress=lambda line: None, baseline_url=off)
        hit_rate = metric(url, "prefix_cache_hit_rate")
        # chats of two turns, two choices each: a second turn starts with its chat's first
        chats_on, chats_off = (run_serve_bench(u, [2], 4, None, {"n": 2}, ["sort"], progress=lambda line: None,
                                               turns=2)[0] for u in (url, off))
    want = LLM(folder, prefix_cache=False).chat(chats, params)
    assert [r["choices"][0]["message"]["content"] for r in got] == [o.text for o in want]
    cached = [r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in got]
    assert cached[0] == 0 and all(c >= 40 for c in cached[1:])  # the header's whole blocks at least
    assert levels[0].failures == 0 and levels[0].cached_tokens > levels[0].prefill_tokens > 0
    assert 0 < hit_rate <= 1
    # the baseline server ran the same level just before: it computed every prompt token
    from dllm_engine.bench.report import load_run, render
    report, meta = load_run(tmp_path / "load")
    base = report["baseline"]["levels"][0]
    assert base["cached_tokens"] == 0 and base["prefill_tokens"] == levels[0].prefill_tokens + levels[0].cached_tokens
    table = render(report)
    assert table.count("\n| ") == 2 and "| baseline `" in table and meta["command"]
    assert chats_on.num_requests == chats_off.num_requests == 4 and chats_on.failures == chats_off.failures == 0
    assert chats_off.cached_tokens == 0 and chats_on.cached_tokens > 0
    assert chats_on.prefill_tokens + chats_on.cached_tokens == chats_off.prefill_tokens  # the same prompts
    assert chats_on.accuracy == chats_off.accuracy  # over both choices of every turn: the same answers
