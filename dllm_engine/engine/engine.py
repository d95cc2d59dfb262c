"""The engine loop: admit waiting sequences, plan, forward once per method group, commit.

Sequences join and leave at step boundaries, each with its own block cursor, so the same loop
serves offline ``LLM.generate`` and the server's continuous batching. Running sequences are split
into forward groups by method and length class, each with its own KV cache pool, kept in row
order (``KVCache.arrange``), so a group's forward reads its pool without a copy and a long
request widens only the rows of its class."""
from __future__ import annotations

import logging
import time
from collections import deque

import torch

from ..errors import UserError
from ..methods import strategy_names
from ..decoding.commit_rules import RowDecision
from ..decoding.decoders import after_forward_rows, after_step, cache_len
from ..models.layers import DiffusionLM
from ..strategies.base import Pipeline
from . import batch_step
from .batch_step import batchable
from .kv_cache import KVCache
from .prefix_cache import DEFAULT_CAPACITY, PrefixStore, block_keys
from .runner import Runner
from .sequence import Sequence

log = logging.getLogger(__name__)
GroupKey = tuple[str, int]  # (method, length class)


def size(nbytes: int) -> str:
    """``nbytes`` in binary units: 512 B, 3.0 KiB, 1.5 GiB."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} B"


def length_class(positions: int) -> int:
    """The power of two at or above ``positions``: sequences of one class share a pool."""
    return 1 << max(positions - 1, 0).bit_length()


class Engine:
    def __init__(self, model: DiffusionLM, max_num_seqs: int = 256, runner: Runner | None = None,
                 fixed_shapes: bool = False, compile_step: bool = False, kv_cache_memory: int | None = None,
                 prefix_cache: bool = True) -> None:
        """``runner``: how a step's forward runs (default: in this process; a tensor-parallel
        runner also drives the other ranks). ``fixed_shapes``: bucketed step shapes
        (``engine/shapes.py``); ``compile_step``: and their layer stack compiled.
        ``kv_cache_memory``: a budget in bytes for the KV pools and a step's temporaries
        (``memory_needed``): a sequence joins the running batch only when everything fits, one
        that never can is refused (``check_fits``); None: no budget (``max_num_seqs`` alone).
        ``prefix_cache``: block-causal sequences reuse the final blocks of earlier ones
        (``engine/prefix_cache.py``), stored within the budget (else ``DEFAULT_CAPACITY``), and
        sequences whose first forward is the same run it once (the n copies of a request, any
        family: ``batch_step.twins``); False: every sequence computes its whole prompt."""
        if max_num_seqs < 1:
            raise UserError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        if kv_cache_memory is not None and kv_cache_memory < 1:
            raise UserError(f"kv_cache_memory must be a positive number of bytes, got {kv_cache_memory}")
        self.memory_budget = kv_cache_memory
        self.prefix_store = PrefixStore(kv_cache_memory or DEFAULT_CAPACITY) if prefix_cache else None
        self.waiting_for_memory = 0  # sequences the last admission left waiting for memory
        self.oom_limit: int | None = None  # running sequences at most, after a device out-of-memory error
        self.model = model
        self.runner = runner if runner is not None else Runner(model)
        self.runner.set_step_shapes(fixed_shapes, compile_step)
        self.runner.share_forwards = self.runner.share_forwards and prefix_cache
        self.new_cache = self.runner.new_cache
        self.caches: dict[GroupKey, KVCache] = {}
        self.groups: dict[GroupKey, list[Sequence]] = {}  # running sequences, in row order
        self.group_of: dict[int, GroupKey] = {}  # running sequence id -> its group
        self.max_num_seqs = max_num_seqs
        self.waiting: deque[Sequence] = deque()
        self.pipelines: dict[str, Pipeline] = {}
        # groups that run a base decoder as it is take the batch-shaped step; False: every group
        # takes the per-sequence one (``dllm bench --per-sequence-step`` compares them)
        self.batch_step = True

    @property
    def running(self) -> list[Sequence]:
        return [s for seqs in self.groups.values() for s in seqs]

    @property
    def cache_bytes(self) -> int:
        # read by the server's metrics while the loop thread steps: list() copies the dict's
        # values at once (in C, under the GIL), so a pool made or freed meanwhile cannot break it
        return sum(c.nbytes for c in list(self.caches.values()))

    def pipeline(self, method: str) -> Pipeline:
        if not method:
            raise ValueError("the engine runs resolved methods only; pass SamplingParams through "
                             "LLM.make_sequence (which resolves them with LLM.resolve) first")
        if method not in self.pipelines:
            self.pipelines[method] = Pipeline.named(method.split("+")[1:], self.model)
        return self.pipelines[method]

    def add(self, seq: Sequence) -> None:
        self.check_fits(seq)
        self.pipeline(seq.params.method).setup(seq)
        self.waiting.append(seq)

    # -- memory ------------------------------------------------------------------------------
    def check_fits(self, seq: Sequence) -> None:
        """Refuse a sequence that could not run even alone within the memory budget."""
        if self.memory_budget is not None and (need := self.memory_needed([seq], fresh=True)) > self.memory_budget:
            raise UserError(f"this request needs about {size(need)} of KV cache and step memory (prompt "
                            f"{seq.prompt_len} + {seq.canvas_len - seq.prompt_len} answer slots), more than the "
                            f"budget of {size(self.memory_budget)} (kv_cache_memory); shorten it or raise the budget")

    def memory_needed(self, seqs: list[Sequence], fresh: bool = False) -> int:
        """Bytes the KV pools take once ``seqs`` run together (each group's pool as
        ``KVCache.arrange`` would leave it: kept while large enough and not twice too large,
        else reallocated exactly; ``fresh``: as if no pool existed), plus their step's
        temporaries (``step_bytes``)."""
        groups: dict[GroupKey, list[Sequence]] = {}
        for s in seqs:
            groups.setdefault(self.group_of.get(s.seq_id) or self.group_key(s), []).append(s)
        total = 0
        for key, group in groups.items():
            rows = self.runner.batch_rows(len(group))
            length = self.runner.pool_length(max(self.cache_len(s) for s in group))
            cache = None if fresh else self.caches.get(key)
            if cache is not None and not cache.must_resize(rows, length):
                total += cache.nbytes
            else:
                total += rows * (length + 1) * self.kv_position_bytes
            total += sum(self.step_bytes(s) for s in group)
        return total

    @property
    def kv_position_bytes(self) -> int:
        """Bytes of one cache position of one row: K and V of every layer (this process's heads)."""
        c, p = self.model.config, next(self.model.parameters())
        return 2 * c.num_layers * self.model.num_kv_heads * c.head_dim * p.element_size()

    def step_bytes(self, seq: Sequence) -> int:
        """An estimate of a step's temporaries for ``seq``: the activations of every position a
        forward may compute (its cache length: the canvas, CFG's second copy, jump-share's
        copies) through a layer, and the float32 logits of the positions it may predict (a
        block's, each jump-share copy's; every answer slot under adaptive length)."""
        c, p = self.model.config, next(self.model.parameters())
        activations = self.cache_len(seq) * (4 * c.hidden_size + 3 * c.intermediate_size) * p.element_size()
        names = strategy_names(seq.params.method)
        rows = seq.params.block_length * (seq.params.max_copies if "jump-share" in names else 1)
        if "adaptive-length" in names:
            rows = max(rows, seq.canvas_len - seq.prompt_len)
        return activations + rows * c.vocab_size * 4

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def group_key(self, seq: Sequence) -> GroupKey:
        """The forward group ``seq`` runs in: its method and the length class of its cache rows."""
        return seq.params.method, length_class(self.cache_len(seq))

    def cache_len(self, seq: Sequence) -> int:
        return cache_len(seq) + self.pipeline(seq.params.method).extra_cache_slots(seq)

    def admit(self) -> None:
        """Waiting sequences join, in order, while the batch has room: ``max_num_seqs`` and, with
        a memory budget, the bytes ``memory_needed`` (the first that does not fit waits, and
        those behind it: no request overtakes another). One exception: a sequence whose prompt
        starts with a block a running or joining sequence computes this step waits one step and
        then reuses it (``prefixes_in_flight``); those behind it go on."""
        new, held = [], []
        running = self.running
        self.waiting_for_memory = 0
        limit = self.max_num_seqs if self.oom_limit is None else min(self.max_num_seqs, self.oom_limit)
        computing = self.prefixes_in_flight(running)
        while self.waiting and len(running) + len(new) < limit:
            key = self.first_block(self.waiting[0])
            if key is not None and key in computing:  # its prompt's first block is being computed
                held.append(self.waiting.popleft())
                continue
            if self.memory_budget is not None and (running or new) and not self.make_room(running + new
                                                                                           + [self.waiting[0]]):
                self.waiting_for_memory = len(self.waiting) + len(held)
                break
            seq = self.waiting.popleft()
            seq.start_time = time.perf_counter()
            self.group_of[seq.seq_id] = self.group_key(seq)
            new.append(seq)
            if key is not None and not self.prefix_store.has(*key):
                computing.add(key)
        self.waiting.extendleft(reversed(held))
        if new:
            self.arrange(self.running + new)
            if self.prefix_store is not None:
                self.reuse_prefixes(new)

    def make_room(self, seqs: list[Sequence]) -> bool:
        """Whether ``seqs`` fit the memory budget; the prefix store gives way to them (a waiting
        request goes before stored prefixes): it is shrunk to what they leave."""
        need = self.memory_needed(seqs)
        if self.prefix_store is not None and need + self.prefix_store.nbytes > self.memory_budget:
            self.prefix_store.evict(max(self.memory_budget - need, 0))
        return need <= self.memory_budget

    # -- prefix reuse ------------------------------------------------------------------------
    def reuses_prefix(self, seq: Sequence) -> bool:
        """Block diffusion with its final blocks exact: no guidance copy, no strategy that keeps
        a committed position's K/V from an earlier step (``delayed-cache``) or adds cache slots."""
        p = seq.params
        return (self.prefix_store is not None and p.decoder.block_causal and p.cfg_scale == 0
                and "delayed-cache" not in strategy_names(p.method)
                and self.pipeline(p.method).extra_cache_slots(seq) == 0)

    def first_block(self, seq: Sequence) -> tuple[int, bytes] | None:
        """(block length, key) of the first whole block of ``seq``'s prompt, when it may reuse one
        (worked out once per sequence)."""
        if seq.prefix_key == ():
            block = seq.params.block_length
            seq.prefix_key = (block, block_keys(seq.canvas, block, 1)[0]) \
                if seq.prompt_len >= block and self.reuses_prefix(seq) else None
        return seq.prefix_key

    def prefixes_in_flight(self, running: list[Sequence]) -> set:
        """First prompt blocks that running sequences compute in their next step and store after
        it: a waiting sequence whose prompt starts with one joins a step later and reuses it,
        rather than compute it beside them (n copies of a prompt; requests with one system
        prompt arriving together)."""
        return {key for seq in running if seq.stored_blocks == 0 and (key := self.first_block(seq)) is not None}

    def reuse_prefixes(self, new: list[Sequence]) -> None:
        """Sequences joining the batch start from the longest run of stored blocks their prompts
        begin with: the blocks are copied into their pool rows (per pool and block length at
        once), and their first step computes from the run's end (``committed_len``)."""
        batches: dict[tuple[GroupKey, int], list[Sequence]] = {}
        for seq in new:
            if self.reuses_prefix(seq):
                batches.setdefault((self.group_of[seq.seq_id], seq.params.block_length), []).append(seq)
        for (key, block), seqs in batches.items():
            for seq, found in zip(seqs, self.prefix_store.reuse(self.caches[key], seqs, block)):
                seq.stored_blocks = found
                seq.committed_len = seq.stats.cached_tokens = found * block

    def store_prefixes(self) -> None:
        """After a step: the running block-causal sequences' blocks that became final (below
        ``committed_len``) go to the prefix store, per pool and block length at once."""
        for key, seqs in self.groups.items():
            batches: dict[int, list[tuple]] = {}
            cache = self.caches[key]
            for seq in seqs:
                final = seq.committed_len // seq.params.block_length
                if final > seq.stored_blocks and self.reuses_prefix(seq):
                    batches.setdefault(seq.params.block_length, []).append(
                        (cache.rows[seq.seq_id], seq.canvas, seq.stored_blocks, final))
                    seq.stored_blocks = final
            for block, rows in batches.items():
                self.prefix_store.add(cache, rows, block)
        if self.memory_budget is not None and self.prefix_store.nbytes:  # within what the batch leaves
            self.prefix_store.evict(max(self.memory_budget - self.memory_needed(self.running), 0))

    def arrange(self, seqs: list[Sequence]) -> None:
        """Make ``seqs`` the running set, each in its group's pool: only rows that move are
        copied; a pool shrinks when its longest sequences leave and goes with its last one."""
        members: dict[GroupKey, list[Sequence]] = {}
        for seq in seqs:
            members.setdefault(self.group_of[seq.seq_id], []).append(seq)
        self.caches = {key: self.caches.get(key) or self.new_cache() for key in sorted(members)}
        self.groups = {key: self.place(self.caches[key], group) for key, group in members.items()}
        self.group_of = {s.seq_id: self.group_of[s.seq_id] for s in seqs}

    def place(self, cache: KVCache, seqs: list[Sequence]) -> list[Sequence]:
        """Rows for ``seqs`` in ``cache``; returns them in row order."""
        by_id = {s.seq_id: s for s in seqs}
        length = self.runner.pool_length(max(self.cache_len(s) for s in seqs))
        order = cache.arrange(list(by_id), length, self.runner.batch_rows(len(seqs)))
        return [by_id[i] for i in order]

    @torch.inference_mode()
    def step(self) -> list[Sequence]:
        """One denoising step for every running sequence; returns those that finished."""
        self.admit()
        for key, seqs in list(self.groups.items()):  # rows [0, n) of a pool may have spares after
            self.step_rows(self.pipeline(key[0]), seqs, self.caches[key], 0)
        if self.prefix_store is not None:
            self.store_prefixes()
        return self.release_finished()

    def step_rows(self, pipeline: Pipeline, seqs: list[Sequence], cache: KVCache, start: int) -> None:
        """``step_group`` of the pool rows [start, start + len(seqs)). A device out-of-memory
        error before any row's turn (the plans, the forward or the decision: nothing changed on
        a sequence) steps the two halves one after the other instead, and admits no more
        sequences than a half from then on (``oom_limit``); a single row, or an error after a turn
        began, is raised (the server fails or replays those rows)."""
        try:
            self.step_group(pipeline, seqs, cache.view(start, start + len(seqs)))
        except torch.OutOfMemoryError:
            if len(seqs) == 1 or any(s.step_error is not None for s in seqs):
                raise
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            half = len(seqs) // 2
            if self.runner.fixed_shapes:  # the second part a power of two, so each fits its padded rows
                half = len(seqs) - (1 << (len(seqs) - 1).bit_length() - 1)
            self.oom_limit = min(self.oom_limit or len(seqs) // 2, len(seqs) // 2)
            log.warning("out of device memory stepping %d sequences: stepping them in halves and admitting "
                        "at most %d from now on", len(seqs), self.oom_limit)
            self.step_rows(pipeline, seqs[:half], cache, start)
            self.step_rows(pipeline, seqs[half:], cache, start + half)

    @torch.inference_mode()
    def step_alone(self, seq: Sequence) -> None:
        """One step of a running sequence by itself (the server replays a failed step so)."""
        cache = self.caches[self.group_of[seq.seq_id]]
        row = cache.rows[seq.seq_id]
        self.step_group(self.pipeline(seq.params.method), [seq], cache.view(row, row + 1))

    def step_group(self, pipeline: Pipeline, seqs: list[Sequence], cache) -> None:
        """One step of a forward group: the plans, one forward, then each sequence's turn in row
        order (``turn``).

        Replay contract: nothing before the turns changes a sequence (plans, the forward and
        ``after_forward`` write only this step's scratch, which the next plan overwrites); a
        sequence's turn applies everything the step changes on it. A turn that raises leaves
        the rows before it advanced and the rows after it exactly as they were before the step
        (the server replays those alone, to the tokens they would have got), and marks its own
        sequence, whose state may have moved before it raised.

        A group that runs its decoder as it is (no strategy, ``batch_step.batchable``) takes the
        batch-shaped step, whose cost does not grow with the batch (``engine/batch_step.py``)."""
        if self.batch_step and not pipeline.strategies and all(batchable(s) for s in seqs):
            batch_step.step_group(self.runner, seqs, cache)
            return
        plans = pipeline.plans(seqs, self.runner.shift)
        hooks = pipeline.layer_hooks(seqs, plans)
        outputs, work = self.runner.forward_rows(seqs, plans, cache, hooks)
        outputs = after_forward_rows(seqs, outputs)  # the decoder's view
        ready = [(seq, *out) for seq, out in zip(seqs, pipeline.after_forward_rows(seqs, outputs))]
        decided = pipeline.decide_rows(seqs, [r[1] for r in ready], [r[2] for r in ready])  # one read
        for seq, w, decision in zip(seqs, work, decided):
            try:
                self.turn(pipeline, seq, w, decision)
            except Exception as e:
                seq.step_error = e
                raise

    def turn(self, pipeline: Pipeline, seq: Sequence, work: float, decision: RowDecision) -> None:
        """Everything one step changes on ``seq``, in order: its stats, the decoder's record,
        the commit decided for it (``Pipeline.decide_rows``), the strategies' records
        (``after_commit``), the cursor."""
        self.runner.account(seq, work)
        after_step(seq)
        decision.apply(seq)
        pipeline.after_commit(seq, decision.positions)
        if seq.trace is not None:  # record_steps: close the step's record (engine/trace.py)
            seq.record_step(pipeline.step_records(seq))
        seq.advance()

    def release(self, keep: list[int]) -> None:
        self.arrange([self.running[i] for i in keep])

    def abort(self, seq_ids: set[int]) -> None:
        """Drop these sequences wherever they are (a failed call must leave the engine empty)."""
        self.waiting = deque(s for s in self.waiting if s.seq_id not in seq_ids)
        self.release([i for i, s in enumerate(self.running) if s.seq_id not in seq_ids])

    def release_finished(self) -> list[Sequence]:
        done = [s for s in self.running if s.finished]
        if done:
            now = time.perf_counter()
            for s in done:
                s.stats.seconds = now - s.start_time
                s.stats.output_tokens = len(s.output_ids())
            self.release([i for i, s in enumerate(self.running) if not s.finished])
        return done

    def cancel(self, seq_id: int) -> bool:
        """Drop a waiting or running sequence (client went away); frees its slot."""
        for s in list(self.waiting):
            if s.seq_id == seq_id:
                self.waiting.remove(s)
                return True
        for i, s in enumerate(self.running):
            if s.seq_id == seq_id:
                self.release([j for j in range(len(self.running)) if j != i])
                return True
        return False
