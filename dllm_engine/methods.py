"""The vocabulary of a method string (``dual-cache+early-skip``), as plain data: the base decoders,
the strategies, which combine, and the options each reads.

This module owns the decoders. Every caller asks a ``Decoder`` what it does (is its attention
block-causal? does it reuse the cache? which commit rule is its default?) and never compares its
name. It imports nothing from the package but ``errors`` (which imports nothing), so validating a method string (``SamplingParams``,
``resolve``) reads data only and loads no runtime module; the runtime strategy classes take their
flags from ``STRATEGIES`` (``strategies.base.Strategy.spec``).

| decoder      | step 0 of a block        | later steps               | commit rule                  |
|--------------|--------------------------|---------------------------|------------------------------|
| reference    | whole canvas             | whole canvas              | fixed-k / threshold / factor |
| prefix-cache | whole canvas             | block + suffix            | same                         |
| dual-cache   | whole canvas             | block only                | same                         |
| block        | positions not yet cached | positions not yet cached  | low_confidence_dynamic/static|

Beside a decoder's own commit rule, a request may pick one of ``COMMIT_RULES`` (``commit_rule``):
dInfer's ``credit`` and ``hierarchical`` parallel decoders (every decoder) and LLaDA2.1's
``joint-threshold`` editing decoder (``block``; its S / Q modes are ``JOINT_THRESHOLD_PRESETS``).
"""
from __future__ import annotations

from dataclasses import dataclass

from .errors import UserError


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
    supports_cfg: bool  # classifier-free guidance (``cfg_scale``)
    supports_factor: bool  # Fast-dLLM's factor commit rule
    family_default: bool  # the default decoder of the models whose attention pattern runs it


REFERENCE = Decoder("reference", block_causal=False, reuses_cache=False, recomputes_suffix=False,
                    fixed_steps=True, unmasking=False, supports_cfg=True,
                    supports_factor=True, family_default=False)
PREFIX_CACHE = Decoder("prefix-cache", block_causal=False, reuses_cache=True, recomputes_suffix=True,
                       fixed_steps=False, unmasking=False, supports_cfg=False,
                       supports_factor=True, family_default=False)
DUAL_CACHE = Decoder("dual-cache", block_causal=False, reuses_cache=True, recomputes_suffix=False,
                     fixed_steps=False, unmasking=False, supports_cfg=False,
                     supports_factor=True, family_default=True)
