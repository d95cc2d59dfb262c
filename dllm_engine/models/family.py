"""What a model family is to the engine: config keys, tensor names, attention pattern."""
from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Callable

from ..errors import UserError
from ..config import ModelConfig


@dataclass(frozen=True)
class Family:
    model_type: str
    config_from_hf: Callable[[dict], ModelConfig]  # config.json -> ModelConfig
    config_to_hf: Callable[[ModelConfig], dict]  # ModelConfig -> config.json (real keys)
    checkpoint_name: Callable[[str], str]  # our module name -> the checkpoint's tensor name
    methods: tuple[str, ...]  # base decoders the attention pattern supports
    # the tokenizer's names of the mask token and the end-of-turn token: looked up when the
    # config, generation_config.json and the tokenizer's mask_token leave the id out
    mask_token: str | None = None
    end_of_turn_token: str | None = None


def first_id(value: int | list[int] | None) -> int | None:
    """Configs store eos ids as an int or a list; the first one is the primary id."""
    if isinstance(value, list):
        return value[0] if value else None
    return value


def token_id(value, missing: int | None = -1) -> int | None:
    """A token id from a config or a tokenizer (the first when a list), as an int; ``missing``
    for null, absent, negative or not an integer."""
    value = first_id(value)
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        return missing
    return int(value)


def rope_settings(hf: dict) -> dict:
    """The RoPE settings: transformers 5's ``rope_parameters`` (rope_theta inside), else the
    top-level keys of older configs."""
    params = hf.get("rope_parameters")
    return params if isinstance(params, dict) else {}


def rope_theta(hf: dict, default: float = 10000.0) -> float:
    theta = hf.get("rope_theta")
    if theta is None:
        theta = rope_settings(hf).get("rope_theta")
    return float(theta) if theta is not None else default


# keys of a rope_scaling / rope_parameters dict that plain RoPE has too
PLAIN_ROPE_KEYS = {"rope_type", "type", "rope_theta", "partial_rotary_factor"}


def check_rope(hf: dict, model_type: str) -> None:
    """Refuse RoPE variants the engine does not implement (linear / dynamic / YaRN / llama3 ...
    scaling): it computes plain RoPE only, and would otherwise run the model with the wrong
    positions."""
    for key in ("rope_scaling", "rope_parameters"):
        value = hf.get(key)
        if not value:
            continue
        kind = value.get("rope_type", value.get("type", "default")) if isinstance(value, dict) else value
        scaled = key == "rope_scaling" and isinstance(value, dict) and set(value) - PLAIN_ROPE_KEYS
        if kind not in (None, "default") or scaled:
            raise UserError(f"{key} {value!r} is not supported for {model_type}: the engine "
                            f"implements plain RoPE only (rope_type 'default')")


def check_unsupported(hf: dict, model_type: str, refused: dict[str, Callable[[object], bool]]) -> None:
    """Refuse a config that sets a feature the engine does not implement: ``refused`` maps a key
    to the test its value fails (absent keys pass)."""
    for key, unsupported in refused.items():
        if key in hf and unsupported(hf[key]):
            raise UserError(f"{key}={hf[key]!r} is not supported for {model_type} (the engine "
                            f"does not implement it)")


def renamed_checkpoint_names(layer_prefix: str, layer_names: dict[str, str], top_names: dict[str, str],
                             strict: bool = True) -> Callable[[str], str]:
    """A ``checkpoint_name`` for layouts that rename modules: ``layers.N.<module>.<param>`` becomes
    ``<layer_prefix>.N.<layer_names[module]>.<param>`` and a top-level ``<module>.<param>`` becomes
    ``<top_names[module]>.<param>``. ``strict``: a layer module missing from ``layer_names`` is an
    error (every name is mapped); otherwise it keeps our name."""
    def checkpoint_name(name: str) -> str:
        parts = name.split(".")
        if parts[0] != "layers":
            return f"{top_names[parts[0]]}.{parts[-1]}"
        module, param = ".".join(parts[2:-1]), parts[-1]
        module = layer_names[module] if strict else layer_names.get(module, module)
        return f"{layer_prefix}.{parts[1]}.{module}.{param}"
    return checkpoint_name


def qwen_checkpoint_name(name: str) -> str:
    """Qwen2/Qwen3 layout: everything under ``model.`` except the untied LM head."""
    return name if name.startswith("lm_head.") else f"model.{name}"


def qwen_config_from_hf(hf: dict, **overrides) -> ModelConfig:
    """Shared by Dream (Qwen2) and SDAR (Qwen3): the Qwen config keys."""
    model_type = overrides.get("model_type", hf.get("model_type"))
    check_rope(hf, model_type)
    check_unsupported(hf, model_type, {"use_sliding_window": bool})
    fields = dict(
        model_type=hf["model_type"],
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=hf["num_attention_heads"],
        num_kv_heads=hf.get("num_key_value_heads", hf["num_attention_heads"]),
        intermediate_size=hf["intermediate_size"],
        head_dim=hf.get("head_dim") or 0,
        rope_theta=rope_theta(hf),
        rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        max_position_embeddings=hf.get("max_position_embeddings", 4096),
        mask_token_id=token_id(hf.get("mask_token_id")),
        eos_token_id=token_id(hf.get("eos_token_id")),
        pad_token_id=token_id(hf.get("pad_token_id")),
        bos_token_id=token_id(hf.get("bos_token_id"), None),
    )
    fields.update(overrides)
    return ModelConfig(**fields)


def qwen_config_to_hf(cfg: ModelConfig, **extra) -> dict:
    out = {
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads, "intermediate_size": cfg.intermediate_size,
        "head_dim": cfg.head_dim, "hidden_act": "silu", "rope_theta": cfg.rope_theta,
        "rms_norm_eps": cfg.rms_norm_eps, "tie_word_embeddings": cfg.tie_word_embeddings,
        "max_position_embeddings": cfg.max_position_embeddings,
        "mask_token_id": cfg.mask_token_id, "eos_token_id": cfg.eos_token_id,
        "pad_token_id": cfg.pad_token_id, "bos_token_id": cfg.bos_token_id,
        "torch_dtype": "float32", "use_cache": False,
    }
    out.update(extra)
    return out
