"""Per-request decoding options. Fields left as ``None`` are filled from the checkpoint's
``generation_config.json``, then from family defaults (``resolve``)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from .strategies.registry import REGISTRY

BASE_METHODS = ("reference", "prefix-cache", "dual-cache", "block")
REMASKING = ("low_confidence", "maskgit_plus", "random", "topk_margin", "entropy")
UNMASKING = ("low_confidence_dynamic", "low_confidence_static")
BLOCK_STARTS = ("prefix", "last-commits", "canvas")  # early-skip: what a block's first step computes


@dataclass
class SamplingParams:
    method: str | None = None  # base decoder + strategies; None = the family's reference decoder
    max_new_tokens: int | None = None
    block_length: int | None = None
    steps: int | None = None  # denoising steps per block (fixed-step rules); None = block_length
    threshold: float | None = None  # commit every masked position with confidence >= threshold
    factor: float | None = None  # Fast-dLLM factor rule
    temperature: float = 0.0
    remasking: str = "low_confidence"
    unmasking: str | None = None  # block: low_confidence_dynamic (default) | low_confidence_static
    cfg_scale: float = 0.0
    seed: int = 0
    stop_token_ids: list[int] = field(default_factory=list)
    # end a sequence after a finished block that holds a stop token. None = the decoder's own
    # behaviour: SDAR-style `block` and `adaptive-length` stop (SPEC §3, §6); LLaDA's generate.py and
    # Fast-dLLM's prefix/dual caches decode the whole canvas, so `reference`, `prefix-cache` and
    # `dual-cache` do too unless asked (adaptive-length with False: the canvas cut alone)
    stop_at_eos: bool | None = None
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

    def __post_init__(self) -> None:
        if self.method is not None and (not isinstance(self.method, str) or not self.method):
            raise ValueError("method must be a non-empty string such as 'dual-cache'")
        if self.method is not None and self.base_method not in BASE_METHODS:
            raise ValueError(f"unknown method {self.base_method!r}; base decoders: {', '.join(BASE_METHODS)}")
        for name in ("max_new_tokens", "block_length"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.steps is not None and (not isinstance(self.steps, int) or self.steps < 1):
            raise ValueError(f"steps must be >= 1, got {self.steps!r}")
        if self.threshold is not None and not 0.0 < self.threshold <= 1.0:
            raise ValueError(f"threshold must be in (0, 1], got {self.threshold}")
        if self.factor is not None and self.factor <= 0:
            raise ValueError(f"factor must be > 0, got {self.factor}")
        if self.threshold is not None and self.factor is not None:
            raise ValueError("set either threshold or factor, not both")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.remasking not in REMASKING:
            raise ValueError(f"remasking must be one of {', '.join(REMASKING)}, got {self.remasking!r}")
        if self.unmasking is not None and self.unmasking not in UNMASKING:
            raise ValueError(f"unmasking must be one of {', '.join(UNMASKING)}, got {self.unmasking!r}")
        if self.cfg_scale < 0:
            raise ValueError(f"cfg_scale must be >= 0, got {self.cfg_scale}")
        if self.cfg_scale > 0 and self.base_method not in (None, "reference"):
            raise ValueError("cfg_scale > 0 is supported by the 'reference' decoder only")
        for name in self.strategies:
            if name not in REGISTRY:
                raise ValueError(f"unknown strategy {name!r} in method {self.method!r}; "
                                 f"available: {', '.join(REGISTRY)}")
        if len(set(self.strategies)) != len(self.strategies):
            raise ValueError(f"method {self.method!r} names a strategy twice")
        if self.strategies:
            from .strategies.base import check_method
            check_method(self.base_method, self.strategies)
        self.check_strategy_options()

    def check_strategy_options(self) -> None:
        if self.focus_alpha < 1:
            raise ValueError(f"focus_alpha must be >= 1, got {self.focus_alpha}")
        self.keep_fractions = tuple(float(x) for x in self.keep_fractions)
        self.skip_depths = tuple(float(x) for x in self.skip_depths)
        if len(self.keep_fractions) != len(self.skip_depths) or not self.keep_fractions:
            raise ValueError("keep_fractions and skip_depths must be non-empty and of equal length")
        if any(not 0 < f <= 1 for f in self.keep_fractions):
            raise ValueError(f"keep_fractions must be in (0, 1], got {self.keep_fractions}")
        if list(self.skip_depths) != sorted(self.skip_depths) or any(not 0 <= d < 1 for d in self.skip_depths):
            raise ValueError(f"skip_depths must be ascending in [0, 1), got {self.skip_depths}")
        if not 0 <= self.skip_alpha <= 1:
            raise ValueError(f"skip_alpha must be in [0, 1], got {self.skip_alpha}")
        for name in ("prompt_refresh", "block_refresh"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.skip_block_start not in BLOCK_STARTS:
            raise ValueError(f"skip_block_start must be one of {', '.join(BLOCK_STARTS)}, "
                             f"got {self.skip_block_start!r}")
        if self.eos_threshold <= 0:
            raise ValueError(f"eos_threshold must be > 0 (> 1 never cuts), got {self.eos_threshold}")
        if self.min_length < 0:
            raise ValueError(f"min_length must be >= 0, got {self.min_length}")
        if self.max_copies not in (1, 2, 4, 8):
            raise ValueError(f"max_copies must be 1, 2, 4 or 8, got {self.max_copies}")

    @property
    def base_method(self) -> str | None:
        return self.method.split("+")[0] if self.method else None

    @property
    def strategies(self) -> list[str]:
        return self.method.split("+")[1:] if self.method else []

    def replace(self, **changes) -> "SamplingParams":
        return dataclasses.replace(self, **changes)

    def resolve(self, defaults: dict, family_methods: tuple[str, ...], max_context: int,
                prompt_len: int, logit_shift: int = 0) -> "SamplingParams":
        """Fill unset fields and check what depends on the model and the prompt."""
        p = self.replace(
            max_new_tokens=self.max_new_tokens or defaults.get("max_new_tokens", 128),
            block_length=self.block_length or defaults.get("block_length", 32),
            method=self.method or family_methods[0])
        if p.cfg_scale > 0 and p.base_method != "reference":
            raise ValueError("cfg_scale > 0 is supported by the 'reference' decoder only")
        if p.base_method not in family_methods:
            raise ValueError(f"method {p.base_method!r} cannot run on this model's attention "
                             f"pattern; use one of {', '.join(family_methods)}")
        from .strategies.base import check_method
        check_method(p.base_method, p.strategies, logit_shift)
        if p.stop_at_eos is None:
            p.stop_at_eos = p.base_method == "block" or "adaptive-length" in p.strategies
        if p.steps is None:
            p.steps = p.block_length
        if p.steps > p.block_length:
            raise ValueError(f"steps {p.steps} must be <= block_length {p.block_length}")
        if p.base_method == "block":
            p.unmasking = p.unmasking or "low_confidence_dynamic"
            if p.unmasking == "low_confidence_dynamic" and p.threshold is None:
                p.threshold = defaults.get("threshold", 0.85)
        elif p.max_new_tokens % p.block_length:
            raise ValueError(f"block_length {p.block_length} must divide max_new_tokens {p.max_new_tokens}")
        if prompt_len < 1:
            raise ValueError("prompt is empty")
        if prompt_len + p.max_new_tokens > max_context:
            raise ValueError(f"prompt ({prompt_len} tokens) + max_new_tokens ({p.max_new_tokens}) "
                             f"exceeds the model's context of {max_context} tokens")
        return p


FIELD_TYPES = {f.name: f.type for f in dataclasses.fields(SamplingParams)}


def convert(name: str, raw: str):
    kind = str(FIELD_TYPES[name])
    if raw.lower() == "none":
        return None
    if "tuple" in kind:
        return tuple(float(x) for x in raw.split("/"))
    if "list[int]" in kind:
        return [int(x) for x in raw.split("/")]
    if "bool" in kind:
        if raw.lower() not in ("1", "true", "yes", "0", "false", "no"):
            raise ValueError(raw)
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
            raise ValueError(f"bad field {item!r} in spec {spec!r}; expected field=value with a "
                             f"SamplingParams field")
        try:
            fields[name] = convert(name, raw)
        except ValueError:
            raise ValueError(f"bad value {raw!r} for {name} in spec {spec!r}") from None
    return SamplingParams(method=method, **fields)


def method_params(method: str | None, family_methods: tuple[str, ...], **fields) -> SamplingParams:
    """``method`` (a spec; None = the family's parallel decoder, ``block`` or ``dual-cache``, at
    threshold 0.9) with ``fields`` filling what the spec leaves out."""
    if method is None:
        method = "block" if "block" in family_methods else "dual-cache"
        if fields.get("threshold") is None and fields.get("factor") is None:
            fields["threshold"] = 0.9
    return parse_spec(method, **fields)  # a spec's own fields (method:field=value) win
