"""One request: its canvas, block cursor, sampling keys and stats.

A sequence is host-side state: its canvas and the map of the slots still undecided are NumPy
arrays, its cursor plain ints, so the step's bookkeeping (which slots a step computes and
predicts, what a commit writes, when a block ends) costs no device op and no device read. The
device sees a sequence only through the tensors a step builds from it (``engine/batch_step.py``)."""
from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from ..sampling_params import SamplingParams
from .trace import StepTrace
from .transfer import host, to_device  # noqa: F401 (imported from here by the engine's modules)


def stop_share(output_tokens: int, decoded_tokens: int) -> float:
    """Share of the decoded tokens the user never receives: stop tokens (EOS padding), anything
    after the first one, and slots past ``max_new_tokens`` that a whole last block decoded."""
    return 1 - output_tokens / decoded_tokens if decoded_tokens else 0.0


@dataclass
class SequenceStats:
    """The work and output counts of one sequence (or, summed, of a call)."""
    nfe: int = 0
    decoded_tokens: int = 0
    output_tokens: int = 0
    processed_tokens: float = 0.0
    prefill_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens whose K/V came from the prefix store (not in prefill_tokens)
    seconds: float = 0.0
    step_commits: Counter = field(default_factory=Counter)  # tokens committed by a step -> steps
    edits: int = 0  # committed tokens rewritten (joint-threshold); not in decoded_tokens
    # committed tokens that left a masked slot on their left (ahead of the decoding frontier), and
    # those slots summed over them: a decoder working at the left frontier commits few tokens ahead
    ahead_tokens: int = 0
    ahead_gaps: int = 0

    @property
    def redundancy(self) -> float:
        return self.processed_tokens / self.decoded_tokens if self.decoded_tokens else 0.0

    @property
    def tokens_per_step(self) -> float:
        return self.decoded_tokens / self.nfe if self.nfe else 0.0

    @property
    def answer_tokens_per_step(self) -> float:
        """Answer tokens (before the first stop) per forward: d3LLM's tokens-per-forward, which
        counts every forward but not the stop tokens a step commits."""
        return self.output_tokens / self.nfe if self.nfe else 0.0

    @property
    def stop_share(self) -> float:
        return stop_share(self.output_tokens, self.decoded_tokens)

    @property
    def ahead_share(self) -> float:
        """Share of the decoded tokens committed with a masked slot still on their left."""
        return self.ahead_tokens / self.decoded_tokens if self.decoded_tokens else 0.0

    @property
    def mean_ahead_gap(self) -> float:
        """Masked slots left of a token committed ahead of the frontier, on average."""
        return self.ahead_gaps / self.ahead_tokens if self.ahead_tokens else 0.0

    def add(self, other: "SequenceStats") -> None:
        """Sum another sequence's counts into this one (seconds are not additive: left alone)."""
        self.nfe += other.nfe
        self.decoded_tokens += other.decoded_tokens
        self.output_tokens += other.output_tokens
        self.processed_tokens += other.processed_tokens
        self.prefill_tokens += other.prefill_tokens
        self.cached_tokens += other.cached_tokens
        self.step_commits.update(other.step_commits)
        self.edits += other.edits
        self.ahead_tokens += other.ahead_tokens
        self.ahead_gaps += other.ahead_gaps

    def as_dict(self) -> dict:
        return {"nfe": self.nfe, "decoded_tokens": self.decoded_tokens,
                "output_tokens": self.output_tokens,
                "processed_tokens": round(self.processed_tokens, 2),
                "prefill_tokens": self.prefill_tokens, "cached_tokens": self.cached_tokens,
                "redundancy": round(self.redundancy, 4),
                "edits": self.edits, "ahead_tokens": self.ahead_tokens, "ahead_gaps": self.ahead_gaps,
                "seconds": round(self.seconds, 4)}

    @staticmethod
    def total(stats: list["SequenceStats"], seconds: float) -> "SequenceStats":
        out = SequenceStats(seconds=seconds)
        for s in stats:
            out.add(s)
        return out


