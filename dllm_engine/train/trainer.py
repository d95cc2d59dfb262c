"""Train the embedded tiny checkpoints on the task suite (CPU, seeded, resumable).

Every step's examples and noise are drawn from seeds derived from (seed, step), so a run killed
midway resumes from its last saved state and continues exactly as if it had never stopped.
"""
from __future__ import annotations

import itertools
import json
import math
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from ..config import ModelConfig
from ..models import DiffusionLM, get_family, save_model
from ..tasks import check_mix, train_examples
from ..tokenizer import save_tokenizer
from .data import LONG_TAILS, Batch, Encoder, block_diffusion_batch, masked_diffusion_batch

POOL = 4  # batches per length-sorted pool

FAMILY_SPECIALS = {  # family -> (model_type, mask token, end-of-turn token)
    "llada": ("llada", "<|mdm_mask|>", "<|eot_id|>"),
    "sdar": ("sdar", "<|MASK|>", "<|im_end|>"),
}


@dataclass
class TrainConfig:
    family: str
    out: str
    work: str
    steps: int = 1500
    batch_size: int = 32
    lr: float = 2e-3
    warmup: int = 100
    seed: int = 0
    hidden_size: int = 128
    num_layers: int = 12
    num_heads: int = 4
    num_kv_heads: int = 4
    intermediate_size: int = 384
    block_size: int = 32  # SDAR: trained block size
    max_new_tokens: int = 256  # written to generation_config.json (worked answers reach 177 tokens)
    save_every: int = 50
    init_from: str | None = None  # continue from a saved checkpoint's weights (fresh optimizer)
    ar_weight: float = 1.0  # auxiliary causal next-token loss; 0 = the pure diffusion objective
    task_mix: dict[str, int] | None = None  # examples per task per round (default 1 each)
    suffix_mask: float = 0.0  # share of rows masked as a left-to-right decoder sees them (data.py)
    block_aux: float = 0.0  # full-attention families: weight of an auxiliary block diffusion loss
    long_tails: float = LONG_TAILS  # masked diffusion: share of batches with canvases up to MAX_CANVAS

    def __post_init__(self) -> None:
        if self.family not in FAMILY_SPECIALS:
            raise ValueError(f"family must be one of {sorted(FAMILY_SPECIALS)}, got {self.family!r}")
        if self.ar_weight < 0:
            raise ValueError(f"ar_weight must be >= 0, got {self.ar_weight}")
        if self.block_aux < 0 or (self.block_aux and self.family == "sdar"):
            raise ValueError(f"block_aux must be >= 0 and is for full-attention families (sdar's "
                             f"objective is block diffusion already), got {self.block_aux}")
        if not 0 <= self.suffix_mask <= 1:
            raise ValueError(f"suffix_mask must be in [0, 1], got {self.suffix_mask}")
        if not 0 <= self.long_tails <= 1:
            raise ValueError(f"long_tails must be in [0, 1], got {self.long_tails}")
        if self.steps < 1 or self.batch_size < 1:
            raise ValueError("steps and batch_size must be >= 1")
        check_mix(self.task_mix)  # a bad mix fails here, not at the first step


