"""dllm-engine: fast, servable inference for diffusion LLMs."""
from .engine.llm import LLM, GenerateResult, RequestOutput
from .sampling_params import SamplingParams

__all__ = ["LLM", "GenerateResult", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"
