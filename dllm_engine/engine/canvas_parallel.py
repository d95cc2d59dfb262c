"""Tensor and expert parallelism for a canvas model (DiffusionGemma): the sampler's batches,
mirrored on every rank.

The masked families' rank 0 sends every step's inputs (engine/parallel.py). A canvas model's
sampler is its own loop (``decoding.diffusion_gemma.CanvasBatch``), and every input of that loop
is plain data: the prompts, each row's ``max_new_tokens`` and seed, the settings. So rank 0 sends
the calls that change a batch (``new``: the settings; ``add``, ``run_canvas``, ``run_step``,
``leave``: their arguments), and every other rank runs the same ``CanvasBatch`` on its slice of the model. The
model's all-reduces give every rank the same hidden states and the same full logits (the
embedding and its tied head are whole on each rank), the draws are keyed by the rows' seeds, so
every rank makes the same decisions and reaches the next collective with the others: one small
message per call (a canvas, or with ``run_step`` a denoising step). Only rank 0 observes the steps (traces, streaming).

Failure: as the masked families' (``TensorParallel.guard``): a call that fails on rank 0, or a
collective that fails or times out, shuts the group down with ``WorkerDied``; a worker's batches
are dropped with rank 0's (the ids of the batches rank 0 let go ride on its next message).
"""
from __future__ import annotations

import itertools
import weakref

import torch

from ..decoding.diffusion_gemma import CanvasBatch, GenerationSettings
from ..models.diffusion_gemma import DiffusionGemma
from .parallel import Channel, RankWorker, TensorParallel

_ids = itertools.count()


class MirroredBatch(CanvasBatch):
    """Rank 0's ``CanvasBatch`` under tensor parallelism: each call that changes it is sent to
    the other ranks first, then run here inside the group's guard."""

    def __init__(self, parallel: TensorParallel, model: DiffusionGemma, settings: GenerationSettings,
                 observe=None) -> None:
        super().__init__(model, settings, None, observe=observe)
        self.parallel, self.id = parallel, next(_ids)
        parallel.send(("new", self.id, settings, drain(parallel.released)))
        # the workers drop theirs with rank 0's next message
        weakref.finalize(self, parallel.released.append, self.id)

    def call(self, method: str, *args):
        self.parallel.send(("call", self.id, method, args, drain(self.parallel.released)))
        return self.parallel.guard(getattr(super(), method), *args)

    def add(self, prompts, max_new_tokens=None, seeds=None) -> list[int]:
        return self.call("add", [list(p) for p in prompts], max_new_tokens, seeds)

    def run_canvas(self) -> list[int]:
        return self.call("run_canvas")  # the model's passes run under no_grad (see CanvasWorker)

    def run_step(self) -> list[int]:
        return self.call("run_step")

    def leave(self, indices: list[int]) -> None:
        return self.call("leave", list(indices))


def drain(ids: list[int]) -> list[int]:
    """Take the ids gathered so far (a finalizer may append meanwhile: those stay)."""
    out = list(ids)
    del ids[:len(out)]
    return out


class CanvasWorker(RankWorker):
    """A rank other than 0: runs rank 0's batch calls on its slice of the model. Not under
    inference mode, as rank 0 does not run them either: torchao's int8 tensors cannot be indexed
    there (an expert's slice of a quantized stack), and the model's passes are no_grad."""

    grad_mode = staticmethod(torch.no_grad)

    def __init__(self, model: DiffusionGemma, channel: Channel) -> None:
        super().__init__(model, channel)
        self.batches: dict[int, CanvasBatch] = {}

    def forget(self, gone: list[int]) -> None:
        for i in gone:
            self.batches.pop(i, None)

    def new(self, batch_id: int, settings: GenerationSettings, gone: list[int]) -> None:
        self.forget(gone)
        self.batches[batch_id] = CanvasBatch(self.model, settings, None)

    def call(self, batch_id: int, method: str, args: tuple, gone: list[int]) -> None:
        self.forget(gone)
        getattr(self.batches[batch_id], method)(*args)