def grow_vocab(source: dict[str, torch.Tensor], target: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``source`` weights for a model whose vocabulary extends the source's: the embedding and
    head rows of the source's ids are copied, the new ids keep ``target``'s fresh initialisation
    (the tokenizer appends new words, so the old ids keep their meaning)."""
    out = dict(source)
    for name, fresh in target.items():
        old = source.get(name)
        if old is not None and old.dim() == 2 and old.shape[1] == fresh.shape[1] and old.shape[0] < fresh.shape[0]:
            out[name] = torch.cat([old, fresh[old.shape[0]:]])
    return out


class Trainer:
    def __init__(self, cfg: TrainConfig) -> None:
        from transformers import AutoTokenizer
        self.cfg = cfg
        self.work = Path(cfg.work)
        self.work.mkdir(parents=True, exist_ok=True)
        save_tokenizer(self.work / "tokenizer", cfg.family)
        self.tokenizer = AutoTokenizer.from_pretrained(self.work / "tokenizer")
        model_type, mask_tok, eot_tok = FAMILY_SPECIALS[cfg.family]
        ids = self.tokenizer.convert_tokens_to_ids
        self.encoder = Encoder(self.tokenizer, ids(eot_tok), self.tokenizer.eos_token_id, ids(mask_tok))
        self.model = DiffusionLM(self.model_config(model_type))
        self.family = get_family(model_type)
        self.init_weights()
        if cfg.init_from:
            self.load_weights(cfg.init_from)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr, betas=(0.9, 0.95),
                                     weight_decay=0.01)
        self.step = 0
        self._pool: tuple[int, list] | None = None  # (seed, examples) of the current pool

    def model_config(self, model_type: str) -> ModelConfig:
        c, tok = self.cfg, self.tokenizer
        return ModelConfig(
            model_type=model_type, vocab_size=len(tok), hidden_size=c.hidden_size,
            num_layers=c.num_layers, num_heads=c.num_heads, num_kv_heads=c.num_kv_heads,
            intermediate_size=c.intermediate_size, rope_theta=10000.0,
            rms_norm_eps=1e-5 if model_type == "llada" else 1e-6, qk_norm=model_type == "sdar",
            max_position_embeddings=1024, mask_token_id=self.encoder.mask_id,
            eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
            bos_token_id=tok.bos_token_id,
            attention="block_causal" if model_type == "sdar" else "full",
            block_size=c.block_size if model_type == "sdar" else None)

    def init_weights(self) -> None:
        torch.manual_seed(self.cfg.seed)
        residual_std = 0.02 / math.sqrt(2 * self.cfg.num_layers)
        for name, p in self.model.named_parameters():
            if p.dim() == 2:
                std = residual_std if name.endswith(("o_proj.weight", "down_proj.weight")) else 0.02
                torch.nn.init.normal_(p, 0.0, std)

    def load_weights(self, path: str) -> None:
        from ..models import load_model
        source = load_model(path)
        if source.config.model_type != self.model.config.model_type:
            raise ValueError(f"--init-from {path} is a {source.config.model_type} checkpoint, "
                             f"not {self.model.config.model_type}")
        self.model.load_state_dict(grow_vocab(source.state_dict(), self.model.state_dict()))

    def lr_at(self, step: int) -> float:
        c = self.cfg
        if step < c.warmup:
            return c.lr * (step + 1) / c.warmup
        progress = (step - c.warmup) / max(1, c.steps - c.warmup)
        return c.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))

    def examples(self, step: int) -> list:
        """Length bucketing: a pool of POOL batches is drawn per POOL steps and sorted by answer
        length, so each batch's canvas is tight (padding a 10-token answer to a 120-token
        neighbour's canvas would waste most of the step)."""
        lo = (step % POOL) * self.cfg.batch_size
        return self.pool(self.cfg.seed * 1_000_003 + (step // POOL) * POOL)[lo: lo + self.cfg.batch_size]

    def batch(self, step: int) -> Batch:
        seed = self.cfg.seed * 1_000_003 + step
        if self.cfg.family == "sdar":
            return block_diffusion_batch(self.encoder, self.examples(step), seed, self.cfg.block_size,
                                         self.cfg.suffix_mask)
        return masked_diffusion_batch(self.encoder, self.examples(step), seed, self.cfg.suffix_mask,
                                      self.cfg.long_tails)

    def block_batch(self, step: int) -> Batch:
        """The same examples under the block diffusion objective (``block_aux``): each noisy
        block reads the clean blocks before it, so every block of a worked answer trains the
        model to compute the next result from a clean left context (uniform masks mostly leave
        it a copy to read on the right)."""
        seed = self.cfg.seed * 1_000_003 + step + 500_009
        return block_diffusion_batch(self.encoder, self.examples(step), seed, self.cfg.block_size,
                                     self.cfg.suffix_mask)

    def pool(self, pool_seed: int) -> list:
        """The length-sorted pool drawn from ``pool_seed``, built once for its POOL steps."""
        if self._pool is None or self._pool[0] != pool_seed:
            pool = list(itertools.islice(train_examples(pool_seed, mix=self.cfg.task_mix),
                                         POOL * self.cfg.batch_size))
            pool.sort(key=lambda e: len(e.answer.split()))
            self._pool = (pool_seed, pool)
        return self._pool[1]

    def loss(self, b: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """(diffusion loss, auxiliary causal loss); the step minimises diffusion + ar_weight * causal."""
        diffusion = self.diffusion_loss(b)
        if self.cfg.ar_weight == 0:
            return diffusion, torch.zeros(())
        return diffusion, self.causal_loss(b.targets[:, : b.content_length])

    def diffusion_loss(self, b: Batch) -> torch.Tensor:
        ctx = self.model.plain_context(b.input_ids, b.attention_mask)
        if b.position_ids is not None:
            ctx.positions, ctx.position_bound = b.position_ids.expand_as(b.input_ids), None
        hidden = self.model.forward_context(b.input_ids, ctx)[:, : b.targets.shape[1]]
        logits = self.model.logits(hidden[b.is_masked])
        ce = F.cross_entropy(logits, b.targets[b.is_masked], reduction="none")
        weight = b.weight[:, None].expand_as(b.targets)[b.is_masked]
        # LLaDA SFT normalises by the response length; every row is the same length here
        return (ce * weight).sum() / max(1, int(b.is_masked.numel()))

    def causal_loss(self, ids: torch.Tensor) -> torch.Tensor:
        """Next-token cross-entropy of the clean rows under a causal mask (prompt, answer, first EOS).

        The checkpoint stays a masked-diffusion model: inference never runs it causally. This
        auxiliary loss only speeds up learning, the way Dream and SDAR start from AR weights: the
        causal pass forms copy and retrieval circuits several times faster than the masked
        objective does, and the bidirectional pass reuses them (the checkpoints trained without it
        scored 0% held-out; see their model cards).
        """
        n = ids.shape[1]
        causal = torch.ones(n, n, dtype=torch.bool).tril()[None, None]
        hidden = self.model.forward_context(ids, self.model.plain_context(ids, causal))
        return F.cross_entropy(self.model.logits(hidden[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())

    # -- persistence ---------------------------------------------------------------------
    def save_state(self) -> None:
        tmp = self.work / "state.pt.tmp"
        torch.save({"model": self.model.state_dict(), "opt": self.opt.state_dict(),
                    "step": self.step, "config": asdict(self.cfg)}, tmp)
        os.replace(tmp, self.work / "state.pt")

    def load_state(self) -> None:
        path = self.work / "state.pt"
        if not path.is_file():
            return
        state = torch.load(path, map_location="cpu", weights_only=True)
        self.model.load_state_dict(state["model"])
        self.opt.load_state_dict(state["opt"])
        self.step = state["step"]

    def trim_log(self) -> None:
        """Drop log lines after the saved step: they are recomputed identically on resume."""
        log = self.work / "loss.jsonl"
        if log.is_file():
            lines = [l for l in log.read_text().splitlines() if json.loads(l)["step"] < self.step]
            log.write_text("".join(l + "\n" for l in lines))

    def export(self) -> Path:
        out = Path(self.cfg.out)
        save_model(self.model, out, self.family)
        save_tokenizer(out, self.cfg.family)
        gen = {"block_length": self.cfg.block_size, "max_new_tokens": self.cfg.max_new_tokens,
               "eos_token_id": [self.encoder.eos_id, self.encoder.end_of_turn_id],
               "mask_token_id": self.encoder.mask_id, "pad_token_id": self.encoder.eos_id,
               "bos_token_id": self.tokenizer.bos_token_id}
        (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
        return out

    def export_saved(self) -> Path:
        """Export the last saved state of ``work`` without training (a mid-run check of a run
        that is still going: its state.pt is replaced atomically)."""
        if not (self.work / "state.pt").is_file():
            raise ValueError(f"no saved state in {self.work} (state.pt) to export")
        self.load_state()
        self.model.eval()
        return self.export()

    # -- loop ------------------------------------------------------------------------------
    def train(self) -> Path:
        self.load_state()
        self.trim_log()
        self.model.train()
        log = (self.work / "loss.jsonl").open("a")
        bar = tqdm(range(self.step, self.cfg.steps), initial=self.step, total=self.cfg.steps,
                   desc=f"train {self.cfg.family}")
        start = time.time()
        for step in bar:
            loss, ar_loss = self.train_step(step)
            log.write(json.dumps({"step": step, "loss": round(loss, 5), "ar_loss": round(ar_loss, 5),
                                  "lr": self.lr_at(step),
                                  "elapsed_s": round(time.time() - start, 1)}) + "\n")
            log.flush()
            bar.set_postfix(loss=f"{loss:.4f}", ar_loss=f"{ar_loss:.4f}")
            self.step = step + 1
            if self.step % self.cfg.save_every == 0 or self.step == self.cfg.steps:
                self.save_state()
        log.close()
        self.model.eval()
        return self.export()

    def train_step(self, step: int) -> tuple[float, float]:
        for group in self.opt.param_groups:
            group["lr"] = self.lr_at(step)
        diffusion, causal = self.loss(self.batch(step))
        total = diffusion + self.cfg.ar_weight * causal
        if self.cfg.block_aux:
            total = total + self.cfg.block_aux * self.diffusion_loss(self.block_batch(step))
        self.opt.zero_grad(set_to_none=True)
        total.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        return diffusion.item(), causal.item()
