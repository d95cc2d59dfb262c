"""Does a checkpoint compute a worked answer's intermediate results, or copy them?

A worked answer writes each intermediate result twice: after ``=`` and again as the next clause's
first operand (``3 + 5 = 8 , 8 + 2 = 0``). A bidirectional model trained with uniform random masks
can predict a masked result by reading its copy further right, and never learn to compute it; a
decoder going left to right (blocks of 32, the right masked) then finds nothing to copy. This probe
separates the two: for every result token (from ``=`` to the next ``,``) it masks the answer from
that token on and asks the model for it, once with the bidirectional attention the decoders use
("right masked") and once under a causal mask, next-token style, as the auxiliary loss of
``dllm train`` trains it ("causal"). A third count ("copy masked") masks only the result and the
answer up to and including its copy (the token after the next ``,``) and leaves the rest of the
answer in view: a model that computes gets it right, one that only copies does not. A fourth
count ("block masked") takes the right-masked rows under a block-causal mask (blocks of 32 counted
from the first token, as SDAR and ``dllm train --block-aux`` see them): a clean block reads only the
blocks before it, the masked slot its own block and the clean ones before. For block-causal
families that is their own attention, so it equals "right masked"; for a full-attention model it
tells whether a result it misses with the right masked is missed for the masked slots to its right
(block masked right) or at the masked slot itself (block masked wrong too).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from dllm_engine.errors import UserError
from dllm_engine.engine.llm import LLM
from ..tasks import Example
from ..train.data import block_causal_mask


@dataclass
class ChainProbeRow:
    task: str
    results: int = 0  # result tokens probed
    right_masked: int = 0  # of them predicted with the answer masked from them on
    causal: int = 0  # of them predicted next-token style under a causal mask
    copy_masked: int = 0  # of them predicted with only the result and its copy masked
    block_masked: int = 0  # of them predicted with the right masked, under a block-causal mask

    def as_dict(self) -> dict:
        n = max(1, self.results)
        return {"task": self.task, "results": self.results,
                "right_masked": round(self.right_masked / n, 4),
                "copy_masked": round(self.copy_masked / n, 4),
                "block_masked": round(self.block_masked / n, 4), "causal": round(self.causal / n, 4)}


def result_positions(answer: list[int], open_id: int, close_id: int) -> list[int]:
    """Indices in ``answer`` of the tokens between each ``open_id`` and the next ``close_id``."""
    out, inside = [], False
    for i, tok in enumerate(answer):
        if tok == close_id:
            inside = False
        elif inside:
            out.append(i)
        if tok == open_id:
            inside = True
    return out


def encode_example(llm: LLM, ex: Example) -> tuple[list[int], list[int]]:
    """(the chat prompt's ids, the answer's ids) of ``ex``; a model whose vocabulary lacks the
    task's words is refused by name, not with an IndexError."""
    tok = llm.tokenizer
    prompt = list(tok.apply_chat_template(ex.chat(), add_generation_prompt=True, tokenize=True,
                                          return_dict=False))
    answer = tok.encode(ex.answer, add_special_tokens=False)
    try:
        llm.check_ids(prompt + answer)
    except UserError as e:
        raise UserError(f"a prompt of task {ex.task}: {e}") from None
    return prompt, answer


def right_masked_rows(ids: Tensor, targets: list[int], start: int, mask_id: int) -> Tensor:
    """One row per target position t: ``ids`` with every answer token from t on masked (the
    prompt, ``ids[:start]``, and the answer before t stay)."""
    rows = ids.repeat(len(targets), 1)
    cols = torch.arange(ids.shape[0])[None]
    t = torch.tensor(targets)[:, None]
    return torch.where((cols >= t) & (cols >= start), torch.full_like(rows, mask_id), rows)


