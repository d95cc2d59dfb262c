"""Log-likelihood of a continuation under a masked diffusion LM (what lm-eval's ``loglikelihood`` asks).

A masked diffusion model has no left-to-right factorisation, so the log-likelihood is estimated by the
Monte-Carlo bound LLaDA's ``eval_llada.py`` uses (inherited from SMDM): draw a number of masked tokens
k in 1..n (spread evenly over a group of samples from one random start), mask k random continuation
tokens, and score the masked tokens' cross-entropy divided by the mask ratio k/n; the prompt is never
masked. ``cfg_scale`` applies LLaDA's unsupervised classifier-free guidance (the prompt masked in the
unconditional copy). Block-causal families (SDAR, LLaDA2.0) factorise exactly over blocks:
log p(x) = sum_b log p(x_b | clean blocks before b), and attention never looks at later blocks, so
each block's term is the same bound with the masks confined to that block and everything before it
clean (the block diffusion objective these models are trained on).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from ..errors import UserError
from ..models.layers import DiffusionLM


@dataclass(frozen=True)
class LikelihoodConfig:
    mc_num: int = 128  # samples per segment (the whole continuation, or one block of it)
    mc_batch: int = 32  # samples per forward; the mask counts are spread over each such group
    cfg_scale: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.mc_batch < 1 or self.mc_num < 1 or self.mc_num % self.mc_batch:
            raise UserError(f"mc_num ({self.mc_num}) must be a positive multiple of mc_batch "
                            f"({self.mc_batch})")
        if self.cfg_scale < 0:
            raise UserError(f"cfg_scale must be >= 0, got {self.cfg_scale}")


def segments(model: DiffusionLM, prompt_len: int, total_len: int) -> list[tuple[int, int]]:
    """Spans of the continuation scored as one unit: all of it (full attention), or its part in
    each attention block (block-causal; blocks are aligned to position 0)."""
    cfg = model.config
    if not cfg.is_block_causal:
        return [(prompt_len, total_len)]
    bs = cfg.block_size
    cuts = range((prompt_len // bs + 1) * bs, total_len, bs)
    starts = [prompt_len, *cuts]
    return list(zip(starts, [*cuts, total_len]))


def mask_counts(n: int, num: int, generator: torch.Generator) -> Tensor:
    """``num`` mask counts in 1..n spread evenly from one random start (LLaDA's stratification)."""
    start = torch.randint(1, n + 1, (), generator=generator)
    counts = torch.round(torch.linspace(float(start), start + (num - 1) * n / num, num)).long()
    return (counts - 1) % n + 1


def draw_masks(n: int, num: int, generator: torch.Generator) -> Tensor:
    """[num, n] bool: row i masks exactly ``mask_counts[i]`` positions, chosen uniformly."""
    counts = mask_counts(n, num, generator)
    ranks = torch.stack([torch.randperm(n, generator=generator) for _ in range(num)])
    return ranks < counts[:, None]


def masked_logprobs(model: DiffusionLM, noisy: Tensor, targets: Tensor, is_masked: Tensor,
                    prompt_len: int, mask_id: int, cfg_scale: float) -> Tensor:
    """log p(target) at every masked position of ``noisy`` [B, T], in row-major order.

    Only the masked positions go through the LM head (a real vocabulary times a whole canvas would
    not fit)."""
    rows, cols = is_masked.nonzero(as_tuple=True)
    logits = masked_logits(model, noisy, rows, cols)
    if cfg_scale > 0:
        uncond = noisy.clone()
        uncond[:, :prompt_len] = mask_id
        un_logits = masked_logits(model, uncond, rows, cols)
        logits = un_logits + (cfg_scale + 1) * (logits - un_logits)
    return -F.cross_entropy(logits, targets[rows, cols], reduction="none")


def masked_logits(model: DiffusionLM, ids: Tensor, rows: Tensor, cols: Tensor) -> Tensor:
    if model.shard is not None:  # the other ranks run engine steps only
        raise UserError("loglikelihood scoring runs in one process; load the model with "
                        "tensor_parallel_size 1 for it")
    hidden = model.forward_context(ids, model.plain_context(ids, None))  # [B, T, d]
    if model.config.logit_shift:  # Dream: position i reads the output at i - 1
        cols = (cols - model.config.logit_shift).clamp(min=0)
    return model.logits(hidden[rows, cols])


@dataclass
class Likelihood:
    value: float  # estimated log p(continuation | prompt)
    nfe: int  # forward passes it took


@torch.inference_mode()
def segment_loglikelihood(model: DiffusionLM, ids: Tensor, span: tuple[int, int], prompt_len: int,
                          mask_id: int, cfg: LikelihoodConfig, generator: torch.Generator) -> float:
    """The bound for the tokens in ``span``: mean over ``cfg.mc_num`` samples of
    -sum(masked cross-entropy) / mask ratio. Positions after the span are dropped (nothing before
    them attends to them in a block-causal model; in a full-attention model the span is the end)."""
    start, end = span
    n = end - start
    clean = ids[:end].expand(cfg.mc_batch, end)
    total = 0.0
    for _ in range(cfg.mc_num // cfg.mc_batch):
        is_masked = torch.zeros(cfg.mc_batch, end, dtype=torch.bool, device=ids.device)
        is_masked[:, start:] = draw_masks(n, cfg.mc_batch, generator).to(ids.device)
        ratio = is_masked.sum(1, keepdim=True).float() / n  # [B, 1]
        noisy = torch.where(is_masked, mask_id, clean)
        logp = masked_logprobs(model, noisy, clean, is_masked, prompt_len, mask_id, cfg.cfg_scale)
        total += float((logp / ratio.expand_as(is_masked)[is_masked]).sum())
    return total / cfg.mc_num


def loglikelihood(model: DiffusionLM, prompt_ids: list[int], continuation_ids: list[int], mask_id: int,
                  cfg: LikelihoodConfig = LikelihoodConfig()) -> Likelihood:
    """Estimated log p(continuation | prompt), both within the model's context; deterministic for a
    fixed ``cfg.seed`` (every call starts its own generator, so the value does not depend on what
    was scored before)."""
    if not prompt_ids or not continuation_ids:
        raise UserError("loglikelihood needs a non-empty prompt and a non-empty continuation")
    window = model.config.max_position_embeddings
    if len(prompt_ids) + len(continuation_ids) > window:  # positions past it were never trained
        raise UserError(f"the prompt ({len(prompt_ids)} tokens) and the continuation "
                        f"({len(continuation_ids)}) exceed the model's context of {window} tokens; "
                        f"cut the prompt on the left (as the lm-eval model does)")
    device = next(model.parameters()).device
    ids = torch.tensor(prompt_ids + continuation_ids, dtype=torch.long, device=device)
    generator = torch.Generator().manual_seed(cfg.seed)
    spans = segments(model, len(prompt_ids), len(ids))
    value = sum(segment_loglikelihood(model, ids, s, len(prompt_ids), mask_id, cfg, generator)
                for s in spans)
    forwards_per_span = cfg.mc_num // cfg.mc_batch * (2 if cfg.cfg_scale > 0 else 1)
    return Likelihood(value, len(spans) * forwards_per_span)
