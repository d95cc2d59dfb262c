"""Is the decoding frontier the slot a confidence-ranked decoder commits first?

A threshold decoder commits every masked slot of the current block whose top probability reaches
the threshold, and at least the most confident one. When the first masked slot (the frontier) is
the most confident, decoding runs left to right; when a slot further right is, the decoder commits
it ahead of the frontier and the words between must then fit around it. A word whose place is fixed
by the prompt (a template) is safe to commit ahead; in freely phrased text a slot's word depends on
the phrasing chosen before it, so committing it ahead guesses where the words before it will end.

The probe walks held-out answers token by token, with no decoding error to compound: for every
answer position f it builds the canvas a decoder would hold with the answer right up to f (the
prompt and ``answer[:f]`` committed, every later slot masked, blocks laid out as the family's
decoder lays them: after the prompt for semi-autoregressive models, from position 0 for block
diffusion) and reads the model's top probabilities over the masked slots of f's block, with the
family's own attention. Per task it counts the positions where the step would commit the frontier
(it reaches the threshold, or no slot does and it is the most confident), where the frontier's top
word is the answer's, where some slot reaches the threshold, and sums the frontier's and the most
confident slot's probabilities, the slots the step would commit and, where the frontier would be
left masked, how far ahead the most confident slot stands.

``oracle_frontier_probe`` asks the same of the task generator's own distribution: the shares of
the answers it writes after each prefix stand in for the model's probabilities, so it shows what
a model that had learned the phrased tasks perfectly would see: how much of the frontier's doubt
is the workload's own.
"""
from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass

import torch

from dllm_engine.decoding.rules import greedy_predictions
from dllm_engine.engine.llm import LLM
from dllm_engine.engine.sequence import block_layout
from dllm_engine.errors import UserError
from ..tasks import Example
from .chain_probe import encode_example, probe_table


@dataclass
class FrontierRow:
    task: str
    positions: int = 0  # answer positions probed
    frontier_committed: int = 0  # the step would commit the frontier (threshold, or the most confident)
    frontier_right: int = 0  # the frontier's top word was the answer's
    over_threshold: int = 0  # some masked slot of the block reached the threshold
    frontier_confidence: float = 0.0  # summed: the frontier's top probability
    best_confidence: float = 0.0  # summed: the most confident slot's top probability
    ahead_gap: int = 0  # summed where the frontier is left masked: its distance to the most confident slot
    commits: int = 0  # summed: the slots the step would commit (those reaching the threshold, at least one)

    def count(self, top: list[float], frontier_right: bool, threshold: float) -> None:
        """One position: ``top`` the top probabilities of the block's masked slots, the frontier's
        first; ``frontier_right`` whether the frontier's top word is the answer's."""
        best = max(range(len(top)), key=top.__getitem__)  # the first of equals, as the decoders rank
        committed = top[0] >= threshold or best == 0
        self.positions += 1
        self.frontier_committed += int(committed)
        self.frontier_right += int(frontier_right)
        self.over_threshold += int(top[best] >= threshold)
        self.frontier_confidence += top[0]
        self.best_confidence += top[best]
        self.ahead_gap += 0 if committed else best
        self.commits += max(1, sum(t >= threshold for t in top))

    def as_dict(self) -> dict:
        n = max(1, self.positions)
        ahead = self.positions - self.frontier_committed
        return {"task": self.task, "positions": self.positions,
                "frontier_committed": round(self.frontier_committed / n, 4),
                "frontier_right": round(self.frontier_right / n, 4),
                "over_threshold": round(self.over_threshold / n, 4),
                "frontier_confidence": round(self.frontier_confidence / n, 4),
                "best_confidence": round(self.best_confidence / n, 4),
                "mean_ahead_gap": round(self.ahead_gap / max(1, ahead), 2),
                "step_commits": round(self.commits / n, 2)}


def block_ends(prompt_len: int, max_new_tokens: int, block_length: int, block_causal: bool) -> list[int]:
    """For each canvas position from the prompt's end on, the end of the decoder's block holding
    it (``Sequence``'s layout, ``block_layout``); the last one is the canvas's length."""
    blocks = block_layout(prompt_len, max_new_tokens, block_length, block_causal)
    return [end for start, end in blocks for pos in range(start, end) if pos >= prompt_len]


def decoder_layout(llm: LLM, block_length: int | None, threshold: float) -> tuple[bool, int]:
    """(blocks laid from position 0, the block length) of ``llm``'s decoder; ``block_length``:
    the decoder's (block-causal families: their own, the default; others: 32)."""
    config = llm.model.config
    if block_length is None:
        block_length = config.block_size if config.is_block_causal else 32
    if config.is_block_causal and block_length != config.block_size:
        raise UserError(f"{llm.path} decodes blocks of {config.block_size}, not {block_length}")
    if block_length < 1 or not 0 < threshold <= 1:
        raise UserError(f"block_length must be >= 1 (got {block_length}), threshold in (0, 1] "
                        f"(got {threshold})")
    return config.is_block_causal, block_length