BLOCK = Decoder("block", block_causal=True, reuses_cache=True, recomputes_suffix=False,
                fixed_steps=False, unmasking=True, supports_cfg=False,
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


@dataclass(frozen=True)
class StrategySpec:
    """One strategy as a method string names it: the bases it composes with, the options it reads
    and the flags that decide which strategies combine. Its runtime class (``target``, imported on
    first use) takes these from here (``strategies.base.Strategy.spec``)."""
    name: str
    target: str  # "module:Class" of the runtime class
    bases: tuple[Decoder, ...]  # base decoders it composes with
    options: tuple[str, ...] = ()  # the SamplingParams fields it reads
    # order inside a pipeline: 0 changes which tokens a forward computes, 1 reads extra logits,
    # 2 replaces the commit rule
    stage: int = 1
    shrinks_tokens: bool = False  # drops tokens inside the forward (layer hooks)
    owns_commit: bool = False  # replaces the base commit rule (``commit``)
    needs_unshifted_logits: bool = False  # reads position p's logits at p (not Dream)
    no_logprobs: str | None = None  # why ``logprobs`` cannot be recorded (None: they can)
    # stops computing committed block positions (FOCUS's delayed cache freezes their K/V), so
    # a commit rule that edits committed tokens cannot run beside it
    freezes_committed: bool = False


FOCUS_FLAGS = dict(bases=(BLOCK, DUAL_CACHE), options=("focus_alpha",), stage=0, shrinks_tokens=True,
                   freezes_committed=True)
STRATEGIES: dict[str, StrategySpec] = {s.name: s for s in (
    StrategySpec("focus", "dllm_engine.strategies.focus:TokenEviction", **FOCUS_FLAGS),
    StrategySpec("focus-probe", "dllm_engine.strategies.focus:PredictorProbe", **FOCUS_FLAGS),  # diagnostic
    # FOCUS's ablation: no eviction
    StrategySpec("delayed-cache", "dllm_engine.strategies.focus:DelayedCache", **FOCUS_FLAGS),
    StrategySpec("early-skip", "dllm_engine.strategies.early_skip:EarlySkip", (DUAL_CACHE,),
                 ("keep_fractions", "skip_depths", "skip_alpha", "prompt_refresh", "block_refresh",
                  "skip_block_start", "delay_eos"), stage=0, shrinks_tokens=True),
    StrategySpec("adaptive-length", "dllm_engine.strategies.adaptive_length:AdaptiveLength",
                 tuple(DECODERS.values()), ("eos_threshold", "min_length")),
    StrategySpec("jump-share", "dllm_engine.strategies.jump_share:JumpShare", (PREFIX_CACHE, DUAL_CACHE),
                 ("max_copies", "jump_share_switch", "jump_share_layout"), stage=2, owns_commit=True, needs_unshifted_logits=True,
                 no_logprobs="its drafts were predicted a step earlier"),
)}


@dataclass(frozen=True)
class CommitRuleSpec:
    """A commit rule a request picks with ``commit_rule`` in place of its decoder's own: the
    bases it runs on, the options it reads and whether it edits committed tokens. Its runtime
    class (``target``, imported on first use) takes these from here
    (``decoding.commit_rules.CommitRule.spec``)."""
    name: str
    target: str  # "module:Class" of the runtime class
    bases: tuple[Decoder, ...]
    options: tuple[str, ...]
    # rewrites committed tokens of the current block (LLaDA2.1's token-to-token edits): the
    # block stays open until final, and strategies that freeze committed positions refuse it
    edits: bool = False


COMMIT_RULES: dict[str, CommitRuleSpec] = {r.name: r for r in (
    # dInfer python/dinfer/decoding/parallel_strategy.py: CreditThresholdParallelDecoder
    CommitRuleSpec("credit", "dllm_engine.decoding.credit:CreditThreshold", tuple(DECODERS.values()),
                   ("threshold", "credit_alpha", "credit_gamma", "credit_beta")),
    # ... HierarchyDecoder
    CommitRuleSpec("hierarchical", "dllm_engine.decoding.hierarchical:Hierarchical", tuple(DECODERS.values()),
                   ("threshold", "low_threshold")),
    # SGLang python/sglang/srt/dllm/algorithm/joint_threshold.py (LLaDA2.1)
    CommitRuleSpec("joint-threshold", "dllm_engine.decoding.joint_threshold:JointThreshold", (BLOCK,),
                   ("threshold", "edit_threshold", "max_post_edit_steps"), edits=True),
)}
JOINT_THRESHOLD = COMMIT_RULES["joint-threshold"]
# LLaDA2.1's decoding modes, as its model card recommends them (threshold = mask-to-token,
# edit_threshold = token-to-token; block_length 32, greedy). Read in huggingface/diffusers
# docs/source/en/api/pipelines/llada2.md "Recommended parameters" (Quality: 0.7 / 0.5 / 16) and in
# a project quoting the LLaDA2.1-mini README (S: 0.5 / 0.0 / 16, Q: 0.7 / 0.5 / 16); SGLang's
# JointThreshold defaults are the S mode (0.5 / 0.0 / 16).
JOINT_THRESHOLD_PRESETS: dict[str, dict] = {
    "S": {"threshold": 0.5, "edit_threshold": 0.0, "max_post_edit_steps": 16},  # speedy mode
    "Q": {"threshold": 0.7, "edit_threshold": 0.5, "max_post_edit_steps": 16},  # quality mode
}
DEFAULT_PRESET = "Q"  # joint-threshold without a preset: the unset fields take the Q mode's


def check_commit_rule(base: str, names: list[str], rule: str | None) -> None:
    """Refuse, naming the conflict, a commit rule its base or the method's strategies cannot
    run with: a rule on a base it does not support, a strategy that replaces the commit rule
    itself, or a rule that edits committed tokens beside a strategy that freezes them."""
    if rule is None:
        return
    spec = COMMIT_RULES[rule]
    if DECODERS[base] not in spec.bases:
        raise UserError(f"commit_rule {rule!r} runs on {', '.join(d.name for d in spec.bases)}, not on {base!r}")
    for strategy in (STRATEGIES[n] for n in names):
        if strategy.owns_commit:
            raise UserError(f"{strategy.name!r} replaces the commit rule; drop it or commit_rule {rule!r}")
        if spec.edits and strategy.freezes_committed:
            raise UserError(f"{strategy.name!r} freezes committed block positions, which commit_rule "
                             f"{rule!r} edits; use one of them")


def check_method(base: str, names: list[str], logit_shift: int | None = None) -> None:
    """Refuse, naming the conflict, a method whose strategies cannot run together on every step:
    a strategy on a base it does not support, two strategies that drop tokens inside the forward,
    a strategy that verifies every copy at the last layer beside one that drops tokens, or (when
    ``logit_shift`` is known) a strategy that needs unshifted logits on a shifted model (Dream).
    ``base`` and ``names`` are known names (``SamplingParams`` checked them)."""
    specs = [STRATEGIES[n] for n in names]
    for spec in specs:
        if DECODERS[base] not in spec.bases:
            raise UserError(f"strategy {spec.name!r} runs on {', '.join(d.name for d in spec.bases)}, "
                            f"not on {base!r}")
    shrink = [s.name for s in specs if s.shrinks_tokens]
    if len(shrink) > 1:
        raise UserError(f"{shrink[0]!r} and {shrink[1]!r} both drop tokens inside the forward; "
                        f"use one of them")
    owners = [s.name for s in specs if s.owns_commit]
    if len(owners) > 1:
        raise UserError(f"{owners[0]!r} and {owners[1]!r} both replace the commit rule; use one of them")
    if owners and shrink:
        raise UserError(f"{owners[0]!r} verifies every copy of the block at the last layer, and "
                        f"{shrink[0]!r} drops tokens before it; use one of them")
    unshifted = [s.name for s in specs if s.needs_unshifted_logits]
    if logit_shift and unshifted:
        raise UserError(f"{unshifted[0]!r} needs a model without logit shift (LLaDA); this model "
                        f"reads position p's logits at p - 1 (Dream)")
