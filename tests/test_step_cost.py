"""A step's own cost does not grow with the batch: for every base decoder, commit rule (the
decoder's own and the named ones) and sampling option, and for every strategy (FOCUS, its
delayed cache, early skipping, adaptive length, jump-share), the tensor ops outside the model's
layer loop (planning, inputs, LM head, commit, bookkeeping) at batch 64 are at most 1.25x those
at batch 1, and a forward group reads the device at most three times per step
(counted as ``dllm profile`` counts them)."""
import pytest

from dllm_engine import LLM, SamplingParams
from dllm_engine.bench.profile import count_syncs
from dllm_engine.spec import parse_spec
from fixtures import write_checkpoint

pytestmark = pytest.mark.slow  # counting every op of a few hundred steps

PROMPTS = [[5, 6, 7, 8, 9], [11, 12, 13], [20, 21, 22, 23, 24, 25, 26], [30, 31, 32, 33]]
MAX_READS = 3  # per forward group and step: the commit, and a trace's or logprobs' reads
MAX_GROWTH = 1.25  # ops outside the layer loop, batch 64 over batch 1


@pytest.fixture(scope="module")
def llms(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    return {mt: LLM(write_checkpoint(root / mt, mt)) for mt in ("llada", "Dream", "sdar")}


def per_step(llm: LLM, params: SamplingParams, batch: int) -> tuple[float, float]:
    """(ops outside the layer loop, host reads) per engine step, generating ``batch`` prompts
    (the PROMPTS cycled, so rows differ in length and progress) in one batch."""
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(batch)]
    count_syncs(llm, params, prompts[:1], 1)  # warm-up: one-time work (tables, pools) done
    count = count_syncs(llm, params, prompts, batch)
    return (count.ops - count.layer_ops) / count.steps, count.total / count.steps


CASES = [
    ("llada", "reference:steps=8"),
    ("llada", "prefix-cache:threshold=0.9"),
    ("llada", "dual-cache:threshold=0.9"),
    ("llada", "dual-cache:steps=4"),
    ("llada", "dual-cache:factor=1.0"),
    ("llada", "dual-cache:threshold=0.9,temperature=0.7,top_k=5"),
    ("llada", "dual-cache:steps=4,remasking=random"),
    ("llada", "reference:steps=8,cfg_scale=1.0"),  # classifier-free guidance: two canvases per row
    ("llada", "reference+adaptive-length:steps=8,cfg_scale=1.0,temperature=0.7"),
    ("Dream", "dual-cache:threshold=0.9"),
    ("sdar", "block:threshold=0.9"),
    ("sdar", "block:threshold=0.9,temperature=0.6,top_p=0.9"),
    # named commit rules, decided for the whole group (decoding/commit_rules.GroupCommit)
    ("llada", "dual-cache:threshold=0.9,commit_rule=credit"),
    ("llada", "reference:threshold=0.9,commit_rule=hierarchical,temperature=0.7"),
    ("sdar", "block:commit_rule=joint-threshold,preset=S"),
    # strategies whose bookkeeping is host state (the per-sequence step)
    ("sdar", "block+focus:threshold=0.9"),
    ("llada", "dual-cache+focus:steps=4"),
    ("sdar", "block+delayed-cache:threshold=0.9"),
    ("llada", "dual-cache+early-skip:threshold=0.9"),
    ("llada", "dual-cache+adaptive-length:threshold=0.9"),
    # jump-share: copies planned on the host, every copy of every row verified in one pass
    ("llada", "dual-cache+jump-share:threshold=0.9,max_copies=8"),
    ("llada", "prefix-cache+jump-share:threshold=0.9,temperature=0.7,jump_share_layout=shared"),
    ("llada", "dual-cache+adaptive-length+jump-share:threshold=0.9"),
]


@pytest.mark.parametrize("model_type,spec", CASES)
def test_a_steps_own_work_does_not_grow_with_the_batch(llms, model_type, spec):
    llm = llms[model_type]
    params = parse_spec(spec, max_new_tokens=16, block_length=8)
    ops_1, reads_1 = per_step(llm, params, 1)
    ops_64, reads_64 = per_step(llm, params, 64)
    assert reads_1 <= MAX_READS and reads_64 <= MAX_READS, (reads_1, reads_64)
    assert ops_64 <= MAX_GROWTH * ops_1, (ops_1, ops_64)


def test_traces_and_logprobs_cost_one_read_each_and_only_where_asked(llms):
    llm = llms["llada"]
    base = parse_spec("dual-cache:threshold=0.9", max_new_tokens=16, block_length=8)
    _, plain = per_step(llm, base, 8)
    _, recorded = per_step(llm, base.replace(record_steps=True, logprobs=2), 8)
    assert plain == pytest.approx(1.0)
    assert recorded == pytest.approx(3.0)


@pytest.mark.parametrize("model_type,spec", [("sdar", "block+focus:threshold=0.9"),
                                             ("llada", "dual-cache+adaptive-length+jump-share:threshold=0.9")])
def test_logits_rows_found_on_the_host_are_those_the_device_finds(llms, monkeypatch, model_type, spec):
    """Plans built on the host and hooks that say on the host what they kept (FOCUS) let the
    runner find the logits rows without a read (``Runner.host_logits``): the same tokens and
    work as finding them on the device, one read fewer per step."""
    from dllm_engine.engine.runner import Runner
    llm = llms[model_type]
    params = parse_spec(spec, max_new_tokens=16, block_length=8)
    prompts = PROMPTS * 2
    host = llm.generate(prompts, params)
    _, host_reads = per_step(llm, params, 8)
    monkeypatch.setattr(Runner, "host_logits", lambda self, step, hidden, ctx: self.logits(step.logit_slots, hidden, ctx))
    device = llm.generate(prompts, params)
    _, device_reads = per_step(llm, params, 8)
    assert [o.token_ids for o in host] == [o.token_ids for o in device]
    assert [o.stats.processed_tokens for o in host] == [o.stats.processed_tokens for o in device]
    assert device_reads == pytest.approx(host_reads + 1)
