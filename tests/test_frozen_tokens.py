"""Greedy tokens of every method on both shipped checkpoints, frozen in tests/data/frozen_greedy.json:
a rewrite of the step (how a batch is planned, committed and advanced) must give them again, for
the eight prompts together and for one of them alone.

The file was written by this test with DLLM_FREEZE_TOKENS=1 (it then writes instead of checking);
write it again only when a change of tokens is meant, and say why in the commit."""
import json
import os
from pathlib import Path

import pytest

from dllm_engine import LLM
from dllm_engine.spec import parse_spec
from dllm_lab.tasks import load_split

ROOT = Path(__file__).resolve().parent.parent
FROZEN = Path(__file__).resolve().parent / "data" / "frozen_greedy.json"
TASKS = ["sort", "reverse", "sum", "add", "calc", "shop", "tally", "describe"]  # all three families
ALONE = [4]  # calc: one prompt also runs alone (tests/test_seeds.py checks more orders and batches)
MAX_NEW_TOKENS = 64
METHODS = {
    "tiny-llada": ["reference", "prefix-cache", "dual-cache", "dual-cache:commit_rule=credit",
                   "dual-cache:commit_rule=hierarchical", "dual-cache+focus", "dual-cache+delayed-cache",
                   "dual-cache+early-skip", "dual-cache+early-skip+adaptive-length", "dual-cache+adaptive-length",
                   "prefix-cache+jump-share", "dual-cache+adaptive-length+jump-share",
                   "dual-cache+jump-share:jump_share_layout=shared,jump_share_switch=current"],
    "tiny-sdar": ["block", "block:commit_rule=credit", "block:commit_rule=hierarchical", "block:preset=Q",
                  "block:preset=S", "block+focus", "block+delayed-cache", "block+adaptive-length",
                  "block+focus+adaptive-length"],
}
CASES = [(ckpt, spec) for ckpt, specs in METHODS.items() for spec in specs]


@pytest.fixture(scope="module")
def llms():
    return {name: LLM(str(ROOT / "checkpoints" / name)) for name in METHODS}


@pytest.fixture(scope="module")
def frozen():
    if os.environ.get("DLLM_FREEZE_TOKENS"):
        data: dict = {}
        yield data
        FROZEN.write_text("{\n" + ",\n".join(f"{json.dumps(k)}: {json.dumps(v)}" for k, v in sorted(data.items()))
                          + "\n}\n")
        return
    yield json.loads(FROZEN.read_text())


@pytest.mark.slow  # about 40 s: 22 methods, 8 prompts together and 1 alone
@pytest.mark.parametrize("ckpt,spec", CASES)
def test_greedy_tokens_alone_and_in_a_batch_of_eight_are_the_frozen_ones(llms, frozen, ckpt, spec):
    llm = llms[ckpt]
    params = parse_spec(spec, max_new_tokens=MAX_NEW_TOKENS, temperature=0.0)
    conversations = [ex.chat() for t in TASKS for ex in load_split([t], limit=1)]
    together = [o.token_ids for o in llm.chat(conversations, params)]
    alone = [llm.chat([conversations[i]], params)[0].token_ids for i in ALONE]
    key = f"{ckpt} {spec}"
    if os.environ.get("DLLM_FREEZE_TOKENS"):
        assert alone == [together[i] for i in ALONE], "batch invariance fails: nothing frozen"
        frozen[key] = together
        return
    assert together == frozen[key]
    assert alone == [frozen[key][i] for i in ALONE]


def test_the_frozen_file_covers_every_case():
    if os.environ.get("DLLM_FREEZE_TOKENS"):
        pytest.skip("writing the file")
    assert sorted(json.loads(FROZEN.read_text())) == sorted(f"{c} {s}" for c, s in CASES)
