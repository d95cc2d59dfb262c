"""The ONE place a request's defaults are resolved against a model.

``resolve_params`` fills every field a request left as ``None``: first from the checkpoint's
``generation_config.json``, then from the documented defaults below. The Python API, the CLI
(``generate`` / ``eval`` / ``bench`` / ``serve``) and every server request go through it, so a
method means the same thing everywhere, and ``SamplingParams.describe`` prints what will run."""
from __future__ import annotations

import logging
import warnings

from .errors import UserError
from .methods import (DECODERS, DEFAULT_PRESET, JOINT_THRESHOLD_PRESETS, STRATEGIES, check_commit_rule, check_method,
                      default_decoder)
from .sampling_params import ParamError, SamplingParams

log = logging.getLogger(__name__)

# The documented defaults (README "Python API"). The commit rule (threshold / factor / steps) is
# resolved as a whole: `reference` is LLaDA's fixed-step sampler (steps = block_length: one token
# per step); every other decoder commits by threshold DEFAULT_THRESHOLD (Fast-dLLM's parallel
# decoding, SDAR's low_confidence_dynamic).
# block_length: a block-causal model's trained block_size (config.json) instead, when it has one.
# seed: none here; a request without one takes its engine's next (seeds.py)
DEFAULTS = {"max_new_tokens": 128, "block_length": 32, "temperature": 0.0, "top_p": 1.0, "top_k": 0}
DEFAULT_THRESHOLD = 0.9
COMMIT_FIELDS = ("threshold", "factor", "steps")
# generation_config.json keys that are SamplingParams defaults (HF's own names where they exist)
GENERATION_CONFIG_FIELDS = ("method", "max_new_tokens", "block_length", "temperature", "top_p",
                            "top_k", *COMMIT_FIELDS)
SAMPLING_FIELDS = ("temperature", "top_p", "top_k")  # applied only with "do_sample": true


def generation_defaults(generation_config: dict | None) -> dict:
    """The SamplingParams defaults a checkpoint's generation_config.json sets, validated.

    Keys transformers also reads mean what they mean there: temperature / top_p / top_k apply
    only with ``do_sample`` true (absent means greedy, transformers' default; Qwen3-derived SDAR
    files carry 0.6 / 0.95 / 20 beside greedy decoding), and then temperature defaults to 1.0.
    ``steps`` is this engine's steps per block only when the file also sets ``block_length``,
    as the engine's own exports do; alone it is another sampler's count (Dream's 512 are the
    whole answer's steps) and is ignored. Null values count as absent."""
    raw = generation_config or {}
    gen = {k: v for k, v in raw.items() if k in GENERATION_CONFIG_FIELDS and v is not None}
    if raw.get("do_sample") is True:
        gen.setdefault("temperature", 1.0)
    else:
        ignored = {k: gen.pop(k) for k in SAMPLING_FIELDS if k in gen}
        if ignored:
            log.debug("generation_config.json: %s ignored: do_sample is not true (greedy)", ignored)
    if "steps" in gen and "block_length" not in gen:
        steps = gen.pop("steps")
        log.debug("generation_config.json: steps=%r ignored: without block_length it is not "
                  "this engine's steps per block", steps)
    try:
        SamplingParams(**gen)
    except UserError as e:
        raise UserError(f"generation_config.json: {e}") from None
    return gen


def resolve_commit_rule(params: SamplingParams, gen: dict) -> dict:
    """threshold / factor / steps as a whole: the request's, else the checkpoint's, else the
    method's default (fixed steps for ``reference``, threshold 0.9 for every other decoder)."""
    given = {k: getattr(params, k) for k in COMMIT_FIELDS if getattr(params, k) is not None}
    if given or params.unmasking == "low_confidence_static":
        rule = given
    else:
        rule = {k: gen[k] for k in COMMIT_FIELDS if k in gen}
        if not rule and not params.decoder.fixed_steps:
            rule = {"threshold": DEFAULT_THRESHOLD}
    if params.rule is not None and rule.get("threshold") is None:  # every named rule reads one
        rule = {**rule, "threshold": DEFAULT_THRESHOLD}
    if params.unmasking == "low_confidence_dynamic" and rule.get("threshold") is None:
        rule["threshold"] = DEFAULT_THRESHOLD
    return {k: rule.get(k) for k in COMMIT_FIELDS}


def resolve_preset(p: SamplingParams) -> dict:
    """A joint-threshold request's unset threshold, edit_threshold and max_post_edit_steps, from
    its ``preset`` (``DEFAULT_PRESET`` when none): the request's own values win, and the preset
    wins over the checkpoint's generation_config.json threshold (``methods.JOINT_THRESHOLD_PRESETS``)."""
    if p.rule is None or not p.rule.edits:
        return {}
    preset = p.preset or DEFAULT_PRESET
    values = {k: v for k, v in JOINT_THRESHOLD_PRESETS[preset].items() if getattr(p, k) is None}
    return {"preset": preset, **values}


