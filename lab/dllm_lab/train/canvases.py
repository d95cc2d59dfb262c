"""Training rows drawn from a model's own threshold-decoded canvases (``dllm canvas-rows``).

The training stream masks gold answers: every word a row shows right of a masked slot belongs
to the same gold phrasing. A threshold decoder's canvas holds the model's own guesses there,
committed ahead of the frontier, and no gold row shows that state. On the phrased tasks the
decoders lose most answers at such a step (``dllm canvas-probe``). These rows are the states the
decoder visits: the model decodes training prompts with a trace, a few of each answer's canvases
that can still be finished are kept as they stand (committed words as input, masked slots as
masked slots), and the target is a phrasing that fits them, drawn as the task's generator would
write it (``fill_canvas``), then the end of turn and EOS padding.

The rows are written once, from the model a stage starts from, and read by ``dllm train
--canvas-rows``, which adds their loss to each step's. A block-causal decoder (SDAR's ``block``)
writes rows of its own kind: its canvas holds committed blocks, the block being decoded and
nothing after it, so a row is cut at that block's end and trains as one noisy block reading the
clean ones before it, the state block diffusion training masks (``meta["block_size"]``).
"""
from __future__ import annotations

import random
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from dllm_engine.errors import UserError
from dllm_engine.models.context import block_causal_limit
from dllm_engine.outputs import write_atomic
from ..tasks import TASKS, Example
from .data import MIN_T, SUFFIX_WINDOW, Batch, block_diffusion_mask, content_length

if TYPE_CHECKING:
    from dllm_engine.engine.llm import LLM
    from dllm_engine.sampling_params import SamplingParams

FORMAT = "dllm-canvas-rows/1"


@dataclass
class CanvasRows:
    """Rows of one canvas each: ``inputs`` (prompt, then the canvas with the mask id in its
    masked slots) and ``targets`` (prompt, then the finished answer, end of turn, EOS padding),
    the same length per row; ``prompt_lengths`` where each response starts. ``meta["block_size"]``:
    rows of a block-causal decoder, each cut at the end of the block it was decoding (blocks of
    that many positions counted from the first), None or absent for full attention."""
    inputs: list[list[int]] = field(default_factory=list)
    targets: list[list[int]] = field(default_factory=list)
    prompt_lengths: list[int] = field(default_factory=list)
    meta: dict = field(default_factory=dict)

    def save(self, path: str | Path) -> None:
        """Written all at once (``write_atomic``): an interrupted write leaves no partial rows
        file, and the file before it, if any, as it was."""
        write_atomic(path, lambda f: torch.save({"format": FORMAT, **asdict(self)}, f))

    @classmethod
    def load(cls, path: str | Path) -> CanvasRows:
        try:
            saved = torch.load(path, weights_only=True)
        except FileNotFoundError:
            raise UserError(f"canvas rows {path}: no such file") from None
        except Exception as e:  # not a torch file, or a pickle torch refuses
            raise UserError(f"canvas rows {path}: not a file `dllm canvas-rows` writes ({e})") from None
        if not isinstance(saved, dict) or saved.get("format") != FORMAT:
            raise UserError(f"canvas rows {path}: not a file `dllm canvas-rows` writes")
        rows = cls(saved["inputs"], saved["targets"], saved["prompt_lengths"], saved["meta"])
        if not rows.inputs:
            raise UserError(f"canvas rows {path}: holds no rows")
        return rows

    @classmethod
    def joined(cls, parts: list[CanvasRows]) -> CanvasRows:
        """The rows of several files as one set, as rounds of a model's own canvases are
        aggregated (each round's rows written from the model the round before trained). The
        parts must agree on the decoder's kind and the tokenizer's special ids; ``meta["parts"]``
        keeps each part's meta."""
        keys = ("block_size", "mask_id", "eos_id", "end_of_turn_id")
        first = {k: parts[0].meta.get(k) for k in keys}
        for part in parts[1:]:
            theirs = {k: part.meta.get(k) for k in keys}
            if theirs != first:
                raise UserError(f"canvas rows written by different decoders or tokenizers cannot be "
                                f"joined: {first} against {theirs}")
        meta = {**first, "vocab_size": max(p.meta.get("vocab_size", 0) for p in parts),
                "parts": [p.meta for p in parts]}
        return cls([r for p in parts for r in p.inputs], [r for p in parts for r in p.targets],
                   [n for p in parts for n in p.prompt_lengths], meta)

    @property
    def block_size(self) -> int | None:
        return self.meta.get("block_size")

    def batch(self, indices: list[int], mask_id: int, eos_id: int) -> Batch:
        """The rows at ``indices`` as one masked-diffusion batch, each padded to the longest with
        masked slots whose target is EOS (the canvas runs on past the answer). A row's loss
        weight is 1 / its share of masked response slots, as ``mask_suffixes`` weights its rows.
        Rows of a block-causal decoder make a block diffusion batch (``block_batch``)."""
        if self.block_size:
            return self.block_batch(indices, mask_id, eos_id)
        length = max(len(self.inputs[i]) for i in indices)
        inputs, targets, is_resp = [], [], []
        for i in indices:
            pad = length - len(self.inputs[i])
            inputs.append(self.inputs[i] + [mask_id] * pad)
            targets.append(self.targets[i] + [eos_id] * pad)
            p = self.prompt_lengths[i]
            is_resp.append([False] * p + [True] * (length - p))
        inputs, targets, is_resp = torch.tensor(inputs), torch.tensor(targets), torch.tensor(is_resp)
        is_masked = (inputs == mask_id) & is_resp
        share = (is_masked.sum(1) / is_resp.sum(1).clamp(min=1)).clamp(min=MIN_T)
        return Batch(inputs, targets, is_masked, 1.0 / share, None, None,
                     content_length(targets, is_resp, eos_id))

    def block_batch(self, indices: list[int], mask_id: int, eos_id: int) -> Batch:
        """Block diffusion rows: the canvas as the noisy copy (its masked slots all in its last
        block), the finished row as the clean copy, both padded with EOS that no query before
        reads and no loss is taken on; the attention ``block_diffusion_batch`` trains with. The
        weight is 1 / the share of the row's own response slots masked."""
        length = max(len(self.inputs[i]) for i in indices)
        noisy, clean, is_resp, weight = [], [], [], []
        for i in indices:
            pad = [eos_id] * (length - len(self.inputs[i]))
            noisy.append(self.inputs[i] + pad)
            clean.append(self.targets[i] + pad)
            p = self.prompt_lengths[i]
            is_resp.append([False] * p + [True] * (length - p))
            response = self.inputs[i][p:]
            weight.append(1.0 / max(MIN_T, response.count(mask_id) / max(1, len(response))))
        noisy, clean, is_resp = torch.tensor(noisy), torch.tensor(clean), torch.tensor(is_resp)
        return Batch(torch.cat([noisy, clean], dim=1), clean, (noisy == mask_id) & is_resp, torch.tensor(weight),
                     block_diffusion_mask(length, self.block_size), torch.arange(length).repeat(2)[None],
                     content_length(clean, is_resp, eos_id))


