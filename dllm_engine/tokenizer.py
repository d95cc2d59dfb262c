"""A checkpoint's tokenizer from its own files (``load_tokenizer``), without running its code.

The embedded checkpoints' word-level tokenizer was written by the lab (``dllm_lab.tokenizer``);
it loads here as any released checkpoint's does.
"""
from __future__ import annotations

import json
from pathlib import Path

from tokenizers import AddedToken, Tokenizer

from .errors import UserError

# The special-token keys of tokenizer_config.json / special_tokens_map.json.
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                      "mask_token")
# Qwen2's pre-tokenizer split (the published GPT-4-style pattern of Qwen2 / Qwen2.5 / Dream).
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")


def load_tokenizer(folder: str | Path):
    """The checkpoint's tokenizer, or None (with one warning saying why) when it cannot be
    loaded: token-id prompts still work without one.

    Remote code is never run. A tokenizer_config.json that names a custom class (Dream's
    ``DreamTokenizer`` with ``auto_map``) is read without it: ``tokenizer.json``, or Qwen2's
    byte-level BPE from ``vocab.json`` + ``merges.txt``, with the special and added tokens and
    the chat template of tokenizer_config.json (``tokenizer_without_code``)."""
    import warnings

    from transformers import AutoTokenizer, PretrainedConfig

    folder = Path(folder)
    try:
        # an empty config: the tokenizer files name their class, and transformers would otherwise
        # read config.json and warn that it does not know the engine's model_type
        return AutoTokenizer.from_pretrained(str(folder), local_files_only=True, trust_remote_code=False,
                                             config=PretrainedConfig())
    except Exception as e:  # tokenizers / transformers raise many types for a broken file
        error = one_line(e)
    try:
        return tokenizer_without_code(folder)
    except Exception as e:
        warnings.warn(f"{folder}: the tokenizer cannot be loaded ({error}; from its files alone: "
                      f"{one_line(e)}); continuing without one: token-id prompts work, text "
                      f"prompts and chat do not", stacklevel=3)
        return None


def one_line(error: Exception) -> str:
    """``error``'s type and the first line of its message."""
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}".rstrip(": ")


def read_tokenizer_config(folder: Path) -> dict:
    """tokenizer_config.json, with special_tokens_map.json's tokens where it leaves them out."""
    config: dict = {}
    for name in ("special_tokens_map.json", "tokenizer_config.json"):
        file = folder / name
        if file.is_file():
            value = json.loads(file.read_text(encoding="utf-8"))
            if not isinstance(value, dict):
                raise UserError(f"{file}: expected a JSON object")
            config.update({k: v for k, v in value.items() if v is not None or k not in config})
    return config


def token_content(value) -> str | None:
    """A special token as configs store it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def declared_added_tokens(folder: Path, config: dict) -> dict[int, AddedToken]:
    """id -> token of tokenizer_config.json's ``added_tokens_decoder`` and added_tokens.json."""
    tokens: dict[int, AddedToken] = {}
    file = folder / "added_tokens.json"
    if file.is_file():
        for content, i in json.loads(file.read_text(encoding="utf-8")).items():
            tokens[int(i)] = AddedToken(content, special=True, normalized=False)
    for i, spec in (config.get("added_tokens_decoder") or {}).items():
        content = token_content(spec)
        if content is None:
            continue
        spec = spec if isinstance(spec, dict) else {}
        tokens[int(i)] = AddedToken(content, special=spec.get("special", True),
                                    single_word=spec.get("single_word", False),
                                    lstrip=spec.get("lstrip", False), rstrip=spec.get("rstrip", False),
                                    normalized=spec.get("normalized", False))
    return tokens


def qwen2_bpe(folder: Path, added: dict[int, AddedToken]) -> Tokenizer:
    """Qwen2's byte-level BPE (NFC, its split pattern, byte-level pre-tokenizer and decoder) from
    vocab.json + merges.txt; the added tokens take their declared ids."""
    from tokenizers import Regex, decoders, normalizers, pre_tokenizers
    from tokenizers.models import BPE

    vocab = json.loads((folder / "vocab.json").read_text(encoding="utf-8"))
    lines = (folder / "merges.txt").read_text(encoding="utf-8").splitlines()
    merges = [tuple(line.split(" ")) for line in lines if line and not line.startswith("#version")]
    taken = {i: t for t, i in vocab.items()}
    for i, token in added.items():
        if taken.get(i, token.content) != token.content:
            raise UserError(f"added token {token.content!r} has id {i}, which vocab.json gives "
                            f"to {taken[i]!r}")
        vocab[token.content] = i
    tok = Tokenizer(BPE(vocab=vocab, merges=merges, unk_token=None, continuing_subword_prefix="",
                        end_of_word_suffix="", fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    return tok


def tokenizer_without_code(folder: Path):
    """A fast tokenizer from the checkpoint's files alone (see ``load_tokenizer``)."""
    from transformers import PreTrainedTokenizerFast

    config = read_tokenizer_config(folder)
    added = declared_added_tokens(folder, config)
    if (folder / "tokenizer.json").is_file():
        backend = Tokenizer.from_file(str(folder / "tokenizer.json"))
    elif (folder / "vocab.json").is_file() and (folder / "merges.txt").is_file():
        backend = qwen2_bpe(folder, added)
    else:
        raise UserError("no tokenizer.json, nor vocab.json + merges.txt")
    for i, token in sorted(added.items()):  # in the vocabulary already: declared (special) again
        (backend.add_special_tokens if token.special else backend.add_tokens)([token])
        if backend.token_to_id(token.content) != i:
            raise UserError(f"added token {token.content!r} is declared with id {i} but gets "
                            f"{backend.token_to_id(token.content)}")
    options = {k: token_content(config.get(k)) for k in SPECIAL_TOKEN_KEYS}
    options = {k: v for k, v in options.items() if v is not None}
    if isinstance(config.get("model_max_length"), int):
        options["model_max_length"] = config["model_max_length"]
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend, **options,
        clean_up_tokenization_spaces=bool(config.get("clean_up_tokenization_spaces", False)))
    template = config.get("chat_template")
    if (folder / "chat_template.jinja").is_file():
        template = (folder / "chat_template.jinja").read_text(encoding="utf-8")
    if isinstance(template, list):  # [{"name": ..., "template": ...}]
        template = {t["name"]: t["template"] for t in template}
    if template:
        tok.chat_template = template
    return tok