@dataclass
class TokenIds:
    mask_id: int
    eos_id: int
    stop_ids: frozenset[int]


def block_layout(prompt_len: int, max_new_tokens: int, block_length: int,
                 block_causal: bool) -> list[tuple[int, int]]:
    """The canvas's blocks ``[start, end)`` as the decoders lay them: semi-AR decoders put block 0
    right after the prompt, in whole blocks for any ``max_new_tokens`` (the answer is cut at it);
    block diffusion aligns blocks to position 0, so the prompt's tail shares the first block."""
    bl = block_length
    if block_causal:
        end = -(-(prompt_len + max_new_tokens) // bl) * bl
        starts = range((prompt_len // bl) * bl, end, bl)
    else:
        starts = range(prompt_len, prompt_len + -(-max_new_tokens // bl) * bl, bl)
    return [(s, s + bl) for s in starts]


class Sequence:
    """Canvas = prompt + generation slots (``mask_id`` until committed), decoded block by block.

    Semi-AR decoders (LLaDA/Dream) put block 0 right after the prompt; block diffusion (SDAR)
    aligns blocks to position 0, so the prompt's tail shares the first block with masks."""

    def __init__(self, seq_id: int, prompt_ids: list[int], params: SamplingParams, ids: TokenIds,
                 device: torch.device | str = "cpu") -> None:
        unresolved = [f for f in ("method", "max_new_tokens", "block_length") if getattr(params, f) is None]
        if unresolved:
            raise ValueError(f"a Sequence takes resolved SamplingParams ({', '.join(unresolved)} unset); "
                             "LLM.make_sequence resolves them")
        self.seq_id = seq_id
        self.params = params
        self.ids = ids
        self.prompt_len = len(prompt_ids)
        self.blocks = block_layout(self.prompt_len, params.max_new_tokens, params.block_length,
                                   params.decoder.block_causal)
        end = self.blocks[-1][1]
        self.device = torch.device(device)  # where the model runs: the tensors built from it go there
        # what the model is fed at each slot (the mask token where undecided) ...
        self.canvas = np.full(end, ids.mask_id, dtype=np.int64)
        self.canvas[: self.prompt_len] = prompt_ids
        # ... and which slots are still undecided: explicit, not ``canvas == mask_id``, so a family
        # whose undecided slots hold other tokens (uniform noise) keeps the same bookkeeping
        self.undecided = np.zeros(end, dtype=bool)
        self.undecided[self.prompt_len:] = True
        self.block_idx = 0
        self.step = 0  # step inside the current block
        self.committed_len = 0  # block diffusion: cache K/V are final below this position
        self.stored_blocks = 0  # blocks from position 0 in the engine's prefix store (or reused from it)
        self.prefix_key: tuple | None = ()  # its prompt's first block's key (Engine.first_block); (): not yet
        self.prefilled = False
        self.finished = False
        self.step_error: Exception | None = None  # its own commit or advance raised (engine)
        # LLM.make_sequence gives every request a seed (seeds.py); one built by hand without: 0
        self.seed = params.seed or 0
        self.stats = SequenceStats()
        self.start_time = 0.0
        self.strategy_state: dict = {}  # per-sequence state owned by strategies
        self.rule_state: dict = {}  # per-sequence state of its commit rule (decoding/commit_rules.py)
        # the commit rule keeps the unmasked current block for more steps (joint-threshold's
        # post-edit steps): ``advance`` moves on only once it is False
        self.block_open = False
        self.decoded_before_step = 0  # stats.decoded_tokens when the current step began
        # params.logprobs set: canvas position -> (logprob of the committed token, top ids, their logprobs)
        self.logprobs: dict[int, tuple[float, list[int], list[float]]] = {}
        self.trace = StepTrace() if params.record_steps else None  # params.record_steps: per-step records

    # -- geometry ----------------------------------------------------------------------------
    @property
    def canvas_len(self) -> int:
        return self.canvas.shape[0]

    @property
    def block(self) -> tuple[int, int]:
        return self.blocks[self.block_idx]

    def masked_index(self) -> np.ndarray:
        """The current block's undecided canvas positions (host)."""
        start, end = self.block
        return np.flatnonzero(self.undecided[start:end]) + start

    def masked_positions(self) -> Tensor:
        """``masked_index`` as a tensor on the model's device."""
        return self.tensor(self.masked_index())

    def tensor(self, host: np.ndarray) -> Tensor:
        """A host array as a tensor on the model's device (a copy: the canvas may change later)."""
        return to_device(np.array(host), self.device)

    def tokens(self, positions: Tensor | slice | None = None) -> Tensor:
        """The canvas (at ``positions``, a slice, or a tensor on the model's device, gathered
        there: no read of the positions; all of it: None) as a tensor on the model's device."""
        if isinstance(positions, Tensor):
            return self.tensor(self.canvas)[positions]
        return self.tensor(self.canvas[slice(None) if positions is None else positions])

    def tokens_this_step(self) -> int:
        """Fixed-step rules: the block's masks left, split evenly over its steps left (remainder
        first; the block's own schedule while every step commits its share). A step past the
        block's ``steps`` (a strategy let fewer tokens commit) takes every mask left."""
        steps_left = max(self.params.steps - self.step, 1)
        base, rem = divmod(self.num_masked(), steps_left)  # num_transfer_tokens(...)[0]
        return base + (1 if rem else 0)

    def num_masked(self) -> int:
        """Undecided slots left in the current block."""
        start, end = self.block
        return int(np.count_nonzero(self.undecided[start:end]))

    # -- progress ----------------------------------------------------------------------------
    def commit(self, positions: Tensor | np.ndarray, tokens: Tensor | np.ndarray, logits: Tensor | None = None,
               confidence: Tensor | np.ndarray | None = None) -> None:
        """Write ``tokens`` into undecided slots; ``logits`` [N, V] (the rows they were drawn from)
        record their logprobs when the request asked for them. A trace (``record_steps``) takes
        each token's probability from ``logits``, or ``confidence`` [N] when given. Tensors are
        read to the host here (the batched step passes host arrays, read once for its group)."""
        pos, tok = host(positions), host(tokens)
        # invariant: each slot is committed once, never to the mask, so decoded_tokens <= canvas
        if not self.undecided[pos].all() or (tok == self.ids.mask_id).any() or len(np.unique(pos)) < len(pos):
            raise RuntimeError(f"sequence {self.seq_id}: a commit would overwrite a committed slot or "
                               f"write the mask token (positions {pos.tolist()})")
        self.canvas[pos] = tok
        self.undecided[pos] = False
        self.stats.decoded_tokens += len(pos)
        # undecided slots left of each committed token (the token itself is decided now)
        gaps = np.cumsum(self.undecided[self.prompt_len:])[pos - self.prompt_len]
        self.stats.ahead_tokens += int(np.count_nonzero(gaps))
        self.stats.ahead_gaps += int(gaps.sum())
        if self.params.logprobs is not None and logits is not None:
            self.record_logprobs(positions, tokens, logits)
        if self.trace is not None:
            self.trace.commit(pos, tok, logits, None if confidence is None else host(confidence))

    def fill(self, positions: slice | list[int] | np.ndarray, tokens) -> None:
        """Decide ``positions`` as ``tokens`` outside a step (no stats, no checks): a canvas set
        up by hand (tests, a state to probe)."""
        tokens = np.asarray(tokens)
        self.canvas[positions] = tokens
        self.undecided[positions] = tokens == self.ids.mask_id  # the mask token: undecided again

    def edit(self, positions: Tensor, tokens: Tensor, logits: Tensor | None = None) -> None:
        """Rewrite committed tokens of the current block (joint-threshold's token-to-token edits):
        counted in ``stats.edits``, not in ``decoded_tokens``; their logprobs are recorded anew."""
        start, end = self.block
        pos, tok = host(positions), host(tokens)
        if (((pos < max(start, self.prompt_len)) | (pos >= end)).any() or self.undecided[pos].any()
                or (tok == self.ids.mask_id).any()):
            raise RuntimeError(f"sequence {self.seq_id}: an edit must rewrite a committed generated token of "
                               f"the current block with a token (positions {pos.tolist()})")
        self.canvas[pos] = tok
        self.stats.edits += len(pos)
        if self.params.logprobs is not None and logits is not None:
            self.record_logprobs(positions, tokens, logits)

    def record_logprobs(self, positions: Tensor, tokens: Tensor, logits: Tensor) -> None:
        """Logprobs under the model's own distribution (before temperature / top-k / top-p)."""
        logp = torch.log_softmax(logits.float(), dim=-1)
        tokens = torch.as_tensor(host(tokens), device=logp.device)
        chosen = logp.gather(-1, tokens[:, None])[:, 0]
        top = logp.topk(self.params.logprobs, dim=-1)
        self.add_logprobs(host(positions), chosen.tolist(), top.indices.tolist(), top.values.tolist())

    def add_logprobs(self, positions: np.ndarray, chosen: list[float], top_ids: list[list[int]],
                     top_logprobs: list[list[float]]) -> None:
        for i, pos in enumerate(positions.tolist()):
            self.logprobs[pos] = (chosen[i], top_ids[i], top_logprobs[i])

    def output_logprobs(self, num_tokens: int) -> list[tuple[float, list[int], list[float]]]:
        """The recorded logprobs of the first ``num_tokens`` generated tokens."""
        return [self.logprobs[self.prompt_len + i] for i in range(num_tokens)]

    def record_step(self, strategies: dict[str, dict]) -> None:
        """``record_steps``: close the trace's record of the step just committed (its
        strategies' ``step_record``s by name), before ``advance`` moves the cursor."""
        self.trace.end_step(self.block_idx, self.block, self.step, self.canvas_len, self.stats.processed_tokens,
                            time.perf_counter() - self.start_time, strategies)

    def advance(self) -> None:
        """After a step's commits: next step, next block, or finish."""
        self.stats.step_commits[self.stats.decoded_tokens - self.decoded_before_step] += 1
        self.decoded_before_step = self.stats.decoded_tokens
        self.step += 1
        start, end = self.block
        if self.block_open or self.undecided[start:end].any():
            return
        generated = self.canvas[max(start, self.prompt_len):end]
        has_stop = bool(np.isin(generated, self.stop_array()).any())
        if (has_stop and self.params.stop_at_eos) or self.block_idx == len(self.blocks) - 1:
            self.finish()
            return
        self.block_idx += 1
        self.step = 0

    def stop_array(self) -> np.ndarray:
        return np.array(sorted(self.ids.stop_ids), dtype=np.int64)

    def stop_tensor(self) -> Tensor:
        return self.tensor(self.stop_array())

    def finish(self) -> None:
        """Fill what is left of the canvas with EOS, as the reference sampler's output has it."""
        self.canvas[self.undecided] = self.ids.eos_id
        self.undecided[:] = False
        self.finished = True

    def truncate(self, new_len: int) -> None:
        """Cut the canvas (adaptive length): blocks past ``new_len`` disappear."""
        self.canvas = self.canvas[:new_len]
        self.undecided = self.undecided[:new_len]
        self.blocks = [b for b in self.blocks if b[1] <= new_len]

    def output_ids(self) -> list[int]:
        """Generated tokens up to, not including, the first stop token."""
        # the canvas is rounded up to whole blocks; the user asked for max_new_tokens
        gen = self.canvas[self.prompt_len: self.prompt_len + self.params.max_new_tokens].tolist()
        for i, tok in enumerate(gen):
            if tok in self.ids.stop_ids:
                return gen[:i]
        return gen
