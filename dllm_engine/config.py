"""Model configuration normalised from each family's own ``config.json``.

Every family keeps its real config keys on disk; its model file turns them into this one
dataclass, which is all the shared transformer stack reads.
"""
from __future__ import annotations

from dataclasses import dataclass

from .errors import UserError


@dataclass
class MoEConfig:
    """Sparse MoE MLP: a sigmoid, group-limited router (DeepSeek-V3 / Ling-2.0 / LLaDA2.0) or a
    softmax top-k router (OLMoE / LLaDA-MoE)."""
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    num_shared_experts: int = 0
    n_group: int = 1  # experts are split into n_group groups; the best topk_group groups compete
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = True
    first_k_dense_replace: int = 0  # layers below this index keep the dense MLP
    expert_bias: bool = True  # a score correction (aux-loss-free balancing), selection only unless:
    bias_weights: bool = False  # the biased scores also weight the experts (LLaDA-MoE's released code)
    score_function: str = "sigmoid"  # "sigmoid" | "softmax" (over all experts, before top-k)

    def __post_init__(self) -> None:
        if self.score_function not in ("sigmoid", "softmax"):
            raise UserError(f"score_function must be 'sigmoid' or 'softmax', got {self.score_function!r}")
        if self.num_experts % self.n_group:
            raise UserError(f"num_experts {self.num_experts} must be divisible by n_group {self.n_group}")
        per_group = self.num_experts // self.n_group
        if not 1 <= self.topk_group <= self.n_group:
            raise UserError(f"topk_group {self.topk_group} must be in [1, n_group={self.n_group}]")
        if self.n_group > 1 and per_group < 2:
            raise UserError(f"group scores sum the top-2 experts of a group; "
                            f"{per_group} expert(s) per group is too few")
        if not 1 <= self.num_experts_per_tok <= self.topk_group * per_group:
            raise UserError(f"num_experts_per_tok {self.num_experts_per_tok} must be in "
                            f"[1, topk_group * experts per group = {self.topk_group * per_group}]")


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
    rotary_dim: int = 0  # RoPE rotates the first rotary_dim dims of each head; 0 -> head_dim
    fused_qkv: bool = False  # one query_key_value projection (rows Q | K | V) instead of three
    attn_out_bias: bool = False  # bias on the attention output projection
    moe: MoEConfig | None = None  # None: every layer has the dense MLP

    def __post_init__(self) -> None:
        if self.head_dim == 0:
            if self.hidden_size % self.num_heads:
                raise UserError(
                    f"hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}")
            self.head_dim = self.hidden_size // self.num_heads
        if self.rotary_dim == 0:
            self.rotary_dim = self.head_dim
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim:
            raise UserError(f"rotary_dim {self.rotary_dim} must be even and in "
                            f"(0, head_dim={self.head_dim}]")
        if self.num_heads % self.num_kv_heads:
            raise UserError(
                f"num_heads {self.num_heads} must be a multiple of num_kv_heads {self.num_kv_heads}")
        if self.attention not in ("full", "block_causal"):
            raise UserError(f"attention must be 'full' or 'block_causal', got {self.attention!r}")

    @property
    def is_block_causal(self) -> bool:
        return self.attention == "block_causal"
