"""Train the embedded tiny checkpoints on the task suite (CPU or GPU, seeded, resumable).

Every step's examples and noise are drawn from seeds derived from (seed, step), so a run killed
midway resumes from its last saved state and continues exactly as if it had never stopped.
"""
from __future__ import annotations

import fnmatch
import itertools
import json
import math
import os
import random
import shutil
import signal
import threading
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from dllm_engine.errors import UserError
from dllm_engine.config import ModelConfig
from dllm_engine.models import DiffusionLM, get_family, save_model
from dllm_engine.models.loader import parse_device
from dllm_engine.outputs import write_atomic
from ..tasks import check_mix, train_examples
from ..tokenizer import save_tokenizer
from .canvases import CanvasRows
from .data import LONG_TAILS, Batch, Encoder, block_diffusion_batch, masked_diffusion_batch

POOL = 4  # batches per length-sorted pool

FAMILY_SPECIALS = {  # family -> (model_type, mask token, end-of-turn token)
    "llada": ("llada", "<|mdm_mask|>", "<|eot_id|>"),
    "sdar": ("sdar", "<|MASK|>", "<|im_end|>"),
}
# A resumed run (--work holding a state.pt) must have the saved run's settings: the model's (family
# and the shapes; exporting the saved state needs these only) and the training's, since the resume
# is exact. Free to change: steps (extend a run), where it writes, how often it saves, the
# generation config of the export, and the device (a CPU run may go on on a GPU and back). A new stage with other settings is a new --work (--init-from).
MODEL_KEYS = ("family", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size",
              "block_size")
RESUME_FREE = ("steps", "out", "work", "save_every", "max_new_tokens", "device")
# files of an older export in --out that a new export drops (other files, e.g. a model card, stay)
CHECKPOINT_FILES = ("*.safetensors", "*.safetensors.index.json", "pytorch_model*.bin",
                    "pytorch_model*.bin.index.json", "tokenizer*", "vocab.*", "merges.txt",
                    "added_tokens.json")


class Interrupted(Exception):
    """``Trainer.train`` stopped by SIGINT / SIGTERM: the state is saved, rerunning resumes."""

    def __init__(self, signum: int, message: str) -> None:
        super().__init__(message)
        self.signum = signum

    @property
    def exit_code(self) -> int:  # the shell's convention: 130 for SIGINT, 143 for SIGTERM
        return 128 + self.signum


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
    device: str = "cpu"  # where the model trains; batches are drawn on the CPU either way
    canvas_rows: list[str] | None = None  # files of rows from a model's own canvases (canvases.py), joined
    canvas_batch: int = 8  # of them per step
    canvas_weight: float = 1.0  # weight of their masked-diffusion loss
    new_rows_first: int = 0  # with init_from a smaller vocabulary: steps that train only the new words' rows
    distill_from: str | None = None  # a checkpoint whose predictions the model keeps on the rows it can read
    distill_weight: float = 1.0  # weight of that KL term

    def __post_init__(self) -> None:
        if self.family not in FAMILY_SPECIALS:
            raise UserError(f"family must be one of {sorted(FAMILY_SPECIALS)}, got {self.family!r}")
        if self.ar_weight < 0:
            raise UserError(f"ar_weight must be >= 0, got {self.ar_weight}")
        if self.block_aux < 0 or (self.block_aux and self.family == "sdar"):
            raise UserError(f"block_aux must be >= 0 and is for full-attention families (sdar's "
                            f"objective is block diffusion already), got {self.block_aux}")
        if not 0 <= self.suffix_mask <= 1:
            raise UserError(f"suffix_mask must be in [0, 1], got {self.suffix_mask}")
        if not 0 <= self.long_tails <= 1:
            raise UserError(f"long_tails must be in [0, 1], got {self.long_tails}")
        if self.steps < 1 or self.batch_size < 1:
            raise UserError("steps and batch_size must be >= 1")
        if self.save_every < 1:
            raise UserError(f"save_every must be >= 1, got {self.save_every}")
        if self.canvas_batch < 1 or self.canvas_weight < 0:
            raise UserError(f"canvas_batch must be >= 1 and canvas_weight >= 0, got {self.canvas_batch} "
                            f"and {self.canvas_weight}")
        if self.new_rows_first < 0 or (self.new_rows_first and not self.init_from):
            raise UserError(f"new_rows_first must be >= 0 and needs init_from (a checkpoint whose vocabulary "
                            f"the run grows), got {self.new_rows_first}")
        if self.distill_weight < 0:
            raise UserError(f"distill_weight must be >= 0, got {self.distill_weight}")
        if isinstance(self.canvas_rows, str):  # one file, as older runs saved it
            self.canvas_rows = [self.canvas_rows]
        check_mix(self.task_mix)  # a bad mix fails here, not at the first step
        parse_device(self.device)  # an unusable device fails here, with the devices to use


