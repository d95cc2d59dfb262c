"""The vocabulary of a method string (``dual-cache+early-skip``): the base decoders, as plain data.

This module owns the decoders. Every caller asks a ``Decoder`` what it does (is its attention
block-causal? does it reuse the cache? which commit rule is its default?) and never compares its
name. It imports nothing from the package, so validating a method string reads data only.

| decoder      | step 0 of a block        | later steps               | commit rule                  |
|--------------|--------------------------|---------------------------|------------------------------|
| reference    | whole canvas             | whole canvas              | fixed-k / threshold / factor |
| prefix-cache | whole canvas             | block + suffix            | same                         |
| dual-cache   | whole canvas             | block only                | same                         |
| block        | positions not yet cached | positions not yet cached  | low_confidence_dynamic/static|
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Decoder:
    """One base decoder: the properties the engine, the parameter checks and the integrations
    switch on."""
    name: str
    # block diffusion (SDAR): attention is block-causal, blocks are aligned to position 0, and a
    # block's K/V are cached once it is final; otherwise full attention over the whole canvas
    block_causal: bool
    reuses_cache: bool  # a block's later steps read cached K/V (False: recompute the canvas)
    recomputes_suffix: bool  # ... and recompute the canvas after the block (Fast-dLLM's prefix cache)
    fixed_steps: bool  # default commit rule: fixed steps per block (else a confidence threshold)
    unmasking: bool  # commits by SDAR's unmasking rule (``unmasking``), not LLaDA's ``remasking``
    stops_at_eos: bool  # default of ``stop_at_eos``: end after a finished block holding EOS
    supports_cfg: bool  # classifier-free guidance (``cfg_scale``)
    supports_factor: bool  # Fast-dLLM's factor commit rule
    family_default: bool  # the default decoder of the models whose attention pattern runs it


REFERENCE = Decoder("reference", block_causal=False, reuses_cache=False, recomputes_suffix=False,
                    fixed_steps=True, unmasking=False, stops_at_eos=False, supports_cfg=True,
                    supports_factor=True, family_default=False)
PREFIX_CACHE = Decoder("prefix-cache", block_causal=False, reuses_cache=True, recomputes_suffix=True,
                       fixed_steps=False, unmasking=False, stops_at_eos=False, supports_cfg=False,
                       supports_factor=True, family_default=False)
DUAL_CACHE = Decoder("dual-cache", block_causal=False, reuses_cache=True, recomputes_suffix=False,
                     fixed_steps=False, unmasking=False, stops_at_eos=False, supports_cfg=False,
                     supports_factor=True, family_default=True)
BLOCK = Decoder("block", block_causal=True, reuses_cache=True, recomputes_suffix=False,
                fixed_steps=False, unmasking=True, stops_at_eos=True, supports_cfg=False,
                supports_factor=False, family_default=True)

DECODERS: dict[str, Decoder] = {d.name: d for d in (REFERENCE, PREFIX_CACHE, DUAL_CACHE, BLOCK)}
# the decoders each attention pattern runs (``Family.methods``)
FULL_ATTENTION_METHODS = tuple(d.name for d in DECODERS.values() if not d.block_causal)
BLOCK_METHODS = tuple(d.name for d in DECODERS.values() if d.block_causal)


def base_name(method: str | None) -> str | None:
    """The base decoder's name of a method string: ``dual-cache+early-skip`` -> ``dual-cache``."""
    return method.split("+")[0] if method else None


def strategy_names(method: str | None) -> list[str]:
    """The strategies of a method string, in its order: ``dual-cache+early-skip`` -> [early-skip]."""
    return method.split("+")[1:] if method else []


def default_decoder(methods: tuple[str, ...]) -> str:
    """A model's default decoder among those its attention pattern runs: ``block`` for block
    diffusion, else ``dual-cache``."""
    return next((n for n in methods if n in DECODERS and DECODERS[n].family_default), DUAL_CACHE.name)
