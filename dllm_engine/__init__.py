"""dllm-engine: fast, servable inference for diffusion LLMs."""
from __future__ import annotations

from .sampling_params import SamplingParams

__all__ = ["LLM", "GenerateResult", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"

ENGINE_NAMES = ("LLM", "GenerateResult", "RequestOutput")  # from engine/llm.py, on first use


def __getattr__(name: str) -> object:
    """``LLM`` and its results load the engine (and torch) when first asked for, so importing the
    options alone (``SamplingParams``, ``dllm_engine.spec``) stays light."""
    if name in ENGINE_NAMES:
        from .engine import llm
        return getattr(llm, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
