"""What a model family is to the engine: config keys, tensor names, attention pattern."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ..config import ModelConfig


@dataclass(frozen=True)
class Family:
    model_type: str
    config_from_hf: Callable[[dict], ModelConfig]  # config.json -> ModelConfig
    config_to_hf: Callable[[ModelConfig], dict]  # ModelConfig -> config.json (real keys)
    checkpoint_name: Callable[[str], str]  # our module name -> the checkpoint's tensor name
    methods: tuple[str, ...]  # base decoders the attention pattern supports


FULL_ATTENTION_METHODS = ("reference", "prefix-cache", "dual-cache")
BLOCK_METHODS = ("block",)


def first_id(value: int | list[int] | None) -> int | None:
    """Configs store eos ids as an int or a list; the first one is the primary id."""
    if isinstance(value, list):
        return value[0] if value else None
    return value


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
    fields = dict(
        model_type=hf["model_type"],
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=hf["num_attention_heads"],
        num_kv_heads=hf.get("num_key_value_heads", hf["num_attention_heads"]),
        intermediate_size=hf["intermediate_size"],
        head_dim=hf.get("head_dim") or 0,
        rope_theta=hf.get("rope_theta", 10000.0),
        rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
        tie_word_embeddings=hf.get("tie_word_embeddings", False),
        max_position_embeddings=hf.get("max_position_embeddings", 4096),
        mask_token_id=hf.get("mask_token_id", -1),
        eos_token_id=first_id(hf.get("eos_token_id")) if hf.get("eos_token_id") is not None else -1,
        pad_token_id=hf.get("pad_token_id") if hf.get("pad_token_id") is not None else -1,
        bos_token_id=first_id(hf.get("bos_token_id")),
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