def resolve_params(params: SamplingParams, methods: tuple[str, ...],
                   generation_config: dict | None = None, logit_shift: int = 0,
                   block_size: int | None = None) -> SamplingParams:
    """Every field filled, in one order: the request's value, the checkpoint's
    generation_config.json, the documented default. ``methods``: the base decoders the model's
    attention pattern supports; ``logit_shift``: the model's (Dream: 1); ``block_size``: the
    trained block size of a block-causal model (config.json's), which is then the default
    ``block_length`` (another one runs, with one warning). Raises ValueError for anything this
    model cannot run."""
    gen = generation_defaults(generation_config)
    defaults = {**DEFAULTS, "block_length": block_size or DEFAULTS["block_length"]}
    filled = {k: gen.get(k, defaults.get(k)) for k in ("max_new_tokens", "block_length", "temperature",
                                                       "top_p", "top_k") if getattr(params, k) is None}
    p = params.replace(method=params.method or gen.get("method") or default_decoder(methods), **filled)
    p = p.replace(**resolve_preset(p))
    p = p.replace(**resolve_commit_rule(p, gen))
    check_against_model(p, methods, logit_shift)
    if block_size is not None and p.block_length != block_size:
        warn_block_length(p.block_length, block_size)
    if p.stop_at_eos is None:  # a committed block never changes: the text is the same either way
        p.stop_at_eos = True
    if p.steps is None:
        p.steps = p.block_length
    if p.steps > p.block_length:
        raise ParamError("steps", f"steps {p.steps} must be <= block_length {p.block_length}")
    if p.decoder.unmasking:
        p.unmasking = p.unmasking or ("low_confidence_dynamic" if p.threshold is not None
                                      else "low_confidence_static")
    return p


def warn_block_length(block_length: int, block_size: int) -> None:
    """One warning per value (``warnings``' default filter): block-causal attention follows
    ``block_length``, so another value runs the model on blocks it was not trained on."""
    warnings.warn(f"block_length {block_length} differs from the block size this model was trained "
                  f"with ({block_size}, config.json's block_size): attention runs bidirectionally "
                  f"over blocks of {block_length}; leave block_length unset to use {block_size}",
                  BlockLengthWarning)


class BlockLengthWarning(UserWarning):
    """A block-causal model runs with a ``block_length`` other than its trained block size."""


def trained_block_size(config) -> int | None:
    """A block-causal model's trained block size (``ModelConfig.block_size``); None for full attention."""
    return config.block_size if config.is_block_causal else None


def check_against_model(p: SamplingParams, methods: tuple[str, ...], logit_shift: int = 0) -> None:
    """What depends on the model: its attention pattern's decoders and the method's strategies
    (their bases, how they combine, the logit shift)."""
    if p.base_method not in methods:
        raise ParamError("method", f"method {p.base_method!r} cannot run on this model's attention "
                         f"pattern; use one of {', '.join(methods)}")
    if p.cfg_scale > 0 and not p.decoder.supports_cfg:
        only = ", ".join(repr(name) for name, d in DECODERS.items() if d.supports_cfg)
        raise ParamError("cfg_scale", f"cfg_scale > 0 is supported by the {only} decoder only")
    no_logprobs = [STRATEGIES[s] for s in p.strategies if STRATEGIES[s].no_logprobs]
    if p.logprobs is not None and no_logprobs:
        raise ParamError("logprobs", f"logprobs are not recorded by {no_logprobs[0].name} "
                         f"({no_logprobs[0].no_logprobs}); drop one of them")
    if p.factor is not None and not p.decoder.supports_factor:
        rule_of = " / ".join(name for name, d in DECODERS.items() if d.supports_factor)
        raise ParamError("factor", f"factor is a rule of {rule_of}; {p.base_method} commits by "
                         f"threshold or steps")
    try:
        check_method(p.base_method, p.strategies, logit_shift)
    except UserError as e:
        raise ParamError("method", str(e)) from None
    try:
        check_commit_rule(p.base_method, p.strategies, p.commit_rule)
    except ValueError as e:
        raise ParamError("commit_rule", str(e)) from None


def check_prompt(p: SamplingParams, prompt_len: int, max_context: int) -> None:
    """What depends on the prompt: it is not empty and it fits the context with its canvas."""
    if prompt_len < 1:
        raise ParamError("prompt", "prompt is empty")
    if prompt_len + p.generation_slots > max_context:
        raise ParamError("max_new_tokens",
                         f"max_new_tokens ({p.max_new_tokens}, {p.generation_slots} canvas slots in "
                         f"blocks of {p.block_length}) + the prompt ({prompt_len} tokens) exceed the "
                         f"model's context of {max_context} tokens; lower max_new_tokens or "
                         f"shorten the prompt")