def copy_masked_rows(ids: Tensor, targets: list[int], close_id: int, mask_id: int) -> Tensor:
    """One row per target position t: ``ids`` with t, the tokens up to the next ``close_id`` and
    the one after it (the result's copy as the next clause's first operand) masked."""
    rows = ids.repeat(len(targets), 1)
    cols = torch.arange(ids.shape[0], device=ids.device)
    closes = (ids == close_id).nonzero().flatten().tolist()
    ends = [next((c + 1 for c in closes if c > t), ids.shape[0] - 1) for t in targets]
    t = torch.tensor(targets, device=ids.device)[:, None]
    end = torch.tensor(ends, device=ids.device)[:, None]
    return torch.where((cols[None] >= t) & (cols[None] <= end), torch.full_like(rows, mask_id), rows)


def predicted(model, x: Tensor, targets: list[int], want: Tensor, mask: Tensor | None = None) -> int:
    """How many of ``want`` the model predicts at ``targets`` (row i, column targets[i]), with
    the family's own attention or under ``mask`` ([1, 1, L, L] bool)."""
    hidden = model.forward_context(x, model.plain_context(x, mask))
    shift = 1 if model.config.logit_shift else 0  # Dream predicts slot t from position t - 1
    picked = hidden[torch.arange(len(targets), device=x.device), [t - shift for t in targets]]
    return int((model.logits(picked).argmax(-1) == want).sum())


@torch.no_grad()
def chain_probe(llm: LLM, examples: list[Example], open_word: str = "=",
                close_word: str = ",", block_size: int = 32) -> dict[str, ChainProbeRow]:
    """Per task, how many result tokens the model predicts with the right masked (under the
    family's attention and block-causally), with only the result and its copy masked, and
    causally. ``block_size`` is the block-causal count's; block-causal families use their own."""
    tok, model = llm.tokenizer, llm.model
    vocab = tok.get_vocab()
    missing = [w for w in (open_word, close_word) if w not in vocab]
    if missing:
        raise UserError(f"{llm.path}: the tokenizer has no {' / '.join(map(repr, missing))}: "
                        "not a checkpoint trained on the worked tasks")
    open_id, close_id = vocab[open_word], vocab[close_word]
    rows: dict[str, ChainProbeRow] = {}
    device = next(model.parameters()).device
    block_size = model.config.block_size if model.config.is_block_causal else block_size
    for ex in examples:
        prompt, answer = encode_example(llm, ex)
        targets = [len(prompt) + i for i in result_positions(answer, open_id, close_id)]
        row = rows.setdefault(ex.task, ChainProbeRow(ex.task))
        if not targets:
            continue
        ids = torch.tensor(prompt + answer, device=device)
        want = ids[targets]
        mask_id = llm.token_ids.mask_id
        right = right_masked_rows(ids, targets, len(prompt), mask_id)
        row.right_masked += predicted(model, right, targets, want)
        row.block_masked += predicted(model, right, targets, want,
                                      block_causal_mask(ids.shape[0], block_size, device))
        row.copy_masked += predicted(model, copy_masked_rows(ids, targets, close_id, mask_id),
                                     targets, want)
        n = ids.shape[0]
        causal = torch.ones(n, n, dtype=torch.bool, device=device).tril()[None, None]
        hidden = model.forward_context(ids[None], model.plain_context(ids[None], causal))[0]
        row.causal += int((model.logits(hidden[[t - 1 for t in targets]]).argmax(-1) == want).sum())
        row.results += len(targets)
    return rows


def probe_table(rows: dict, columns: tuple[tuple[str, str, str], ...] | None = None) -> str:
    """One line per task: its ``task``, then each column (header, ``as_dict`` key, format spec);
    the default columns are the chain probe's; a value of None prints as "–"."""
    columns = columns or (("results", "results", "d"), ("right masked", "right_masked", ".1%"),
                          ("copy masked", "copy_masked", ".1%"), ("block masked", "block_masked", ".1%"),
                          ("causal", "causal", ".1%"))
    widths = [max(8, len(head) + 1) for head, _, _ in columns]
    lines = [f"{'task':10}" + "".join(f" {head:>{w}}" for (head, _, _), w in zip(columns, widths))]
    for r in rows.values():
        d = r.as_dict()
        cells = ("–" if d[key] is None else format(d[key], spec) for _, key, spec in columns)
        lines.append(f"{r.task:10}" + "".join(f" {c:>{w}}" for c, w in zip(cells, widths)))
    return "\n".join(lines)
