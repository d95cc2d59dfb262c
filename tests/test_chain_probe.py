"""The chain probe: result tokens found, the right masked from each, every prediction counted."""
from pathlib import Path

import pytest
import torch

from dllm_engine import LLM
from dllm_engine.eval.chain_probe import (chain_probe, copy_masked_rows, result_positions,
                                          right_masked_rows)
from dllm_engine.tasks import load_split
from fixtures import write_checkpoint

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
        assert 0 <= row.right_masked <= row.results and 0 <= row.causal <= row.results
        assert 0 <= row.copy_masked <= row.results
        assert 0 <= row.block_masked <= row.results


def test_block_masked_is_right_masked_for_a_block_causal_family():
    """SDAR's own attention is the block-causal view (its config's block size, not the
    argument's): the shipped tiny-sdar, which gets most results right, counts the same."""
    llm = LLM(CHECKPOINTS / "tiny-sdar")
    rows = chain_probe(llm, load_split(["sum", "story"], limit=2), block_size=8)
    assert all(r.block_masked == r.right_masked for r in rows.values())
    assert sum(r.right_masked for r in rows.values()) > 0


def test_block_masked_count_is_the_block_causal_forward():
    """A full-attention model's block-masked count, recomputed here one row at a time (the
    answer masked from the target on; a slot reads its own block and the ones before). The shipped
    tiny-llada gets some results right, so a wrong mask would change the count."""
    llm = LLM(CHECKPOINTS / "tiny-llada")
    tok, model = llm.tokenizer, llm.model
    examples = load_split(["sum", "add"], limit=2)
    vocab = tok.get_vocab()
    want = {"sum": 0, "add": 0}
    for ex in examples:
        prompt = tok.apply_chat_template([{"role": "user", "content": ex.prompt}],
                                         add_generation_prompt=True, tokenize=True, return_dict=False)
        answer = tok.encode(ex.answer, add_special_tokens=False)
        ids = list(prompt) + answer
        for i in result_positions(answer, vocab["="], vocab[","]):
            t = len(prompt) + i
            x = torch.tensor([ids[:t] + [llm.token_ids.mask_id] * (len(ids) - t)])
            n = x.shape[1]
            mask = torch.tensor([[j // 8 <= q // 8 for j in range(n)] for q in range(n)])[None, None]
            with torch.no_grad():
                hidden = model.forward_context(x, model.plain_context(x, mask))
            want[ex.task] += int(model.logits(hidden[0, t]).argmax() == ids[t])
    rows = chain_probe(llm, examples, block_size=8)
    assert {t: r.block_masked for t, r in rows.items()} == want
    assert sum(want.values()) > 0
    # a block holding the whole row is full attention: the right-masked count again
    wide = chain_probe(llm, examples, block_size=4096)
    assert {t: r.block_masked for t, r in wide.items()} == {t: r.right_masked for t, r in rows.items()}
