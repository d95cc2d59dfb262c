"""Training batches for the two objectives the embedded checkpoints are trained with.

- masked diffusion (LLaDA SFT): t ~ U(0, 1), response tokens masked with probability t, loss on
  masked tokens weighted 1/t, prompt never masked, response padded with EOS so the model learns
  EOS padding (and where the answer ends);
- block diffusion (SDAR / BD3-LM): the noisy copy and the clean copy are concatenated; a noisy block
  attends to itself and to the clean blocks before it, the clean copy is block-causal.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

import torch
from torch import Tensor

from dllm_engine.models.context import block_causal_mask as causal_by_block
from ..tasks import Example

MAX_CANVAS = 256  # longest response canvas trained on (the ODB benchmarks run 256 new tokens)


@dataclass
class Batch:
    input_ids: Tensor  # [B, L'] what the model reads (L' = 2L for block diffusion)
    targets: Tensor  # [B, L] clean tokens of the noisy part
    is_masked: Tensor  # [B, L] positions the loss is taken on
    weight: Tensor  # [B] 1/t
    attention_mask: Tensor | None  # [1, 1, L', L'] bool for block diffusion, None = full
    position_ids: Tensor | None  # [1, L'] for block diffusion
    content_length: int  # prompt + response + one EOS of the longest row: the causal loss's span

    def to(self, device: torch.device) -> "Batch":
        """The batch on ``device`` (batches are drawn on the CPU, so a run's data and noise are
        the same on every device)."""
        move = lambda t: None if t is None else t.to(device, non_blocking=True)  # noqa: E731
        return Batch(move(self.input_ids), move(self.targets), move(self.is_masked), move(self.weight),
                     move(self.attention_mask), move(self.position_ids), self.content_length)


@dataclass
class Encoder:
    """Turns task examples into (prompt ids, response ids) with the checkpoint's chat template."""
    tokenizer: object  # transformers tokenizer
    end_of_turn_id: int
    eos_id: int
    mask_id: int

    def encode(self, ex: Example) -> tuple[list[int], list[int]]:
        prompt = self.tokenizer.apply_chat_template([{"role": "user", "content": ex.prompt}],
                                                    add_generation_prompt=True, tokenize=True,
                                                    return_dict=False)
        answer = self.tokenizer.encode(ex.answer, add_special_tokens=False)
        return list(prompt), answer + [self.end_of_turn_id]


LONG_TAILS = 0.05  # share of masked diffusion batches whose canvas runs on to up to MAX_CANVAS


def response_length(rng: random.Random, longest: int, long_tails: float) -> int:
    """Canvas length for responses: mostly a short EOS tail, in a ``long_tails`` share of batches
    up to MAX_CANVAS, so the model learns that the answer's end is not tied to the canvas end.
    Block diffusion stops after the block holding EOS, so it never needs long tails (0)."""
    if long_tails > 0 and rng.random() < long_tails:
        return rng.randint(longest, MAX_CANVAS)
    return min(MAX_CANVAS, longest + rng.randint(0, 32))