def encode_fitting(llm: LLM, ex: Example, max_new_tokens: int) -> tuple[list[int], list[int]]:
    """``encode_example``, refusing an answer longer than the canvas."""
    prompt, answer = encode_example(llm, ex)
    if len(answer) > max_new_tokens:
        raise UserError(f"an answer of task {ex.task} has {len(answer)} tokens, over "
                        f"max_new_tokens {max_new_tokens}")
    return prompt, answer


@torch.no_grad()
def frontier_probe(llm: LLM, examples: list[Example], block_length: int | None = None,
                   threshold: float = 0.9, max_new_tokens: int = 256,
                   rows_per_forward: int = 32) -> dict[str, FrontierRow]:
    """Per task, how the masked slots' confidences stand against the frontier's along the gold
    answers (see the module's docstring). ``block_length``: the decoder's (block-causal
    families: their own, the default; others: 32); the canvas holds ``max_new_tokens`` slots."""
    model = llm.model
    block_causal, block_length = decoder_layout(llm, block_length, threshold)
    if rows_per_forward < 1:
        raise UserError(f"rows_per_forward must be >= 1, got {rows_per_forward}")
    mask_id = llm.token_ids.mask_id
    device = next(model.parameters()).device
    shift = 1 if model.config.logit_shift else 0  # Dream predicts slot t from position t - 1
    rows: dict[str, FrontierRow] = {}
    for ex in examples:
        prompt, answer = encode_fitting(llm, ex, max_new_tokens)
        p = len(prompt)
        ends = block_ends(p, max_new_tokens, block_length, block_causal)  # ends[i]: answer slot i's
        length = ends[-1]
        full = torch.full((length,), mask_id, dtype=torch.long, device=device)
        full[:p + len(answer)] = torch.tensor(prompt + answer, device=device)
        row = rows.setdefault(ex.task, FrontierRow(ex.task))
        cols = torch.arange(length, device=device)
        for start in range(0, len(answer), rows_per_forward):
            fronts = torch.arange(p + start, p + min(len(answer), start + rows_per_forward), device=device)
            x = torch.where(cols[None] >= fronts[:, None], mask_id, full[None])
            hidden = model.forward_context(x, model.plain_context(x, None))
            for r, f in enumerate(fronts.tolist()):
                end = ends[f - p]
                word, top = greedy_predictions(model.logits(hidden[r, f - shift:end - shift]), mask_id)
                row.count(top.tolist(), bool(word[0] == full[f]), threshold)
    return rows


def oracle_frontier_probe(llm: LLM, examples: list[Example], block_length: int | None = None,
                          threshold: float = 0.9, max_new_tokens: int = 256, samples: int = 200,
                          seed: int = 0) -> dict[str, FrontierRow]:
    """The frontier probe with the task generator's own distribution in the model's place: at every
    answer position the top probabilities of the block's slots are the shares of ``samples``
    answers the generator writes after the same prefix (``tasks.phrased.writing_states``: every
    way it can have written the prefix, weighted, each continued as ``phrase`` continues). What a
    model that had learned the tasks perfectly would see; the phrased tasks with a trace only
    (``describe`` has no steps). ``llm`` gives the tokenizer and the decoder's block layout."""
    from ..tasks import TASKS
    from ..tasks.phrased import PhrasedTask, continue_writing, writing_states
    block_causal, block_length = decoder_layout(llm, block_length, threshold)
    if samples < 1:
        raise UserError(f"samples must be >= 1, got {samples}")
    rng = random.Random(seed)
    eos = object()  # the end of an answer, and every slot after it
    rows: dict[str, FrontierRow] = {}
    for ex in examples:
        task = TASKS[ex.task]
        if not isinstance(task, PhrasedTask):
            raise UserError(f"the oracle knows the phrased tasks with a trace only, not {ex.task}")
        prompt, answer = encode_fitting(llm, ex, max_new_tokens)
        gold, steps, p = ex.answer.split(), task.steps_of(ex), len(prompt)
        if len(gold) != len(answer):
            raise UserError(f"{llm.path}: the tokenizer does not write one token per word of {ex.task}")
        row = rows.setdefault(ex.task, FrontierRow(ex.task))
        ends = block_ends(p, max_new_tokens, block_length, block_causal)
        for i in range(len(gold)):
            width = ends[i] - (p + i)
            states = writing_states(task, steps, gold[:i])
            chosen = rng.choices(states, weights=[s.weight for s in states], k=samples)
            slots = [Counter() for _ in range(width)]
            for state in chosen:
                words = continue_writing(task, steps, state, rng, limit=width)
                for j, counter in enumerate(slots):
                    counter[words[j] if j < len(words) else eos] += 1
            tops = [c.most_common(1)[0] for c in slots]
            row.count([n / samples for _, n in tops], tops[0][0] == gold[i], threshold)
    return rows


FRONTIER_COLUMNS = (("positions", "positions", "d"), ("frontier committed", "frontier_committed", ".1%"),
                    ("frontier right", "frontier_right", ".1%"), ("p(frontier)", "frontier_confidence", ".3f"),
                    ("p(best)", "best_confidence", ".3f"), ("any >= thr", "over_threshold", ".1%"),
                    ("ahead gap", "mean_ahead_gap", ".2f"), ("step commits", "step_commits", ".2f"))


def frontier_table(rows: dict[str, FrontierRow]) -> str:
    return probe_table(rows, FRONTIER_COLUMNS)
