"""Model configuration normalised from each family's own ``config.json``.

Every family keeps its real config keys on disk; its model file turns them into this one
dataclass, which is all the shared transformer stack reads.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    head_dim: int = 0  # 0 -> hidden_size // num_heads
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    qkv_bias: bool = False
    qk_norm: bool = False
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096
    mask_token_id: int = -1
    eos_token_id: int = -1
    pad_token_id: int = -1
    bos_token_id: int | None = None
    attention: str = "full"  # "full" | "block_causal"
    block_size: int | None = None  # trained block size of block-diffusion families
    logit_shift: int = 0  # Dream: position i reads the output at i - 1
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.head_dim == 0:
            if self.hidden_size % self.num_heads:
                raise ValueError(
                    f"hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}")
            self.head_dim = self.hidden_size // self.num_heads
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads {self.num_heads} must be a multiple of num_kv_heads {self.num_kv_heads}")
        if self.attention not in ("full", "block_causal"):
            raise ValueError(f"attention must be 'full' or 'block_causal', got {self.attention!r}")

    @property
    def is_block_causal(self) -> bool:
        return self.attention == "block_causal"
