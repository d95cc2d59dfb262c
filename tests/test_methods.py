"""The method vocabulary (``dllm_engine.methods``): one module owns the base decoders, every
caller asks a ``Decoder`` object, and the families' decoder lists come from it."""
import re
from pathlib import Path

import pytest

from dllm_engine import SamplingParams
from dllm_engine.methods import (BLOCK, BLOCK_METHODS, DECODERS, DUAL_CACHE, FULL_ATTENTION_METHODS, PREFIX_CACHE,
                                 REFERENCE, default_decoder)
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
        "llada2_moe": BLOCK_METHODS}
    assert default_decoder(FULL_ATTENTION_METHODS) == "dual-cache"
    assert default_decoder(BLOCK_METHODS) == "block"


def test_the_decoder_table():
    """The cache policy and defaults each decoder documents (the table in methods.py)."""
    rows = {d.name: (d.block_causal, d.reuses_cache, d.recomputes_suffix, d.fixed_steps, d.unmasking,
                     d.stops_at_eos, d.supports_cfg, d.supports_factor) for d in DECODERS.values()}
    assert rows == {"reference": (False, False, False, True, False, False, True, True),
                    "prefix-cache": (False, True, True, False, False, False, False, True),
                    "dual-cache": (False, True, False, False, False, False, False, True),
                    "block": (True, True, False, False, True, True, False, False)}
