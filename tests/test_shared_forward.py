"""The ``n`` copies of a request share their first forward (``engine/batch_step.twins``): equal
prompts at their first step compute one forward, its K/V copied into the others' rows, and each
copy then draws with its own seed. Tokens equal those of computing every copy, for every family
and base decoder, at dynamic and fixed shapes; the shared rows count no work of their own."""
import pytest

from dllm_engine import LLM
from dllm_engine.spec import parse_spec
from fixtures import write_checkpoint, write_llada_moe_checkpoint

PROMPTS = [[11, 12, 13, 14, 15, 16, 17], [21, 22, 23], [11, 12, 13, 14, 15, 16, 17, 18]]
N = 3
CASES = [("llada", "dual-cache:threshold=0.9"), ("llada", "prefix-cache:threshold=0.9"),
         ("llada", "reference:steps=4"), ("Dream", "dual-cache:threshold=0.9"),
         ("llada_moe", "dual-cache:threshold=0.9"), ("sdar", "block:threshold=0.9")]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    made = {}

    def model(family: str) -> LLM:
        if family not in made:
            folder = tmp_path_factory.mktemp(family)
            if family == "llada_moe":
                write_llada_moe_checkpoint(folder)
            else:
                write_checkpoint(folder, family, scale=0.15)
            # the prefix store off: it would hold SDAR's copies back to reuse the prompt instead
            made[family] = LLM(folder, prefix_cache=False)
        return made[family]
    return model


def generate(llm: LLM, spec: str, share: bool, fixed: bool = False):
    params = parse_spec(spec + ",temperature=1.5,seed=5", max_new_tokens=8, block_length=4)
    params.n = N
    llm.engine.runner.share_forwards = share
    llm.engine.runner.set_step_shapes(fixed)
    try:
        return llm.generate(PROMPTS, params)
    finally:
        llm.engine.runner.share_forwards = True
        llm.engine.runner.set_step_shapes(False)


def work(outputs) -> float:
    return sum(o.stats.processed_tokens + o.stats.prefill_tokens for copies in outputs for o in copies)


@pytest.mark.parametrize("family,spec", CASES)
def test_copies_sharing_their_first_forward_get_the_tokens_computed_ones_get(models, family, spec):
    llm = models(family)
    shared, computed = generate(llm, spec, True), generate(llm, spec, False)
    assert [[o.token_ids for o in c] for c in shared] == [[o.token_ids for o in c] for c in computed]
    # the copies drew apart after the shared step: the sharing is not of a single answer
    assert any(len({tuple(o.token_ids) for o in copies}) > 1 for copies in shared)
    # each copy but the first of a prompt counts its prompt as reused, and none of the first
    # forward's tokens as its own work: the first forward of these decoders computes
    # the whole canvas (block diffusion: up to the end of the first block)
    first = [(len(p) + 8) if family != "sdar" else -(-(len(p) + 1) // 4) * 4 for p in PROMPTS]
    assert [[o.stats.cached_tokens for o in c] for c in shared] == [[0] + [len(p)] * (N - 1) for p in PROMPTS]
    assert work(computed) - work(shared) == pytest.approx((N - 1) * sum(first))
    assert [[o.stats.nfe for o in c] for c in shared] == [[o.stats.nfe for o in c] for c in computed]


@pytest.mark.parametrize("family,spec", [CASES[0], CASES[-1]])
def test_fixed_shape_steps_share_too(models, family, spec):
    """The forward over the computed rows pads to its bucket with the sharing rows and the
    pool's spare rows, which padding never writes."""
    llm = models(family)
    shared, computed = generate(llm, spec, True, fixed=True), generate(llm, spec, False, fixed=True)
    assert [[o.token_ids for o in c] for c in shared] == [[o.token_ids for o in c] for c in computed]
    assert work(shared) < work(computed)
