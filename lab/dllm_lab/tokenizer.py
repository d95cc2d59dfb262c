"""The word-level tokenizer of the task suite, saved in Hugging Face layout: what the embedded
checkpoints' tokenizer files were written with (``dllm train``); the engine reads them back as any
checkpoint's (``dllm_engine.tokenizer.load_tokenizer``).

One ``tokenizer.json`` serves every model family, so token ids are identical across
families; only ``tokenizer_config.json`` differs (mask token and chat template). Chat
templates use special tokens and single spaces only: the ``WhitespaceSplit``
pre-tokenizer drops newlines, and with space-joined templates the rendered prompt
equals ``decode(ids, skip_special_tokens=False)`` exactly.
"""
from __future__ import annotations

import json
from pathlib import Path

from tokenizers import AddedToken, Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import WhitespaceSplit

from dllm_engine.errors import UserError

from .tasks.registry import VOCAB

PAD, UNK, BOS, EOS = "<|pad|>", "<|unk|>", "<|startoftext|>", "<|endoftext|>"
LLADA_MASK, SDAR_MASK = "<|mdm_mask|>", "<|MASK|>"
# Order fixes the ids: 0 pad, 1 unk, 2 bos, 3 eos, 4 llada mask, ..., 10 sdar mask.
SPECIAL_TOKENS: tuple[str, ...] = (
    PAD, UNK, BOS, EOS, LLADA_MASK,
    "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
    "<|im_start|>", "<|im_end|>", SDAR_MASK)
ROLE_WORDS: tuple[str, ...] = ("system", "user", "assistant")
MODEL_MAX_LENGTH = 1024

LLADA_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    " <|start_header_id|> {{ message['role'] }} <|end_header_id|> {{ message['content'] }} <|eot_id|>"
    "{% endfor %}"
    "{% if add_generation_prompt %} <|start_header_id|> assistant <|end_header_id|>{% endif %}")
SDAR_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if not loop.first %} {% endif %}"
    "<|im_start|> {{ message['role'] }} {{ message['content'] }} <|im_end|>"
    "{% endfor %}"
    "{% if add_generation_prompt %} <|im_start|> assistant{% endif %}")

# family -> its tokenizer_config.json fields that differ (mask token, chat template); not
# models.FAMILIES, which maps a model_type to its Family (config mapping, names, methods)
FAMILY_TOKENIZER_CONFIG: dict[str, dict[str, str]] = {
    "llada": {"mask_token": LLADA_MASK, "chat_template": LLADA_CHAT_TEMPLATE},
    "sdar": {"mask_token": SDAR_MASK, "chat_template": SDAR_CHAT_TEMPLATE},
}


def vocabulary() -> list[str]:
    """All tokens in id order: specials, chat role words, then every task word."""
    return [*SPECIAL_TOKENS, *ROLE_WORDS, *VOCAB]


def build_tokenizer() -> Tokenizer:
    """Build the WordLevel tokenizer.

    No decoder is set on purpose: ``tokenizers`` then joins tokens with single spaces,
    which is exactly the inverse of ``WhitespaceSplit`` on single-spaced text. No
    post-processor either, so encoding never inserts bos/eos implicitly.
    """
    vocab = {tok: i for i, tok in enumerate(vocabulary())}
    tok = Tokenizer(WordLevel(vocab, unk_token=UNK))
    tok.pre_tokenizer = WhitespaceSplit()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    return tok


def tokenizer_config(family: str) -> dict:
    """The ``tokenizer_config.json`` contents for ``family`` ("llada" or "sdar")."""
    if family not in FAMILY_TOKENIZER_CONFIG:
        raise UserError(f"unknown tokenizer family {family!r}; "
                        f"known: {sorted(FAMILY_TOKENIZER_CONFIG)}")
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": EOS,  # both real models pad with eos
        "unk_token": UNK,
        **FAMILY_TOKENIZER_CONFIG[family],
        "model_max_length": MODEL_MAX_LENGTH,
        # transformers would otherwise glue " ," and " ?" onto the previous word.
        "clean_up_tokenization_spaces": False,
        "add_bos_token": False,
        "add_eos_token": False,
    }


def save_tokenizer(dir: str | Path, family: str) -> Path:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json to ``dir``.

    The result loads offline with ``transformers.AutoTokenizer.from_pretrained(dir)``.
    """
    config = tokenizer_config(family)
    out = Path(dir)
    out.mkdir(parents=True, exist_ok=True)
    build_tokenizer().save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    special = {k: config[k] for k in ("bos_token", "eos_token", "pad_token", "unk_token", "mask_token")}
    (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")
    return out