def end_of_turn_id(llm: LLM) -> int:
    """The stop token that closes an answer in the checkpoint's training rows (its chat
    template's end of turn), EOS for a checkpoint without one."""
    others = sorted(llm.token_ids.stop_ids - {llm.token_ids.eos_id})
    return others[0] if others else llm.token_ids.eos_id


def canvas_rows(llm: LLM, params: SamplingParams, examples: list[Example], per_answer: int,
                seed: int, batch_size: int = 32, tail: int = SUFFIX_WINDOW, use_tqdm: bool = False) -> CanvasRows:
    """Decode ``examples`` (phrased tasks with a trace) with ``params`` and keep up to
    ``per_answer`` canvases of each answer, drawn among the steps whose canvas still has a masked
    slot and can still be finished into a right trace; each row's canvas is cut ``0..tail`` slots
    after the later of the finished answer's end and the last written slot, or, for a
    block-causal decoder, at the end of the block holding its first masked slot: the block it
    was decoding (``use_tqdm``: a progress bar of the prompts decoded)."""
    from tqdm import tqdm
    from dllm_engine.engine.trace import MASK
    from ..probes.canvas_probe import decoded_canvases, first_unfinishable, refuse_untraced
    from ..tasks.phrased import check_trace, fill_canvas
    refuse_untraced(ex.task for ex in examples)
    if per_answer < 1 or batch_size < 1:
        raise UserError(f"per_answer and batch_size must be >= 1, got {per_answer} and {batch_size}")
    params = llm.resolve(params.replace(record_steps=True))
    ids = llm.token_ids
    eot = end_of_turn_id(llm)
    vocab = llm.tokenizer.get_vocab()
    rng = random.Random(f"canvas-rows-{seed}")
    block = params.block_length if params.decoder.block_causal else None
    rows = CanvasRows(meta={"params": params.describe(), "block_size": block,
                            "examples": len(examples), "per_answer": per_answer, "seed": seed,
                            "vocab_size": len(vocab), "mask_id": ids.mask_id, "eos_id": ids.eos_id,
                            "end_of_turn_id": eot, "answers": {}, "lost": {}, "kept": {}})
    bar = tqdm(total=len(examples), desc="canvas rows", unit="prompt", disable=not use_tqdm, dynamic_ncols=True)
    for ex, out, frames, canvases in decoded_canvases(llm, params, examples, batch_size, bar):
        task = TASKS[ex.task]
        steps = tuple(task.steps_of(ex))
        lost_at = first_unfinishable(lambda i: check_trace(task, steps, canvases[i]), len(canvases))
        usable = [i for i in range(len(canvases) if lost_at is None else lost_at)
                  if any(w is None for w in canvases[i])]
        for key, n in (("answers", 1), ("lost", int(lost_at is not None))):
            rows.meta[key][ex.task] = rows.meta[key].get(ex.task, 0) + n
        for i in sorted(rng.sample(usable, min(per_answer, len(usable)))):
            answer = fill_canvas(task, steps, canvases[i], rng)
            if answer is None:  # check_trace said it fits: the two readers disagree
                raise AssertionError(f"{ex.task}: a finishable canvas found no phrasing")
            prompt = list(out.prompt_token_ids)
            if block:  # the end of the block holding the first masked slot: the one being decoded
                first_masked = len(prompt) + canvases[i].index(None)
                length = min(params.max_new_tokens, block_causal_limit(first_masked, block) - len(prompt))
            else:
                written = max((j for j, w in enumerate(canvases[i]) if w is not None), default=-1)
                length = min(params.max_new_tokens, max(len(answer) + 1, written + 1) + rng.randint(0, tail))
            canvas = [ids.mask_id if t is MASK else t for t in frames[i][:length]]
            canvas += [ids.mask_id] * (length - len(canvas))
            target = ([vocab[w] for w in answer] + [eot] + [ids.eos_id] * length)[:length]
            rows.inputs.append(prompt + canvas)
            rows.targets.append(prompt + [t if c == ids.mask_id else c for c, t in zip(canvas, target)])
            rows.prompt_lengths.append(len(prompt))
            rows.meta["kept"][ex.task] = rows.meta["kept"].get(ex.task, 0) + 1
    bar.close()
    return rows
