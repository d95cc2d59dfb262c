"""`dllm bench`: every method spec on the same prompts, interleaved, at several batch sizes."""
from .offline import BenchRecord, parse_spec, run_bench

__all__ = ["BenchRecord", "parse_spec", "run_bench"]
