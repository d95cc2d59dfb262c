"""Joint-threshold decoding of LLaDA2.1 (Bie et al., "LLaDA2.1: Speeding Up Text Diffusion via
Token Editing", arXiv 2602.08676): mask-to-token commits (M2T) plus token-to-token edits (T2T)
of tokens already committed in the current block.

Rules as SGLang implements them for LLaDA2.1 (sgl-project/sglang
``python/sglang/srt/dllm/algorithm/joint_threshold.py``, class ``JointThreshold``; the same in
huggingface/diffusers ``LLaDA2Pipeline`` + ``BlockRefinementScheduler``), read, not copied. Each
step of a block (one forward of the block, ``block`` decoder) predicts every generated position
of the block, masked or not (token = argmax at T = 0, else a sample; confidence = its softmax
probability):

- M2T: while the block has masks, they commit by the block decoder's own rule (every mask with
  confidence >= ``threshold``, at least the top one);
- T2T: every committed generated position of the block (never the prompt's tail sharing the
  block) whose predicted token differs from its token, with confidence > ``edit_threshold``, is
  rewritten, in the same step; ``edit_threshold`` 0.0 edits every disagreement;
- post-edit steps: once the block has no mask, further steps only edit; the block is final after
  a post-edit step that edits nothing, or after ``max_post_edit_steps`` of them (0: none).

The presets (``methods.JOINT_THRESHOLD_PRESETS``) are LLaDA2.1's modes: S (speedy) threshold 0.5,
edit_threshold 0.0, 16 post-edit steps; Q (quality) 0.7 / 0.5 / 16.

How it composes (docs/decoding/joint-threshold.md):
- KV cache: a block's K/V enter the cache only when it is final (the ``block`` decoder writes a
  block's K/V with the next block's first forward), and edits touch the current block only, so
  the cache never holds a token an edit replaced;
- streaming: the server streams whole finished blocks (``engine.stop_strings.committed_end``), so
  an edited token has never been streamed; the block stays unfinished until its post-edit steps end;
- stats: an edit counts in ``stats.edits``, not in ``decoded_tokens``; tokens per step counts the
  M2T commits of every forward, post-edit forwards included;
- strategies that freeze committed block positions (FOCUS, its delayed cache) are refused;
  adaptive-length composes (it reads a block's first step, which has no committed token yet).

Deviations: the mask token is out of the vocabulary (the engine's rule; SGLang's argmax may pick
it); M2T compares with >= (the block decoder's rule; SGLang's with >). SGLang runs one forward
after the last post-edit step to write the block's K/V; here the next block's first forward does.
"""
from __future__ import annotations

from typing import ClassVar

import numpy as np
from torch import Tensor

from ..engine.sequence import Sequence, to_device
from .commit_rules import CommitRule, GroupDecision, Reweigh
from .decide import GroupRules

KEY = "joint-threshold"


class JointThreshold(CommitRule):
    name: ClassVar[str] = KEY

    def logit_index(self, seq: Sequence) -> np.ndarray:
        """Every generated position of the current block, masked or committed."""
        start, end = seq.block
        return np.arange(max(start, seq.prompt_len), end)

    def decide(self, seqs: list[Sequence], rules: GroupRules, positions: Tensor, logits: Tensor,
               reweigh: Reweigh | None) -> GroupDecision:
        """M2T by the block decoder's rule over each row's masked candidates, T2T edits over its
        committed ones, every row at once. The canvas the rows had before the step (tokens, which
        are undecided) comes from the host in one copy. A row's state: whether the step unmasked
        (its block had masks), for ``after_commit``."""
        logits, x0, conf = rules.predict(logits, positions, owned=True)
        width = max(s.canvas_len for s in seqs)
        canvas = np.zeros((2, len(seqs), width), dtype=np.int64)
        for i, s in enumerate(seqs):
            canvas[0, i, : s.canvas_len], canvas[1, i, : s.canvas_len] = s.canvas, s.undecided
        current, undecided = to_device(canvas, positions.device)[:, rules.row_t, positions].unbind(0)
        masked = undecided.bool()
        (edit_threshold,) = rules.per_row([[s.params.edit_threshold for s in seqs]])
        m_conf = conf if reweigh is None else reweigh(positions, x0, conf)  # position-wise: read at masks only
        chosen = rules.select(m_conf, eligible=masked)
        edit = ~masked & (x0 != current) & (conf > edit_threshold[rules.row_t])
        return GroupDecision(logits, x0, chosen, edit, states=[s.num_masked() > 0 for s in seqs])

    def after_commit(self, seq: Sequence, state, edited: bool) -> None:
        keep_open(seq, unmasking=state, edited=edited)


def keep_open(seq: Sequence, unmasking: bool, edited: bool) -> None:
    """After a step: whether the unmasked block gets another (post-edit) step. It does after the
    step that fills its last masks and after a post-edit step that edited, while fewer than
    ``max_post_edit_steps`` post-edit steps ran."""
    block, post_steps = seq.rule_state.get(KEY, (seq.block_idx, 0))
    post_steps = (post_steps if block == seq.block_idx else 0) + (not unmasking)
    seq.block_open = (seq.num_masked() == 0 and (unmasking or edited)
                      and post_steps < seq.params.max_post_edit_steps)
    seq.rule_state[KEY] = (seq.block_idx, post_steps)
