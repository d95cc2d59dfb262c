"""Per-request decoding options: the ``SamplingParams`` dataclass and the checks of each field
that need no model. What a field left ``None`` becomes on a model is ``resolve.py``'s job; the
``method[:field=value,...]`` strings of the command line and ``dllm bench`` are ``spec.py``'s."""
from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass, field

from .errors import UserError
from .methods import (COMMIT_RULES, DECODERS, JOINT_THRESHOLD, JOINT_THRESHOLD_PRESETS, STRATEGIES, CommitRuleSpec,
                      Decoder, base_name, check_commit_rule, check_method, strategy_names)

REMASKING = ("low_confidence", "maskgit_plus", "random", "topk_margin", "entropy")
UNMASKING = ("low_confidence_dynamic", "low_confidence_static")
BLOCK_STARTS = ("prefix", "last-commits", "canvas")  # early-skip: what a block's first step computes
JUMP_SHARE_SWITCHES = ("official", "current")  # jump-share: when a block moves from 4 to 8 copies
JUMP_SHARE_LAYOUTS = ("official", "shared")  # jump-share: what a copy of the block recomputes
MAX_SEED = 2**63  # torch.Generator.manual_seed takes a signed 64-bit integer
MAX_LOGPROBS = 20  # as OpenAI's top_logprobs
PROBABILITY_CONFIDENCES = ("low_confidence", "maskgit_plus")  # the softmax probability of the token


