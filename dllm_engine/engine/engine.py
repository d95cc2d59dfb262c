"""The engine loop: admit waiting sequences, plan, forward once for the whole batch, commit.

Sequences join and leave at step boundaries, each with its own block cursor, so the same loop
serves offline ``LLM.generate`` and the server's continuous batching."""
from __future__ import annotations

import time
from collections import deque

import torch

from ..decoding import confidence, sample_tokens
from ..decoding.decoders import plan_step, select
from ..models.layers import DiffusionLM
from .kv_cache import KVCache
from .runner import Runner
from .sequence import Sequence


class Engine:
    def __init__(self, model: DiffusionLM, max_num_seqs: int = 256) -> None:
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        cfg = model.config
        device = next(model.parameters()).device
        dtype = next(model.parameters()).dtype
        self.model = model
        self.runner = Runner(model)
        self.cache = KVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, dtype, device)
        self.max_num_seqs = max_num_seqs
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def admit(self) -> None:
        new = []
        while self.waiting and len(self.running) + len(new) < self.max_num_seqs:
            seq = self.waiting.popleft()
            seq.start_time = time.perf_counter()
            new.append(seq)
        if new:
            need = max(s.canvas_len for s in self.running + new)
            self.cache.reshape_rows(list(range(len(self.running))), len(new), need)
            self.running += new

    @torch.inference_mode()
    def step(self) -> list[Sequence]:
        """One denoising step for every running sequence; returns those that finished."""
        self.admit()
        if not self.running:
            return []
        plans = [plan_step(s, self.runner.shift) for s in self.running]
        outputs = self.runner.forward(self.running, plans, self.cache)
        for seq, (positions, logits) in zip(self.running, outputs):
            self.commit(seq, positions, logits)
        return self.release_finished()

    def commit(self, seq: Sequence, positions: torch.Tensor, logits: torch.Tensor) -> None:
        p = seq.params
        if p.base_method == "block":  # this forward wrote the final K/V of everything before the block
            seq.committed_len = seq.block[0]
        if positions.numel():
            # a mask is never a valid prediction; committing one would leave the slot masked forever
            logits[:, seq.ids.mask_id] = -float("inf")
            x0 = sample_tokens(logits, p.temperature, seq.generator)
            conf = confidence(logits, x0, p.remasking, seq.generator)
            chosen = select(seq, conf)
            seq.commit(positions[chosen], x0[chosen])
        seq.advance()

    def release_finished(self) -> list[Sequence]:
        done = [s for s in self.running if s.finished]
        if done:
            now = time.perf_counter()
            for s in done:
                s.stats.seconds = now - s.start_time
                s.stats.output_tokens = len(s.output_ids())
            keep = [i for i, s in enumerate(self.running) if not s.finished]
            self.running = [self.running[i] for i in keep]
            self.cache.reshape_rows(keep, 0, 0)
        return done

    def cancel(self, seq_id: int) -> bool:
        """Drop a waiting or running sequence (client went away); frees its slot."""
        for s in list(self.waiting):
            if s.seq_id == seq_id:
                self.waiting.remove(s)
                return True
        for i, s in enumerate(self.running):
            if s.seq_id == seq_id:
                keep = [j for j in range(len(self.running)) if j != i]
                self.running = [self.running[j] for j in keep]
                self.cache.reshape_rows(keep, 0, 0)
                return True
        return False