def pack_rows(rows: list[tuple[list[int], list[int]]], eos_id: int, rng: random.Random,
              multiple: int = 1, long_tails: float = LONG_TAILS) -> tuple[Tensor, Tensor]:
    """Rows all ending at one canvas length L (a multiple of ``multiple``): prompt, response,
    EOS padding. Returns ids [B, L] and is_response [B, L]."""
    longest = max(len(r) for _, r in rows)
    total = max(len(p) for p, _ in rows) + response_length(rng, longest, long_tails)
    total = -(-total // multiple) * multiple
    ids, is_resp = [], []
    for prompt, resp in rows:
        pad = total - len(prompt) - len(resp)
        ids.append(prompt + resp + [eos_id] * pad)
        is_resp.append([False] * len(prompt) + [True] * (len(resp) + pad))
    return torch.tensor(ids), torch.tensor(is_resp)


MIN_T = 0.1  # floor of the masking rate: bounds the 1/t loss weight at 10


def noise(ids: Tensor, is_resp: Tensor, mask_id: int, gen: torch.Generator,
          suffix_mask: float = 0.0) -> tuple[Tensor, Tensor, Tensor]:
    """Mask response tokens with probability t per row. t is stratified over the batch and kept
    >= MIN_T: with t ~ U(0, 1) and 1/t weights, a batch of 32 often holds a row with t < 0.01 whose
    one or two masked tokens (weight > 100) dominate the step's gradient; large-batch pretraining
    averages that out, a small batch does not."""
    b = ids.shape[0]
    strata = (torch.arange(b) + torch.rand(b, generator=gen)) / b
    t = (MIN_T + (1 - MIN_T) * strata[torch.randperm(b, generator=gen)])[:, None]
    is_masked = (torch.rand(ids.shape, generator=gen) < t) & is_resp
    weight = 1.0 / t[:, 0]
    if suffix_mask > 0:  # drawn only when asked, so runs without it replay bit for bit
        is_masked, weight = mask_suffixes(is_masked, is_resp, weight, gen, suffix_mask)
    return torch.where(is_masked, torch.full_like(ids, mask_id), ids), is_masked, weight


SUFFIX_WINDOW = 32  # a suffix row's partly masked span after its cut: the block being decoded


def mask_suffixes(is_masked: Tensor, is_resp: Tensor, weight: Tensor, gen: torch.Generator,
                  share: float) -> tuple[Tensor, Tensor]:
    """Turn a ``share`` of the rows into the state a left-to-right (semi-autoregressive) decoder
    is in: the response is clean before a random cut, masked with the row's rate t for up to a
    block after it, and fully masked beyond.

    With uniform random masking alone, a worked answer's intermediate result is nearly always
    readable further right (the next clause repeats it), so the bidirectional model learns to
    copy it from there and never to compute it; a decoder that goes left to right finds the right
    masked. The tiny checkpoints computed 100% of the running sums causally but ~10% (chance)
    with the right masked after 2400 steps of uniform masking alone. The weight becomes
    1 / (share of the response masked), the per-row normalisation the uniform rows have."""
    b, length = is_masked.shape
    chosen = torch.rand(b, generator=gen) < share
    resp_start = is_resp.float().argmax(1)
    resp_len = is_resp.sum(1)
    cut = resp_start + (torch.rand(b, generator=gen) * resp_len).long()
    window = torch.randint(0, SUFFIX_WINDOW + 1, (b,), generator=gen)
    pos = torch.arange(length)[None]
    suffix = (pos >= cut[:, None]) & ((pos >= (cut + window)[:, None]) | is_masked) & is_resp
    is_masked = torch.where(chosen[:, None], suffix, is_masked)
    share_masked = (is_masked.sum(1) / resp_len.clamp(min=1)).clamp(min=MIN_T)
    return is_masked, torch.where(chosen, 1.0 / share_masked, weight)


def masked_diffusion_batch(enc: Encoder, examples: list[Example], seed: int,
                           suffix_mask: float = 0.0, long_tails: float = LONG_TAILS) -> Batch:
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    ids, is_resp = pack_rows([enc.encode(e) for e in examples], enc.eos_id, rng, long_tails=long_tails)
    noisy, is_masked, weight = noise(ids, is_resp, enc.mask_id, gen, suffix_mask)
    return Batch(noisy, ids, is_masked, weight, None, None, content_length(ids, is_resp, enc.eos_id))


def block_causal_mask(length: int, block_size: int, device=None) -> Tensor:
    """[1, 1, L, L] bool: query i reads key j when j's block (``block_size`` tokens counted from
    the first) is not after i's. The clean copy's attention under block diffusion."""
    positions = torch.arange(length, device=device)
    return causal_by_block(positions, positions, block_size)[None, None]


def block_diffusion_mask(length: int, block_size: int) -> Tensor:
    """[1, 1, 2L, 2L] bool over [noisy ; clean]."""
    causal = block_causal_mask(length, block_size)[0, 0]
    same = causal & causal.T  # key and query in one block
    before = causal & ~same  # the key's block is an earlier one
    top = torch.cat([same, before], dim=1)  # noisy queries: own noisy block + earlier clean blocks
    bottom = torch.cat([torch.zeros_like(same), causal], dim=1)  # clean queries: block-causal
    return torch.cat([top, bottom], dim=0)[None, None]


def block_diffusion_batch(enc: Encoder, examples: list[Example], seed: int, block_size: int,
                          suffix_mask: float = 0.0) -> Batch:
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    ids, is_resp = pack_rows([enc.encode(e) for e in examples], enc.eos_id, rng, block_size,
                             long_tails=0.0)
    noisy, is_masked, weight = noise(ids, is_resp, enc.mask_id, gen, suffix_mask)
    length = ids.shape[1]
    positions = torch.arange(length).repeat(2)[None]
    return Batch(torch.cat([noisy, ids], dim=1), ids, is_masked, weight,
                 block_diffusion_mask(length, block_size), positions, content_length(ids, is_resp, enc.eos_id))


def content_length(ids: Tensor, is_resp: Tensor, eos_id: int) -> int:
    """Columns up to and including the first response EOS of the row whose EOS comes last."""
    is_eos = (ids == eos_id) & is_resp
    first = torch.where(is_eos.any(1), is_eos.float().argmax(1), torch.full((ids.shape[0],), ids.shape[1] - 1))
    return int(first.max()) + 1
