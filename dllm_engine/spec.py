"""Bench specs: ``method[:field=value,...]`` strings (``dual-cache+early-skip:threshold=0.9``) as
``dllm bench``, ``dllm profile``, ``--method`` and lm-eval's model_args write them, parsed into
``SamplingParams``."""
from __future__ import annotations

import dataclasses

from .errors import UserError
from .sampling_params import SamplingParams

FIELD_TYPES = {f.name: f.type for f in dataclasses.fields(SamplingParams)}


def convert(name: str, raw: str) -> object:
    """One field's value as a spec writes it (lists joined with ``/``, ``none`` for None) in the
    field's type; ValueError when it is not one."""
    kind = str(FIELD_TYPES[name])
    if raw.lower() == "none":
        return None
    if "tuple" in kind:
        return tuple(float(x) for x in raw.split("/"))
    if "list[int]" in kind:
        return [int(x) for x in raw.split("/")]
    if "bool" in kind:
        if raw.lower() not in ("1", "true", "yes", "0", "false", "no"):
            raise UserError(raw)
        return raw.lower() in ("1", "true", "yes")
    if "float" in kind:
        return float(raw)
    if "int" in kind:
        return int(raw)
    return raw


def parse_spec(spec: str, **defaults) -> SamplingParams:
    """``method[:field=value,...]`` -> SamplingParams (``defaults`` fill fields the spec omits)."""
    method, _, rest = spec.partition(":")
    fields = dict(defaults)
    for item in filter(None, rest.split(",")):
        name, eq, raw = item.partition("=")
        if not eq or name not in FIELD_TYPES or name == "method":
            raise UserError(f"bad field {item!r} in spec {spec!r}; expected field=value with a "
                            f"SamplingParams field")
        try:
            fields[name] = convert(name, raw)
        except ValueError:
            raise UserError(f"bad value {raw!r} for {name} in spec {spec!r}") from None
    return SamplingParams(method=method or None, **fields)
