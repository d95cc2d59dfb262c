"""Tests for the word-level tokenizer and its Hugging Face save layout."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from dllm_lab.tasks import load_split
from dllm_lab.tokenizer import (FAMILY_TOKENIZER_CONFIG, SPECIAL_TOKENS, build_tokenizer,
                                save_tokenizer, tokenizer_config, vocabulary)

pytestmark = pytest.mark.lab  # the lab's task suite and tokenizer builder (dllm_lab)

MESSAGES = [{"role": "system", "content": "sort : 1"},
            {"role": "user", "content": "lookup : a = 3 , b = 4 ? a b a b"}]
# Expected token sequence of MESSAGES with a generation prompt, per family.
EXPECTED = {
    "llada": ["<|startoftext|>",
              "<|start_header_id|>", "system", "<|end_header_id|>", "sort", ":", "1", "<|eot_id|>",
              "<|start_header_id|>", "user", "<|end_header_id|>", *MESSAGES[1]["content"].split(),
              "<|eot_id|>", "<|start_header_id|>", "assistant", "<|end_header_id|>"],
    "sdar": ["<|im_start|>", "system", "sort", ":", "1", "<|im_end|>",
             "<|im_start|>", "user", *MESSAGES[1]["content"].split(), "<|im_end|>",
             "<|im_start|>", "assistant"],
}
MASKS = {"llada": "<|mdm_mask|>", "sdar": "<|MASK|>"}


@pytest.fixture(scope="module")
def hf_tokenizers(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Both families saved to disk and reloaded through AutoTokenizer."""
    root = tmp_path_factory.mktemp("tok")
    return {fam: AutoTokenizer.from_pretrained(save_tokenizer(root / fam, fam))
            for fam in FAMILY_TOKENIZER_CONFIG}


def test_vocab_is_small_and_ids_are_fixed() -> None:
    tok = build_tokenizer()
    assert tok.get_vocab_size() == len(vocabulary()) < 256
    assert [tok.token_to_id(t) for t in SPECIAL_TOKENS] == list(range(len(SPECIAL_TOKENS)))
    assert len(set(vocabulary())) == len(vocabulary())


def test_round_trip_on_test_split() -> None:
    tok = build_tokenizer()
    unk = tok.token_to_id("<|unk|>")
    for ex in load_split():
        for text in (ex.prompt, ex.answer):
            ids = tok.encode(text).ids
            assert unk not in ids
            assert tok.decode(ids) == text
        assert len(tok.encode(ex.prompt).ids) <= 80


def test_unknown_word_maps_to_unk() -> None:
    tok = build_tokenizer()
    assert tok.encode("sort : banana").tokens == ["sort", ":", "<|unk|>"]


@pytest.mark.parametrize("family", sorted(FAMILY_TOKENIZER_CONFIG))
def test_saved_files(tmp_path: Path, family: str) -> None:
    save_tokenizer(tmp_path, family)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "special_tokens_map.json", "tokenizer.json", "tokenizer_config.json"]
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert config["mask_token"] == MASKS[family]
    assert "chat_template" in config and config["model_max_length"] > 0


@pytest.mark.parametrize("family", sorted(FAMILY_TOKENIZER_CONFIG))
def test_autotokenizer_special_ids(hf_tokenizers: dict, family: str) -> None:
    tok = hf_tokenizers[family]
    assert tok.mask_token == MASKS[family]
    assert tok.mask_token_id == tok.convert_tokens_to_ids(MASKS[family])
    assert tok.eos_token_id == tok.pad_token_id == tok.convert_tokens_to_ids("<|endoftext|>")
    assert tok.bos_token_id == tok.convert_tokens_to_ids("<|startoftext|>")
    assert tok.unk_token_id == tok.convert_tokens_to_ids("<|unk|>")
    assert tok.get_vocab() == hf_tokenizers["llada"].get_vocab()  # same ids in every family


@pytest.mark.parametrize("family", sorted(FAMILY_TOKENIZER_CONFIG))
def test_chat_template_token_ids(hf_tokenizers: dict, family: str) -> None:
    tok = hf_tokenizers[family]
    expected_ids = tok.convert_tokens_to_ids(EXPECTED[family])
    text = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    ids = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True,
                                  return_dict=False)
    assert ids == expected_ids
    assert tok(text, add_special_tokens=True)["input_ids"] == expected_ids  # no implicit bos
    assert text == " ".join(EXPECTED[family]) == tok.decode(ids)


@pytest.mark.parametrize("family", sorted(FAMILY_TOKENIZER_CONFIG))
def test_autotokenizer_decode(hf_tokenizers: dict, family: str) -> None:
    tok = hf_tokenizers[family]
    for ex in load_split(limit=10):
        ids = tok(ex.answer)["input_ids"]
        assert tok.decode(ids) == ex.answer  # no " ," -> "," clean-up
        masked = [tok.mask_token_id, *ids, tok.eos_token_id, tok.pad_token_id]
        assert tok.decode(masked, skip_special_tokens=True) == ex.answer


def test_unknown_family() -> None:
    with pytest.raises(ValueError, match=r"unknown tokenizer family 'dream'; known: \['llada', 'sdar'\]"):
        tokenizer_config("dream")
