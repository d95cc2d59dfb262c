"""The chain probe: result tokens found, the right masked from each, every prediction counted."""
from pathlib import Path

import pytest
import torch

from dllm_engine import LLM
from dllm_engine.eval.chain_probe import (chain_probe, copy_masked_rows, result_positions,
                                          right_masked_rows)
from dllm_engine.tasks import load_split
from fixtures import write_checkpoint

pytestmark = pytest.mark.slow  # probe runs over the held-out split

CHECKPOINTS = Path(__file__).resolve().parents[1] / "checkpoints"


def test_result_positions_are_the_tokens_between_open_and_close():
    # 3 + 5 = 8 , 8 + 2 = 1 0 , answer : 0   (ids stand for words; '=' is 9, ',' is 7)
    answer = [3, 1, 5, 9, 8, 7, 8, 1, 2, 9, 1, 0, 7, 4, 6, 0]
    assert result_positions(answer, 9, 7) == [4, 10, 11]
    assert result_positions([9, 5, 5], 9, 7) == [1, 2]  # a result running to the end
    assert result_positions([1, 2, 3], 9, 7) == []


def test_right_masked_rows_keep_the_prompt_and_the_answer_before_each_target():
    ids = torch.arange(10, 20)
    rows = right_masked_rows(ids, [6, 8], start=4, mask_id=-1)
    assert rows.tolist() == [[10, 11, 12, 13, 14, 15, -1, -1, -1, -1],
                             [10, 11, 12, 13, 14, 15, 16, 17, -1, -1]]


def test_copy_masked_rows_mask_the_result_through_its_copy_only():
    # 3 + 5 = 8 , 8 + 2 = 0 , 0   ('=' is 9, ',' is 7); results at 4 and 10
    ids = torch.tensor([3, 1, 5, 9, 8, 7, 8, 1, 2, 9, 0, 7, 0])
    rows = copy_masked_rows(ids, [4, 10], close_id=7, mask_id=-1)
    assert rows.tolist() == [[3, 1, 5, 9, -1, -1, -1, 1, 2, 9, 0, 7, 0],
                             [3, 1, 5, 9, 8, 7, 8, 1, 2, 9, -1, -1, -1]]
    # a last result with no ',' after it: masked to the end
    assert copy_masked_rows(ids[:11], [10], 7, -1).tolist() == [ids[:10].tolist() + [-1]]


@pytest.mark.parametrize("family", ["llada", "sdar"])
def test_chain_probe_counts_every_result_token(tmp_path, family):
    llm = LLM(write_checkpoint(tmp_path / family, family, vocab_size=128))  # the worked words too
    examples = load_split(["sum", "add"], limit=2)
    rows = chain_probe(llm, examples)
    vocab = llm.tokenizer.get_vocab()
    for task in ("sum", "add"):
        want = sum(len(result_positions(llm.tokenizer.encode(e.answer, add_special_tokens=False),
                                        vocab["="], vocab[","])) for e in examples if e.task == task)
        row = rows[task]
        assert row.results == want > 0
        # each count is a share of the results; their values are checked one row at a time
        # on the trained tiny-llada below (a random checkpoint predicts next to nothing)
        assert all(0 <= n <= row.results for n in (row.right_masked, row.causal, row.copy_masked,
                                                  row.block_masked))


def test_a_model_without_the_worked_words_is_refused_by_name(tmp_path):
    llm = LLM(write_checkpoint(tmp_path / "llada", "llada"))  # 96 ids: the copy suite's only
    with pytest.raises(ValueError, match=r"a prompt of task sum: prompt has token ids outside \[0, 96\)"):
        chain_probe(llm, load_split(["sum"], limit=1))


def test_block_masked_is_right_masked_for_a_block_causal_family():
    """SDAR's own attention is the block-causal view (its config's block size, not the
    argument's): the shipped tiny-sdar, which gets most results right, counts the same."""
    llm = LLM(CHECKPOINTS / "tiny-sdar")
    rows = chain_probe(llm, load_split(["sum", "story"], limit=2), block_size=8)
    assert all(r.block_masked == r.right_masked for r in rows.values())
    assert sum(r.right_masked for r in rows.values()) > 0


def test_counts_are_their_forwards_one_row_at_a_time():
    """Every count but the right-masked one, recomputed here one row at a time on the shipped
    tiny-llada (it gets some results right under each view, so a wrong mask or an off-by-one
    changes a count): block masked (the answer masked from the target on; a slot reads its own
    block of 8 and the ones before), copy masked (the target up to and including the token after
    the next ','), causal (the unmasked answer under a causal mask, read at t - 1)."""
    llm = LLM(CHECKPOINTS / "tiny-llada")
    tok, model = llm.tokenizer, llm.model
    examples = load_split(["sum", "add"], limit=2)
    vocab = tok.get_vocab()
    mask_id = llm.token_ids.mask_id

    def argmax_at(ids: list[int], mask: torch.Tensor | None, at: int) -> int:
        x = torch.tensor([ids])
        with torch.no_grad():
            hidden = model.forward_context(x, model.plain_context(x, mask))
        return int(model.logits(hidden[0, at]).argmax())

    want = {view: {"sum": 0, "add": 0} for view in ("block", "copy", "causal")}
    for ex in examples:
        prompt = tok.apply_chat_template([{"role": "user", "content": ex.prompt}],
                                         add_generation_prompt=True, tokenize=True, return_dict=False)
        answer = tok.encode(ex.answer, add_special_tokens=False)
        ids = list(prompt) + answer
        n = len(ids)
        blocks = torch.tensor([[j // 8 <= q // 8 for j in range(n)] for q in range(n)])[None, None]
        causal = torch.tensor([[j <= q for j in range(n)] for q in range(n)])[None, None]
        for i in result_positions(answer, vocab["="], vocab[","]):
            t = len(prompt) + i
            right = ids[:t] + [mask_id] * (n - t)
            want["block"][ex.task] += argmax_at(right, blocks, t) == ids[t]
            close = next((j for j in range(t + 1, n) if ids[j] == vocab[","]), None)
            end = n if close is None else min(close + 2, n)  # through the copy after ','
            copy = ids[:t] + [mask_id] * (end - t) + ids[end:]
            want["copy"][ex.task] += argmax_at(copy, None, t) == ids[t]
            want["causal"][ex.task] += argmax_at(ids, causal, t - 1) == ids[t]
    rows = chain_probe(llm, examples, block_size=8)
    assert {t: r.block_masked for t, r in rows.items()} == want["block"]
    assert {t: r.copy_masked for t, r in rows.items()} == want["copy"]
    assert {t: r.causal for t, r in rows.items()} == want["causal"]
    assert all(sum(counts.values()) > 0 for counts in want.values())
    # a block holding the whole row is full attention: the right-masked count again
    wide = chain_probe(llm, examples, block_size=4096)
    assert {t: r.block_masked for t, r in wide.items()} == {t: r.right_masked for t, r in rows.items()}