VOCAB_ROWS = ("embed_tokens.weight", "lm_head.weight")  # parameters whose rows are token ids
RESIDUAL_WRITES = ("o_proj.weight", "down_proj.weight")  # what a layer adds to the residual stream
SAME_WHEN_GROWN = ("hidden_size", "num_heads", "num_kv_heads", "head_dim")  # a grown model keeps these


def grow_weights(source: dict[str, torch.Tensor], target: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``source``'s weights in a model that extends it: a larger vocabulary (the tokenizer appends
    words, so the old ids keep their meaning), wider MLPs, more layers (appended after the source's).
    What the source has is copied; the rest keeps ``target``'s fresh initialisation, except what
    writes to the residual stream (new MLP units' ``down_proj`` columns, a new layer's ``o_proj``
    and ``down_proj``), which starts at zero: the grown model computes what the source computed
    (new words aside) and its new parts learn from there."""
    lacking = sorted(set(source) - set(target))
    if lacking:
        raise UserError(f"the checkpoint has weights this model lacks ({', '.join(lacking[:3])}"
                        f"{', ...' if len(lacking) > 3 else ''}): a model grown from it needs at least its layers")
    out = {}
    for name, fresh in target.items():
        if name not in source:  # a new layer: the identity until it learns
            out[name] = torch.zeros_like(fresh) if name.endswith(RESIDUAL_WRITES) else fresh
            continue
        old = source[name]
        if old.shape == fresh.shape:
            out[name] = old
            continue
        if old.dim() != fresh.dim() or any(o > f for o, f in zip(old.shape, fresh.shape)):
            raise UserError(f"{name} is {tuple(old.shape)} in the checkpoint and {tuple(fresh.shape)} here: "
                            f"a model grown from a checkpoint only adds words, MLP units or layers")
        grown = torch.zeros_like(fresh) if name.endswith("down_proj.weight") else fresh.clone()
        grown[tuple(slice(0, n) for n in old.shape)] = old
        out[name] = grown
    return out


def grown_rows(source: dict[str, torch.Tensor], target: dict[str, torch.Tensor]) -> dict[str, int]:
    """The parameters whose rows are vocabulary ids that ``target`` extends (embedding and head),
    each with the number of rows it has in ``source``."""
    return {name: source[name].shape[0] for name in VOCAB_ROWS
            if name in source and name in target and source[name].shape[0] < target[name].shape[0]}


def keep_other_files(old: Path, new: Path) -> None:
    """Link (or copy) into ``new`` the entries of ``old`` that it lacks, except checkpoint files."""
    for entry in old.iterdir():
        dest = new / entry.name
        if dest.exists() or dest.is_symlink() or any(fnmatch.fnmatch(entry.name, p) for p in CHECKPOINT_FILES):
            continue
        if entry.is_symlink():
            os.symlink(os.readlink(entry), dest)
        elif entry.is_dir():
            shutil.copytree(entry, dest, symlinks=True, copy_function=link_or_copy)
        else:
            link_or_copy(entry, dest)


def link_or_copy(src, dst) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def replace_folder(new: Path, target: Path) -> None:
    """Rename ``new`` to ``target``; an existing ``target`` is renamed aside first (put back if
    the second rename fails) and deleted after."""
    if not target.exists():
        os.rename(new, target)
        return
    old = target.with_name(f".{target.name}.old-{os.getpid()}")
    shutil.rmtree(old, ignore_errors=True)
    os.rename(target, old)
    try:
        os.rename(new, target)
    except BaseException:
        os.rename(old, target)
        raise
    shutil.rmtree(old, ignore_errors=True)


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
        self.canvases = self.load_canvas_rows() if cfg.canvas_rows else None  # refused before weights load
        self.family = get_family(model_type)
        self.init_weights()
        self.grown: dict[str, int] = {}  # parameter -> rows it had in init_from (the rest are new words)
        if cfg.init_from:
            self.load_weights(cfg.init_from)
        self.device = parse_device(cfg.device)
        self.model.to(self.device)
        self.teacher = self.load_teacher(cfg.distill_from) if cfg.distill_from else None
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr, betas=(0.9, 0.95),
                                     weight_decay=0.01)
        self.step = 0
        self.saved_step: int | None = None  # the step of work's state.pt, once read or written
        self._stop: int | None = None  # the signal that asked the loop to stop
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

    def load_checkpoint(self, path: str, flag: str) -> DiffusionLM:
        """The checkpoint ``flag`` names, refused unless it is of this run's family."""
        from dllm_engine.models import load_model
        model = load_model(path)
        if model.config.model_type != self.model.config.model_type:
            raise UserError(f"{flag} {path} is a {model.config.model_type} checkpoint, "
                            f"not {self.model.config.model_type}")
        return model

    def load_weights(self, path: str) -> None:
        source = self.load_checkpoint(path, "--init-from")
        differ = [f"{k} {getattr(source.config, k)} (checkpoint) vs {getattr(self.model.config, k)} (here)"
                  for k in SAME_WHEN_GROWN if getattr(source.config, k) != getattr(self.model.config, k)]
        if differ:
            raise UserError(f"--init-from {path}: a model grown from a checkpoint keeps its widths and "
                            f"heads; {'; '.join(differ)}")
        old, fresh = source.state_dict(), self.model.state_dict()
        self.model.load_state_dict(grow_weights(old, fresh))
        self.grown = grown_rows(old, fresh)
        if self.cfg.new_rows_first and not self.grown:
            raise UserError(f"--new-rows-first: {path} has this run's whole vocabulary; there are no new "
                            f"words to train first")

    def load_teacher(self, path: str) -> DiffusionLM:
        teacher = self.load_checkpoint(path, "--distill-from")
        if teacher.config.vocab_size > self.model.config.vocab_size:
            raise UserError(f"--distill-from {path} has {teacher.config.vocab_size} words, more than this "
                            f"model's {self.model.config.vocab_size}")
        return teacher.to(self.device).eval().requires_grad_(False)

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
                                         self.cfg.suffix_mask).to(self.device)
        return masked_diffusion_batch(self.encoder, self.examples(step), seed, self.cfg.suffix_mask,
                                      self.cfg.long_tails).to(self.device)

    def block_batch(self, step: int) -> Batch:
        """The same examples under the block diffusion objective (``block_aux``): each noisy
        block reads the clean blocks before it, so every block of a worked answer trains the
        model to compute the next result from a clean left context (uniform masks mostly leave
        it a copy to read on the right)."""
        seed = self.cfg.seed * 1_000_003 + step + 500_009
        return block_diffusion_batch(self.encoder, self.examples(step), seed, self.cfg.block_size,
                                     self.cfg.suffix_mask).to(self.device)

    def load_canvas_rows(self) -> CanvasRows:
        """The rows of every ``canvas_rows`` file joined into one set (``CanvasRows.joined``
        refuses files that disagree), checked against this run's decoder kind and tokenizer."""
        rows = CanvasRows.joined([CanvasRows.load(path) for path in self.cfg.canvas_rows])
        files = " ".join(self.cfg.canvas_rows)
        block = self.model.config.block_size  # None for full attention
        if rows.block_size != block:
            written = f"a block decoder's, blocks of {rows.block_size}" if rows.block_size else "a full-attention decoder's"
            wanted = f"a block decoder's with blocks of {block}" if block else "a full-attention decoder's"
            raise UserError(f"canvas rows {files} are {written}; a {self.cfg.family} run trains on "
                            f"{wanted} (`dllm canvas-rows` with the method this family decodes with)")
        meta, enc = rows.meta, self.encoder
        mine = {"mask_id": enc.mask_id, "eos_id": enc.eos_id, "end_of_turn_id": enc.end_of_turn_id}
        theirs = {k: meta.get(k) for k in mine}
        if theirs != mine or meta.get("vocab_size", 0) > len(self.tokenizer):
            raise UserError(f"canvas rows {files} were written with another tokenizer ({theirs}, "
                            f"{meta.get('vocab_size')} tokens) than this run's ({mine}, {len(self.tokenizer)} tokens)")
        return rows

    def canvas_batch(self, step: int) -> Batch:
        """``canvas_batch`` rows of ``canvas_rows``, drawn from the step's seed."""
        n = len(self.canvases.inputs)
        picks = random.Random(self.cfg.seed * 1_000_003 + step + 900_001).sample(range(n), min(n, self.cfg.canvas_batch))
        return self.canvases.batch(picks, self.encoder.mask_id, self.encoder.eos_id).to(self.device)

    def pool(self, pool_seed: int) -> list:
        """The length-sorted pool drawn from ``pool_seed``, built once for its POOL steps."""
        if self._pool is None or self._pool[0] != pool_seed:
            pool = list(itertools.islice(train_examples(pool_seed, mix=self.cfg.task_mix),
                                         POOL * self.cfg.batch_size))
            pool.sort(key=lambda e: len(e.answer.split()))
            self._pool = (pool_seed, pool)
        return self._pool[1]

    def loss(self, b: Batch, logits: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(diffusion loss, auxiliary causal loss); the step minimises diffusion + ar_weight * causal."""
        diffusion = self.diffusion_loss(b, logits)
        if self.cfg.ar_weight == 0:
            return diffusion, torch.zeros((), device=diffusion.device)
        return diffusion, self.causal_loss(b.targets[:, : b.content_length])

    def masked_logits(self, b: Batch, model: DiffusionLM | None = None,
                      rows: torch.Tensor | None = None) -> torch.Tensor:
        """``model``'s (default: the one training) logits at the masked slots of ``b``'s ``rows``
        (default all), row by row."""
        model = self.model if model is None else model
        ids, is_masked = (b.input_ids, b.is_masked) if rows is None else (b.input_ids[rows], b.is_masked[rows])
        ctx = model.plain_context(ids, b.attention_mask, b.position_ids)
        hidden = model.forward_context(ids, ctx)[:, : b.targets.shape[1]]
        return model.logits(hidden[is_masked])

    def diffusion_loss(self, b: Batch, logits: torch.Tensor | None = None) -> torch.Tensor:
        logits = self.masked_logits(b) if logits is None else logits
        ce = F.cross_entropy(logits, b.targets[b.is_masked], reduction="none")
        weight = b.weight[:, None].expand_as(b.targets)[b.is_masked]
        # LLaDA SFT normalises by the response length; every row is the same length here
        return (ce * weight).sum() / max(1, int(b.is_masked.numel()))

    def distill_loss(self, b: Batch, logits: torch.Tensor) -> torch.Tensor:
        """KL(teacher || model) at the masked slots (``logits``: the model's there) of the rows
        whose every id the teacher knows (``distill_from``, e.g. the checkpoint a grown vocabulary
        started from), weighted and normalised as the diffusion loss is: the model keeps the
        teacher's whole distribution on what the teacher could already do, not only its gold
        words. The model's mass on words the teacher lacks counts against it there."""
        vocab = self.teacher.config.vocab_size
        rows = (b.input_ids < vocab).all(1)
        if not rows.any():
            return torch.zeros((), device=logits.device)
        with torch.no_grad():
            teacher = F.log_softmax(self.masked_logits(b, self.teacher, rows).float(), -1)
        slot_rows = rows[:, None].expand_as(b.is_masked)[b.is_masked]
        model = F.log_softmax(logits[slot_rows].float(), -1)[:, :vocab]
        kl = (teacher.exp() * (teacher - model)).sum(-1)
        weight = b.weight[:, None].expand_as(b.is_masked)[b.is_masked][slot_rows]
        return (kl * weight).sum() / max(1, int(b.is_masked.numel()))

    def causal_loss(self, ids: torch.Tensor) -> torch.Tensor:
        """Next-token cross-entropy of the clean rows under a causal mask (prompt, answer, first EOS).

        The checkpoint stays a masked-diffusion model: inference never runs it causally. This
        auxiliary loss only speeds up learning, the way Dream and SDAR start from AR weights: the
        causal pass forms copy and retrieval circuits several times faster than the masked
        objective does, and the bidirectional pass reuses them (the checkpoints trained without it
        scored 0% held-out; see their model cards).
        """
        n = ids.shape[1]
        causal = torch.ones(n, n, dtype=torch.bool, device=ids.device).tril()[None, None]
        hidden = self.model.forward_context(ids, self.model.plain_context(ids, causal))
        return F.cross_entropy(self.model.logits(hidden[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())

    # -- persistence ---------------------------------------------------------------------
    def save_state(self) -> None:
        state = {"model": self.model.state_dict(), "opt": self.opt.state_dict(),
                 "step": self.step, "config": asdict(self.cfg)}
        write_atomic(self.work / "state.pt", lambda f: torch.save(state, f))
        self.saved_step = self.step

    def load_state(self, training: bool = True) -> None:
        """Continue from work's state.pt, if any; a ValueError if it was saved with other settings
        (``training``: all the settings, else those that make the model's shapes)."""
        path = self.work / "state.pt"
        if not path.is_file():
            return
        state = torch.load(path, map_location="cpu", weights_only=True)
        self.check_resume(state.get("config"), training)
        self.check_shapes(state["model"])
        self.model.load_state_dict(state["model"])
        self.opt.load_state_dict(state["opt"])
        self.step = self.saved_step = state["step"]

    def check_resume(self, saved: dict | None, training: bool) -> None:
        if saved is None:
            return
        now = asdict(self.cfg)
        defaults = {f.name: f.default for f in fields(TrainConfig)}  # keys older states lack
        keys = MODEL_KEYS if not training else [k for k in now if k not in RESUME_FREE]

        def value(cfg: dict, key: str):
            v = cfg.get(key, defaults[key])
            if key == "canvas_rows" and isinstance(v, str):  # one file, as older runs saved it
                return [v]
            return os.path.normpath(v) if key in ("init_from", "distill_from") and v else v
        diffs = [f"{k} {value(saved, k)} (saved) vs {value(now, k)} (now)"
                 for k in keys if value(saved, k) != value(now, k)]
        if diffs:
            free = ", ".join(f"--{k.replace('_', '-')}" for k in RESUME_FREE if k != "work")
            raise UserError(f"--work {self.work} holds a run saved with other settings: "
                            f"{'; '.join(diffs)}. Resume it with its own settings (only {free} "
                            f"may change), or start a new stage in a new --work "
                            f"(--init-from a checkpoint to continue from its weights)")

    def check_shapes(self, saved: dict[str, torch.Tensor]) -> None:
        ours = self.model.state_dict()
        diffs = [f"{n} {tuple(saved[n].shape) if n in saved else 'missing'} (saved) vs "
                 f"{tuple(ours[n].shape) if n in ours else 'missing'} (now)"
                 for n in sorted(set(saved) | set(ours))
                 if n not in saved or n not in ours or saved[n].shape != ours[n].shape]
        if diffs:
            raise UserError(f"--work {self.work}: state.pt does not fit this model ({'; '.join(diffs[:4])}); "
                            f"did the tokenizer's vocabulary change? Start a new --work with "
                            f"--init-from the last export (it grows the vocabulary)")

    def trim_log(self) -> None:
        """Drop log lines after the saved step: they are recomputed identically on resume."""
        log = self.work / "loss.jsonl"
        if log.is_file():
            lines = [l for l in log.read_text().splitlines() if json.loads(l)["step"] < self.step]
            log.write_text("".join(l + "\n" for l in lines))

    def export(self) -> Path:
        """Write the checkpoint to a temporary sibling of --out, then swap it in: a failed or
        killed export leaves the previous checkpoint whole. The previous export's weights and
        tokenizer files go (stale shards would be read with the new ones); other files stay."""
        out = Path(self.cfg.out)
        target = Path(os.path.realpath(out))  # a symlinked --out: replace the folder it points to
        if target.exists() and not target.is_dir():
            raise UserError(f"--out {out} is a file; give a checkpoint folder")
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            self.write_checkpoint(tmp)
            if target.is_dir():
                keep_other_files(target, tmp)
            replace_folder(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return out

    def write_checkpoint(self, out: Path) -> None:
        save_model(self.model, out, self.family)
        save_tokenizer(out, self.cfg.family)
        gen = {"block_length": self.cfg.block_size, "max_new_tokens": self.cfg.max_new_tokens,
               "eos_token_id": [self.encoder.eos_id, self.encoder.end_of_turn_id],
               "mask_token_id": self.encoder.mask_id, "pad_token_id": self.encoder.eos_id,
               "bos_token_id": self.tokenizer.bos_token_id}
        (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")

    def export_saved(self) -> Path:
        """Export the last saved state of ``work`` without training (a mid-run check of a run
        that is still going: its state.pt is replaced atomically)."""
        if not (self.work / "state.pt").is_file():
            raise UserError(f"no saved state in {self.work} (state.pt) to export")
        self.load_state(training=False)
        self.model.eval()
        return self.export()

    # -- loop ------------------------------------------------------------------------------
    def train(self) -> Path:
        """Train to ``steps`` and export. SIGINT / SIGTERM finish the current step, save the state
        and raise Interrupted (a second signal raises it at once, keeping the last saved state)."""
        with self.stop_on_signals():
            self.load_state()
            self.trim_log()
            self.model.train()
            bar = tqdm(range(self.step, self.cfg.steps), initial=self.step, total=self.cfg.steps,
                       desc=f"train {self.cfg.family}")
            start = time.time()
            with bar, (self.work / "loss.jsonl").open("a") as log:  # closed on the way out, too
                for step in bar:
                    terms = self.train_step(step)
                    log.write(json.dumps({"step": step, **{k: round(v, 5) for k, v in terms.items()},
                                          "lr": self.lr_at(step),
                                          "elapsed_s": round(time.time() - start, 1)}) + "\n")
                    log.flush()
                    bar.set_postfix({k: f"{v:.4f}" for k, v in terms.items()})
                    self.step = step + 1
                    if self.step % self.cfg.save_every == 0 or self.step == self.cfg.steps or self._stop:
                        self.save_state()
                    if self._stop:
                        raise Interrupted(self._stop, f"interrupted at step {self.step}; state saved to "
                                                      f"{self.work}; rerun the same command to resume")
            self.model.eval()
            return self.export()  # a signal now lets the export finish

    @contextmanager
    def stop_on_signals(self):
        """SIGINT and SIGTERM set ``_stop`` for the loop (main thread only; an ignored signal stays
        ignored, e.g. SIGINT of a job a script started with ``&``); the previous handlers are back
        afterwards."""
        self._stop = None
        if threading.current_thread() is not threading.main_thread():
            yield
            return

        def handler(signum, frame):
            if self._stop is None:
                self._stop = signum
                return
            kept = (f"the state of step {self.saved_step} is kept in {self.work}"
                    if self.saved_step is not None else f"no state saved yet in {self.work}")
            raise Interrupted(signum, f"interrupted again; {kept}; rerun the same command to resume")
        previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)
                    if signal.getsignal(s) is not signal.SIG_IGN}
        for s in previous:
            signal.signal(s, handler)
        try:
            yield
        finally:
            for s, old in previous.items():
                signal.signal(s, signal.SIG_DFL if old is None else old)

    def train_step(self, step: int) -> dict[str, float]:
        """One optimizer step. Returns each loss term it minimised, unweighted, by name: ``loss``
        (the diffusion loss of the step's examples) and ``ar_loss`` always, ``distill_loss``,
        ``block_loss`` and ``canvas_loss`` where the run has them, and ``total``, the weighted sum
        the step descended."""
        for group in self.opt.param_groups:
            group["lr"] = self.lr_at(step)
        b = self.batch(step)
        logits = self.masked_logits(b)
        diffusion, causal = self.loss(b, logits)
        terms = {"loss": (diffusion, 1.0), "ar_loss": (causal, self.cfg.ar_weight)}
        if self.teacher is not None:
            terms["distill_loss"] = (self.distill_loss(b, logits), self.cfg.distill_weight)
        if self.cfg.block_aux:
            terms["block_loss"] = (self.diffusion_loss(self.block_batch(step)), self.cfg.block_aux)
        if self.canvases is not None:
            terms["canvas_loss"] = (self.diffusion_loss(self.canvas_batch(step)), self.cfg.canvas_weight)
        total = sum(weight * term for term, weight in terms.values())
        self.opt.zero_grad(set_to_none=True)
        total.backward()
        rows_only = step < self.cfg.new_rows_first
        if rows_only:
            kept = self.keep_new_rows_grads()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        if rows_only:  # AdamW's weight decay would still shrink the loaded rows
            with torch.no_grad():
                for p, rows in kept:
                    p[: rows.shape[0]] = rows
        return {**{name: term.item() for name, (term, _) in terms.items()}, "total": total.item()}

    def keep_new_rows_grads(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """A ``new_rows_first`` step: drop every gradient but the new words' embedding and head
        rows (the optimizer skips a parameter without one), so the loaded model stays as it was
        while the words it never saw get rows. Returns (parameter, its loaded rows) to restore."""
        kept = []
        for name, p in self.model.named_parameters():
            rows = self.grown.get(name)
            if rows is None:
                p.grad = None
            else:
                if p.grad is not None:
                    p.grad[:rows] = 0
                kept.append((p, p.detach()[:rows].clone()))
        return kept
