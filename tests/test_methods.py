"""The method vocabulary (``dllm_engine.methods``): one module owns the base decoders, every
caller asks a ``Decoder`` object, and the families' decoder lists come from it; the strategies'
flags are plain data the runtime classes take, so validating a method loads no runtime module."""
import dataclasses
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from dllm_engine import SamplingParams
from dllm_engine.methods import (BLOCK, BLOCK_METHODS, DECODERS, DUAL_CACHE, FULL_ATTENTION_METHODS, PREFIX_CACHE,
                                 REFERENCE, STRATEGIES, check_method, default_decoder)
from dllm_engine.models import FAMILIES

PACKAGE = Path(__file__).resolve().parent.parent / "dllm_engine"
NAME = "|".join(re.escape(n) for n in DECODERS)
# a decoder name compared or listed: == "block", != 'reference', "block" in ..., ("prefix-cache", "dual-cache")
COMPARED = re.compile(rf"""(==|!=|\bin)\s*\(?\s*["']({NAME})["']|["']({NAME})["']\s*(==|!=|in\b|not in\b)"""
                      rf"""|["']({NAME})["']\s*,\s*["']({NAME})["']""")


def test_no_decoder_name_is_compared_or_listed_outside_methods():
    offenders = [f"{path.relative_to(PACKAGE)}:{i}: {line.strip()}"
                 for path in sorted(PACKAGE.rglob("*.py")) if path.name != "methods.py"
                 for i, line in enumerate(path.read_text().splitlines(), 1) if COMPARED.search(line)]
    assert offenders == []


@pytest.mark.parametrize("line", ['if p.base_method == "block":', "x = ('prefix-cache', 'dual-cache')",
                                  'if "reference" in methods:', 'ok = method != "dual-cache"'])
def test_the_scan_catches_a_name_comparison(line):
    assert COMPARED.search(line)


def test_each_decoder_is_looked_up_by_its_name():
    assert list(DECODERS) == ["reference", "prefix-cache", "dual-cache", "block"]
    assert [SamplingParams(method=f"{n}+adaptive-length").decoder for n in DECODERS] == [
        REFERENCE, PREFIX_CACHE, DUAL_CACHE, BLOCK]
    assert SamplingParams().decoder is None  # unresolved: no decoder yet


def test_the_attention_patterns_and_their_defaults():
    assert FULL_ATTENTION_METHODS == ("reference", "prefix-cache", "dual-cache")
    assert BLOCK_METHODS == ("block",)
    assert {mt: f.methods for mt, f in FAMILIES.items()} == {
        "llada": FULL_ATTENTION_METHODS, "Dream": FULL_ATTENTION_METHODS, "sdar": BLOCK_METHODS,
        "llada2_moe": BLOCK_METHODS, "llada_moe": FULL_ATTENTION_METHODS}
    assert default_decoder(FULL_ATTENTION_METHODS) == "dual-cache"
    assert default_decoder(BLOCK_METHODS) == "block"


def test_the_decoder_table():
    """The cache policy and defaults each decoder documents (the table in methods.py)."""
    rows = {d.name: (d.block_causal, d.reuses_cache, d.recomputes_suffix, d.fixed_steps, d.unmasking,
                     d.supports_cfg, d.supports_factor) for d in DECODERS.values()}
    assert rows == {"reference": (False, False, False, True, False, True, True),
                    "prefix-cache": (False, True, True, False, False, False, True),
                    "dual-cache": (False, True, False, False, False, False, True),
                    "block": (True, True, False, False, True, False, False)}


# -- the strategies: plain data the runtime classes take their flags from --------------------------
def test_the_registry_and_the_runtime_classes_agree():
    from dllm_engine.strategies.base import Strategy, strategy_class
    classes = {name: strategy_class(name) for name in STRATEGIES}  # imports every runtime module
    assert {name: (cls.name, cls.spec) for name, cls in classes.items()} == {
        name: (name, spec) for name, spec in STRATEGIES.items()}
    assert all(issubclass(cls, Strategy) for cls in classes.values())
    named = {cls for cls in all_subclasses(Strategy) if "name" in cls.__dict__}
    assert named == set(classes.values())  # no runtime strategy missing from the registry
    fields = {f.name for f in dataclasses.fields(SamplingParams)}
    for spec in STRATEGIES.values():
        assert set(spec.options) <= fields and spec.options
        assert spec.bases and all(DECODERS[d.name] is d for d in spec.bases)


def all_subclasses(cls: type) -> set[type]:
    return {c for sub in cls.__subclasses__() for c in (sub, *all_subclasses(sub))}


