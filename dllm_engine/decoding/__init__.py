"""Commit rules: which masked positions of the current block become tokens this step."""
from .rules import (confidence, factor_select, greedy_tokens, num_transfer_tokens, sample_tokens,
                    threshold_select, topk_select, without_mask)

__all__ = ["confidence", "factor_select", "greedy_tokens", "num_transfer_tokens", "sample_tokens",
           "threshold_select", "topk_select", "without_mask"]