class ParamError(UserError):
    """A bad value of one SamplingParams field; ``param`` names it (the server's 400 says so)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass
class SamplingParams:
    method: str | None = None  # base decoder + strategies; None = dual-cache (full attention) / block
    max_new_tokens: int | None = None  # any cap: the canvas is rounded up to whole blocks, the answer cut
    block_length: int | None = None
    steps: int | None = None  # denoising steps per block (fixed-step rules); None = block_length
    threshold: float | None = None  # commit every masked position with confidence >= threshold
    factor: float | None = None  # Fast-dLLM factor rule
    temperature: float | None = None  # None = 0 (argmax) unless generation_config.json says otherwise
    top_p: float | None = None  # nucleus sampling of the sampled distribution (temperature > 0)
    top_k: int | None = None  # sample among the k most likely tokens (temperature > 0); 0 = all
    remasking: str = "low_confidence"
    unmasking: str | None = None  # block: low_confidence_dynamic (with threshold) | low_confidence_static
    cfg_scale: float = 0.0
    seed: int | None = None  # None: the next seed of the engine's stream (seeds.py, LLM(seed=...))
    n: int = 1  # answers per prompt; answer j samples with seed + j
    stop_token_ids: list[int] = field(default_factory=list)
    # end a sequence after the finished block holding the first stop token. None = yes, for every
    # decoder: a committed block never changes, so the text is the same either way. False decodes
    # the whole canvas, as LLaDA's generate.py and Fast-dLLM's prefix/dual caches do (parity runs
    # against them and the benchmark baselines ask for it); adaptive-length with False: its cut alone
    stop_at_eos: bool | None = None
    logprobs: int | None = None  # None = off; N >= 0: each output token's logprob and its top N
    record_steps: bool = False  # each output's ``steps``: one record per forward (engine/trace.py)
    # FOCUS token eviction (strategies/focus.py)
    focus_alpha: float = 1.5
    # ES-dLLM early skipping (strategies/early_skip.py)
    keep_fractions: tuple[float, ...] = (1.0, 0.5, 0.25)
    skip_depths: tuple[float, ...] = (0.0, 0.125, 0.25)
    skip_alpha: float = 0.5
    prompt_refresh: int | None = None  # steps between no-skip recomputes of [0, block end)
    block_refresh: int | None = None  # steps between steps that skip nothing
    skip_block_start: str = "prefix"  # a block's first step: prefix | last-commits | canvas
    delay_eos: bool = True  # ES-dLLM's delay_eos_generation (strategies/early_skip.py)
    # ODB-dLLM adaptive length (strategies/adaptive_length.py) and jump-share (jump_share.py)
    eos_threshold: float = 0.9
    min_length: int = 0
    max_copies: int = 8
    jump_share_switch: str = "official"  # official: decided after a step, with its lag; current: masks now
    jump_share_layout: str = "official"  # official: 4 copies hold the whole block; shared: masks only
    # a commit rule in place of the decoder's own (methods.COMMIT_RULES; decoding/credit.py,
    # hierarchical.py, joint_threshold.py). None = the decoder's. Setting ``preset`` or an
    # option of joint-threshold (``edit_threshold``, ``max_post_edit_steps``) selects it
    commit_rule: str | None = None
    credit_alpha: float = 0.7  # credit: weight of log(1 + credit) added to the logits
    credit_gamma: float = 0.2  # credit: a step's top-1 probability p adds p ** credit_gamma
    credit_beta: float = 0.8  # credit: decay of the credit per step
    low_threshold: float = 0.4  # hierarchical: a run's most confident mask commits above this
    edit_threshold: float | None = None  # joint-threshold: edit a committed token above this
    max_post_edit_steps: int | None = None  # joint-threshold: edit-only steps after a block unmasks
    preset: str | None = None  # joint-threshold's LLaDA2.1 modes: "S" (speedy) or "Q" (quality)

    def __post_init__(self) -> None:
        self.check_types()
        self.check_finite()
        self.check_method()
        self.check_counts()
        self.check_commit_rule()
        self.check_sampling()
        self.check_strategy_options()
        self.check_rule_options()
        self.check_int64()

    def check_types(self) -> None:
        """Each field holds what its annotation says, ``None`` only where it allows it: an int an
        integer (not a bool), a float a real number, a bool a bool, a list or tuple such items.
        Integers of other types (numpy's) become ``int``."""
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is None:
                if "None" in f.type:
                    continue
                raise ParamError(f.name, f"{f.name} must not be None ({field_kind(f.type)})")
            many, element = annotation(f.type)
            values = (value if isinstance(value, (list, tuple)) else None) if many else [value]
            if values is None or not all(type_ok(v, element) for v in values):
                raise ParamError(f.name, f"{f.name} must be {field_kind(f.type)}, got {value!r}")
            if element == "int":
                values = [int(v) for v in values]
                setattr(self, f.name, type(value)(values) if many else values[0])
        if any(i < 0 for i in self.stop_token_ids):
            raise ParamError("stop_token_ids", f"stop_token_ids must be token ids >= 0, got {self.stop_token_ids}")

    def check_int64(self) -> None:
        """Integers the bounds above left open reach torch as int64 (``min_length``, stop ids)."""
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            values = value if isinstance(value, (tuple, list)) else (value,)
            if any(isinstance(v, int) and not -MAX_SEED <= v < MAX_SEED for v in values):
                raise ParamError(f.name, f"{f.name} must fit in 64 bits, [-2**63, 2**63), got {value!r}")

    def check_finite(self) -> None:
        """NaN / inf are never a meaningful option (NaN compares False with every bound)."""
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            values = value if isinstance(value, (tuple, list)) else (value,)
            if any(isinstance(v, float) and not math.isfinite(v) for v in values):
                raise ParamError(f.name, f"{f.name} must be a finite number, got {value!r}")

    def check_method(self) -> None:
        if self.method == "":  # its type is checked in check_types
            raise ParamError("method", "method must be a non-empty string such as 'dual-cache'")
        if self.method is not None and self.decoder is None:
            raise ParamError("method", f"unknown method {self.base_method!r}; base decoders: "
                             f"{', '.join(DECODERS)}")
        for name in self.strategies:
            if name not in STRATEGIES:
                raise ParamError("method", f"unknown strategy {name!r} in method {self.method!r}; "
                                 f"available: {', '.join(STRATEGIES)}")
        if len(set(self.strategies)) != len(self.strategies):
            raise ParamError("method", f"method {self.method!r} names a strategy twice")
        if self.strategies:
            try:
                check_method(self.base_method, self.strategies)
            except UserError as e:
                raise ParamError("method", str(e)) from None

    def check_counts(self) -> None:
        for name in ("max_new_tokens", "block_length", "steps", "prompt_refresh", "block_refresh"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ParamError(name, f"{name} must be a positive integer, got {value!r}")
        if self.n < 1:
            raise ParamError("n", f"n must be an integer >= 1 (answers per prompt), got {self.n!r}")
        if self.seed is not None and not 0 <= self.seed < MAX_SEED:
            raise ParamError("seed", f"seed must be an integer in [0, 2**63), got {self.seed!r}")

    def check_commit_rule(self) -> None:
        if self.threshold is not None and not 0.0 < self.threshold <= 1.0:
            raise ParamError("threshold", f"threshold must be in (0, 1], got {self.threshold}")
        if self.factor is not None and self.factor <= 0:
            raise ParamError("factor", f"factor must be > 0, got {self.factor}")
        if self.threshold is not None and self.factor is not None:
            raise ParamError("threshold", "set either threshold or factor, not both")
        if self.remasking not in REMASKING:
            raise ParamError("remasking", f"remasking must be one of {', '.join(REMASKING)}, "
                             f"got {self.remasking!r}")
        if self.unmasking is not None and self.unmasking not in UNMASKING:
            raise ParamError("unmasking", f"unmasking must be one of {', '.join(UNMASKING)}, "
                             f"got {self.unmasking!r}")
        self.check_named_rule()

    def check_named_rule(self) -> None:
        """``commit_rule`` names a known rule (selected by joint-threshold's options when unset)
        that reads probabilities and a threshold, and runs on the method's base and strategies."""
        if self.commit_rule is None and (self.preset is not None or self.edit_threshold is not None
                                         or self.max_post_edit_steps is not None):
            self.commit_rule = JOINT_THRESHOLD.name
        if self.commit_rule is None:
            return
        if self.commit_rule not in COMMIT_RULES:
            raise ParamError("commit_rule", f"unknown commit_rule {self.commit_rule!r}; available: "
                             f"{', '.join(COMMIT_RULES)} (or none: the decoder's own)")
        if self.factor is not None:
            raise ParamError("factor", f"commit_rule {self.commit_rule!r} commits by threshold; drop factor")
        if self.remasking not in PROBABILITY_CONFIDENCES:
            raise ParamError("remasking", f"commit_rule {self.commit_rule!r} reads the token's probability "
                             f"(remasking low_confidence), not {self.remasking!r}")
        if self.unmasking == "low_confidence_static" and not self.rule.edits:
            raise ParamError("unmasking", f"commit_rule {self.commit_rule!r} commits by threshold, not by "
                             f"unmasking 'low_confidence_static'")
        if self.method is not None:
            try:
                check_commit_rule(self.base_method, self.strategies, self.commit_rule)
            except ValueError as e:
                raise ParamError("commit_rule", str(e)) from None

    def check_sampling(self) -> None:
        if self.temperature is not None and self.temperature < 0:
            raise ParamError("temperature", f"temperature must be >= 0, got {self.temperature}")
        if self.top_p is not None and not 0.0 < self.top_p <= 1.0:
            raise ParamError("top_p", f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k is not None and self.top_k < 0:
            raise ParamError("top_k", f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ParamError("logprobs", f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        if self.cfg_scale < 0:
            raise ParamError("cfg_scale", f"cfg_scale must be >= 0, got {self.cfg_scale}")

    def check_strategy_options(self) -> None:
        if self.focus_alpha < 1:
            raise ParamError("focus_alpha", f"focus_alpha must be >= 1, got {self.focus_alpha}")
        self.keep_fractions = tuple(float(x) for x in self.keep_fractions)
        self.skip_depths = tuple(float(x) for x in self.skip_depths)
        if len(self.keep_fractions) != len(self.skip_depths) or not self.keep_fractions:
            raise ParamError("keep_fractions", "keep_fractions and skip_depths must be non-empty "
                             "and of equal length")
        if any(not 0 < f <= 1 for f in self.keep_fractions):
            raise ParamError("keep_fractions", f"keep_fractions must be in (0, 1], got {self.keep_fractions}")
        if list(self.skip_depths) != sorted(self.skip_depths) or any(not 0 <= d < 1 for d in self.skip_depths):
            raise ParamError("skip_depths", f"skip_depths must be ascending in [0, 1), got {self.skip_depths}")
        if not 0 <= self.skip_alpha <= 1:
            raise ParamError("skip_alpha", f"skip_alpha must be in [0, 1], got {self.skip_alpha}")
        if self.skip_block_start not in BLOCK_STARTS:
            raise ParamError("skip_block_start", f"skip_block_start must be one of "
                             f"{', '.join(BLOCK_STARTS)}, got {self.skip_block_start!r}")
        if self.eos_threshold <= 0:
            raise ParamError("eos_threshold", f"eos_threshold must be > 0 (> 1 never cuts), "
                             f"got {self.eos_threshold}")
        if self.min_length < 0:
            raise ParamError("min_length", f"min_length must be >= 0, got {self.min_length}")
        if self.max_copies not in (1, 2, 4, 8):
            raise ParamError("max_copies", f"max_copies must be 1, 2, 4 or 8, got {self.max_copies}")
        for name, allowed in (("jump_share_switch", JUMP_SHARE_SWITCHES), ("jump_share_layout", JUMP_SHARE_LAYOUTS)):
            if getattr(self, name) not in allowed:
                raise ParamError(name, f"{name} must be one of {', '.join(allowed)}, got {getattr(self, name)!r}")

    def check_rule_options(self) -> None:
        """The commit rules' options: credit's weights, the hierarchical and edit thresholds, the
        post-edit budget, the preset; joint-threshold's options only with that rule."""
        for name, lo, hi in (("credit_alpha", 0.0, None), ("credit_gamma", 0.0, None), ("credit_beta", 0.0, 1.0),
                             ("low_threshold", 0.0, 1.0), ("edit_threshold", 0.0, 1.0)):
            value = getattr(self, name)
            if value is not None and not (lo <= value and (hi is None or value <= hi)):
                bound = f"in [{lo}, {hi}]" if hi is not None else f">= {lo}"
                raise ParamError(name, f"{name} must be {bound}, got {value}")
        if self.max_post_edit_steps is not None and self.max_post_edit_steps < 0:
            raise ParamError("max_post_edit_steps", f"max_post_edit_steps must be >= 0, got {self.max_post_edit_steps}")
        if self.preset is not None and self.preset not in JOINT_THRESHOLD_PRESETS:
            raise ParamError("preset", f"preset must be one of {', '.join(JOINT_THRESHOLD_PRESETS)} "
                             f"(LLaDA2.1's speedy / quality modes), got {self.preset!r}")
        if self.commit_rule is not None and not self.rule.edits:
            given = [n for n in ("preset", "edit_threshold", "max_post_edit_steps") if getattr(self, n) is not None]
            if given:
                raise ParamError(given[0], f"{given[0]} is an option of commit_rule {JOINT_THRESHOLD.name!r}, "
                                 f"not of {self.commit_rule!r}")

    @property
    def rule(self) -> CommitRuleSpec | None:
        """The commit rule picked in place of the decoder's (``methods.COMMIT_RULES``); None: the
        decoder's own."""
        return COMMIT_RULES.get(self.commit_rule) if self.commit_rule is not None else None

    @property
    def base_method(self) -> str | None:
        return base_name(self.method)

    @property
    def decoder(self) -> Decoder | None:
        """The base decoder's properties (``methods.DECODERS``); None while ``method`` is unset."""
        return DECODERS.get(self.base_method)

    @property
    def strategies(self) -> list[str]:
        return strategy_names(self.method)

    @property
    def generation_slots(self) -> int:
        """Canvas slots after the prompt: max_new_tokens rounded up to whole blocks."""
        return -(-self.max_new_tokens // self.block_length) * self.block_length

    def replace(self, **changes) -> "SamplingParams":
        return dataclasses.replace(self, **changes)

    def describe(self) -> str:
        """The resolved options that shape this method's run: ``dual-cache threshold=0.9 ...``."""
        unmasking = self.decoder is not None and self.decoder.unmasking
        names = ["max_new_tokens", "block_length", "unmasking" if unmasking else "remasking",
                 "threshold", "factor", "temperature", "seed", "stop_at_eos"]
        if unmasking or (self.threshold is None and self.factor is None):
            names.insert(2, "steps")  # fixed-k, or block's minimum per step
        if self.temperature:  # top-p / top-k act on sampling only
            after = names.index("temperature") + 1
            names[after:after] = ["top_p", "top_k"]
        names += ["cfg_scale"] * bool(self.cfg_scale) + ["logprobs"] * (self.logprobs is not None) + ["n"] * (self.n > 1)
        names += [o for s in self.strategies for o in STRATEGIES[s].options]
        if self.rule is not None:
            names += ["commit_rule", "preset"] + [o for o in self.rule.options if o not in names]
        values = [(n, getattr(self, n)) for n in names]
        return " ".join([self.method or "<unresolved>"] + [f"{n}={spec_value(v)}" for n, v in values
                                                            if v is not None])


def annotation(hint: str) -> tuple[bool, str]:
    """(a list or tuple?, the element type: int, float, str or bool) of a field's annotation
    string, ``None`` dropped: ``"tuple[float, ...]"`` -> (True, "float")."""
    kind = hint.replace(" | None", "")
    if kind.startswith(("list[", "tuple[")):
        return True, kind[kind.index("[") + 1:].split(",")[0].rstrip("]")
    return False, kind


def type_ok(value, kind: str) -> bool:
    """``value`` is of the element type ``kind`` (a bool is neither an int nor a float)."""
    if kind == "bool" or isinstance(value, bool):
        return isinstance(value, bool) and kind == "bool"
    if kind == "int":
        return isinstance(value, numbers.Integral)
    if kind == "float":
        return isinstance(value, numbers.Real)
    return isinstance(value, str)


def field_kind(hint: str) -> str:
    """A field's annotation in words, for an error message."""
    many, element = annotation(hint)
    if many:
        return "a list of " + {"int": "integers", "float": "numbers"}[element]
    return {"int": "an integer", "float": "a number", "str": "a string", "bool": "true or false"}[element]


def spec_value(value) -> str:
    """A field value as bench specs write it (lists joined with ``/``)."""
    if isinstance(value, (tuple, list)):
        return "/".join(str(v) for v in value)
    return str(value)