def test_a_strategy_class_takes_its_flags_from_the_registry_only():
    from dllm_engine.strategies.base import Strategy
    with pytest.raises(TypeError, match="sets stage, owns_commit: a strategy's flags are data"):
        type("Restated", (Strategy,), {"name": "focus", "stage": 2, "owns_commit": True})
    with pytest.raises(TypeError, match="strategy 'nope' .* is not in methods.STRATEGIES"):
        type("Unregistered", (Strategy,), {"name": "nope"})


def test_composition_reads_the_registry():
    assert check_method("dual-cache", ["early-skip", "adaptive-length"], logit_shift=0) is None
    with pytest.raises(ValueError, match="strategy 'early-skip' runs on dual-cache, not on 'block'"):
        check_method("block", ["early-skip"])
    with pytest.raises(ValueError, match="'focus' and 'early-skip' both drop tokens"):
        check_method("dual-cache", ["focus", "early-skip"])
    with pytest.raises(ValueError, match="'jump-share' verifies every copy"):
        check_method("dual-cache", ["focus", "jump-share"])
    with pytest.raises(ValueError, match="'jump-share' needs a model without logit shift"):
        check_method("dual-cache", ["jump-share"], logit_shift=1)


LIGHT = """
import sys
from dllm_engine.sampling_params import SamplingParams
from dllm_engine.spec import parse_spec
from dllm_engine.resolve import resolve_params
from dllm_engine.methods import FULL_ATTENTION_METHODS
p = parse_spec("dual-cache+early-skip+adaptive-length:threshold=0.9,stop_at_eos=true")
print(resolve_params(p, FULL_ATTENTION_METHODS).describe())
for bad in ("block+early-skip", "dual-cache+focus+early-skip", "dual-cache+nope"):
    try:
        SamplingParams(method=bad)
    except ValueError:
        pass
    else:
        raise SystemExit(f"{bad} was accepted")
print(" ".join(sorted(m for m in sys.modules if m.startswith(("dllm_engine", "torch")))))
"""


def test_validating_a_method_loads_no_runtime_module():
    """The import circle sampling_params -> strategies.base -> decoding -> engine -> sampling_params
    is gone: parsing, validating and resolving a method reads plain data only (a fresh interpreter,
    so no other test's imports count)."""
    out = subprocess.run([sys.executable, "-c", LIGHT], capture_output=True, text=True, check=True,
                         cwd=PACKAGE.parent, env={**os.environ, "PYTHONPATH": str(PACKAGE.parent)}).stdout
    described, loaded = out.strip().splitlines()
    assert described.startswith("dual-cache+early-skip+adaptive-length ") and "keep_fractions=" in described
    assert loaded.split() == ["dllm_engine", "dllm_engine.errors", "dllm_engine.methods", "dllm_engine.resolve",
                              "dllm_engine.sampling_params", "dllm_engine.spec"]


# -- the commit rules a request picks beside its decoder's own ----------------------------------------
def test_the_commit_rules_and_their_runtime_classes_agree():
    from dllm_engine.decoding.commit_rules import CommitRule, rule_instance
    from dllm_engine.methods import COMMIT_RULES
    fields = {f.name for f in dataclasses.fields(SamplingParams)}
    for name, spec in COMMIT_RULES.items():
        rule = rule_instance(name)  # imports the runtime module named by the registry
        assert isinstance(rule, CommitRule) and (rule.name, rule.spec) == (name, spec)
        assert set(spec.options) <= fields and spec.bases and all(DECODERS[d.name] is d for d in spec.bases)
    assert [n for n, s in COMMIT_RULES.items() if s.edits] == ["joint-threshold"]
    assert {n for n, s in STRATEGIES.items() if s.freezes_committed} == {"focus", "focus-probe", "delayed-cache"}
    with pytest.raises(TypeError, match="commit rule 'nope' .* is not in methods.COMMIT_RULES"):
        type("Unregistered", (CommitRule,), {"name": "nope"})


def test_commit_rule_composition_reads_the_registry():
    from dllm_engine.methods import check_commit_rule
    assert check_commit_rule("dual-cache", ["early-skip", "adaptive-length"], "credit") is None
    assert check_commit_rule("block", ["adaptive-length"], "joint-threshold") is None
    with pytest.raises(ValueError, match="commit_rule 'joint-threshold' runs on block, not on 'prefix-cache'"):
        check_commit_rule("prefix-cache", [], "joint-threshold")
    with pytest.raises(ValueError, match="'jump-share' replaces the commit rule"):
        check_commit_rule("dual-cache", ["jump-share"], "hierarchical")
    with pytest.raises(ValueError, match="'focus' freezes committed block positions"):
        check_commit_rule("block", ["focus"], "joint-threshold")
    assert check_commit_rule("block", ["focus"], "credit") is None  # credit never edits
