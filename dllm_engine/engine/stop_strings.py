"""Stop strings over a sequence's committed text, shared by the server and the lm-eval adapter.

Finished blocks never change, so once their text holds a stop string the answer is final and the
sequence can end there, before the rest of its canvas is decoded."""
from __future__ import annotations

from typing import Callable

from .sequence import Sequence


def find_stop(text: str, stops: list[str]) -> int | None:
    """Index of the earliest stop string in ``text``, or None."""
    hits = [i for s in stops if (i := text.find(s)) >= 0]
    return min(hits) if hits else None


def committed_end(seq: Sequence) -> int:
    """Canvas end of the generated tokens that are final (whole finished blocks)."""
    end = seq.canvas_len if seq.finished else seq.block[0]
    return max(seq.prompt_len, min(end, seq.prompt_len + seq.params.max_new_tokens))


def committed_ids(seq: Sequence) -> list[int]:
    """Final generated tokens up to, not including, the first stop token."""
    if seq.finished:
        return seq.output_ids()
    gen = seq.canvas[seq.prompt_len: committed_end(seq)].tolist()
    cut = next((i for i, t in enumerate(gen) if t in seq.ids.stop_ids), len(gen))
    return gen[:cut]


def tokens_through_stop(ids: list[int], stops: list[str], decode: Callable[[list[int]], str]) -> int:
    """The fewest leading tokens whose text holds a stop string (binary search: monotone)."""
    lo, hi = 1, len(ids)
    while lo < hi:
        mid = (lo + hi) // 2
        if find_stop(decode(ids[:mid]), stops) is None:
            lo = mid + 1
        else:
            hi = mid
    return lo
