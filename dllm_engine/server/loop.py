"""The engine loop behind the server: ONE thread drives ``Engine.step()`` (continuous batching)
while the asyncio side submits and cancels requests.

Requests join and leave at step boundaries: the HTTP handlers only put commands in an inbox; the
engine thread applies them between steps, runs a step, and sends each request the text its
sequences committed (the text of finished blocks, which later steps never change) through an
``asyncio.Queue``. A stop string in committed text ends its sequence at once."""
from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import threading
import time
from dataclasses import dataclass


from ..errors import UserError
from ..engine.llm import LLM
from ..engine.parallel import WorkerDied
from ..engine.sequence import Sequence
from ..engine.stop_strings import committed_end, committed_ids, find_stop, tokens_through_stop
from .metrics import Metrics
from .protocol import ApiError, ChoiceResult, TokenLogprob

log = logging.getLogger("dllm_engine.server")
PIECE_CONTEXT = 4  # tokens decoded before one to find the text it adds (its leading space)


@dataclass
class Event:
    """What the engine tells a request: that it was admitted (``accepted``, the first event),
    new text of choice ``index``, its final result, or an error that ends the whole request."""
    index: int = 0
    text: str = ""
    logprobs: list[TokenLogprob] | None = None  # streamed: those of the tokens ``text`` holds
    result: ChoiceResult | None = None
    error: ApiError | None = None
    accepted: bool = False


class Job:
    """One HTTP request: a sequence per prompt and the queue its events arrive on."""
    # shared by every Job of the process on purpose: job_id only labels log lines, where unique
    # within the process is enough (a request's own id, unique across replicas, is separate)
    ids = itertools.count()

    def __init__(self, seqs: list[Sequence], stops: list[str], stream: bool) -> None:
        self.job_id = next(self.ids)
        self.seqs, self.stops, self.stream = seqs, stops, stream
        self.events: asyncio.Queue[Event] = asyncio.Queue()
        self.aloop = asyncio.get_running_loop()
        self.start = time.perf_counter()

    def emit(self, event: Event) -> None:
        """Thread-safe: called by the engine thread."""
        try:
            self.aloop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # its event loop is closed: nobody is listening any more
            log.warning("job %d: event dropped, its event loop is closed (%s)", self.job_id,
                        "result" if event.result else "error" if event.error else "text")


@dataclass
class Track:
    """The engine thread's view of one sequence of a job."""
    job: Job
    index: int
    seq: Sequence
    sent: str = ""  # text already streamed
    end: int = -1  # committed canvas end at the last update
    logprobs: list[TokenLogprob] = dataclasses.field(default_factory=list)  # of committed tokens, so far
    logprobs_sent: int = 0  # of them streamed ...
    logprobs_chars: int = 0  # ... whose text is this long


def held_back(text: str, stops: list[str]) -> str:
    """``text`` minus a tail that could still become a stop string or a broken character."""
    keep = len(text)
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:n]):
                keep = min(keep, len(text) - n)
                break
    return text[:keep].rstrip("\ufffd")


def progress(seq: Sequence) -> tuple[int, int, bool]:
    return seq.block_idx, seq.step, seq.finished


class EngineLoop:
    """Owns ``llm.engine``: nothing else may call into the engine while the loop runs."""

    def __init__(self, llm: LLM, max_queue: int = 256, metrics: Metrics | None = None) -> None:
        if max_queue < 0:
            raise UserError(f"max_queue must be >= 0, got {max_queue}")
        self.llm, self.engine = llm, llm.engine
        self.max_queue = max_queue
        self.metrics = metrics or Metrics()
        self.lock = threading.Condition()
        self.inbox: list[tuple[str, Job, ApiError | None]] = []
        self.in_flight = 0  # sequences submitted and not yet done (guarded by lock)
        self.accepting = True
        self.stopping = False
        self.failure: str | None = None  # why the engine cannot step any more (a dead tensor-parallel rank)
        self.tracks: dict[int, Track] = {}  # seq_id -> track (engine thread only)
        # the HTTP side encodes while this thread decodes: one tokenizer, used one call at a time
        self.tokenizer_lock = threading.Lock()
        self.thread = threading.Thread(target=self.run, name="dllm-engine-loop", daemon=True)

    # -- asyncio side ------------------------------------------------------------------------
    def start(self) -> None:
        self.thread.start()

    def submit(self, job: Job) -> None:
        """Queue a job, or refuse it: 503 while shutting down, 429 when the queue is full."""
        capacity = self.engine.max_num_seqs + self.max_queue
        if len(job.seqs) > capacity:
            raise ApiError(400, f"{len(job.seqs)} prompts in one request; this server holds at most "
                           f"{capacity} sequences (--max-num-seqs + --max-queue)", "prompt")
        with self.lock:
            if not self.accepting:
                raise ApiError(503, self.failure or "server is shutting down", kind="server_error")
            if self.in_flight + len(job.seqs) > capacity:
                raise ApiError(429, f"server full: {self.in_flight} sequences in flight, this request "
                               f"needs {len(job.seqs)} more, the limit is {capacity} (--max-num-seqs "
                               f"{self.engine.max_num_seqs} + --max-queue {self.max_queue}); retry later",
                               kind="rate_limit_error")
            self.in_flight += len(job.seqs)
            self.inbox.append(("add", job, None))
            self.lock.notify()

    def cancel(self, job: Job, error: ApiError | None = None) -> None:
        """Drop a job's sequences (client gone, or ``error`` to send)."""
        with self.lock:
            self.inbox.append(("cancel", job, error))
            self.lock.notify()

    def queue_depth(self) -> int:
        """Sequences waiting for a slot (submitted, not yet running)."""
        return max(0, self.in_flight - len(self.engine.running))

    def num_running(self) -> int:
        return len(self.engine.running)

    def shutdown(self, timeout: float = 30.0) -> None:
        """Refuse new jobs, let in-flight ones finish for up to ``timeout`` s, cancel the rest."""
        with self.lock:
            self.accepting = False
            self.lock.wait_for(lambda: self.in_flight == 0, timeout=timeout)
            self.stopping = True
            self.lock.notify()
        if self.thread.is_alive():
            self.thread.join()

    # -- engine thread -----------------------------------------------------------------------
    def run(self) -> None:
        while True:
            with self.lock:
                self.lock.wait_for(lambda: self.inbox or self.engine.has_work() or self.stopping)
                commands, self.inbox = self.inbox, []
                stopping = self.stopping
            try:
                self.iterate(commands, stopping)
            except Exception as e:  # a bug outside any one request: fail what is in flight, go on
                log.exception("engine loop error; failing every in-flight request")
                self.reset(ApiError(500, f"engine error: {type(e).__name__}: {e}", kind="server_error"))
            if stopping:
                return

    def iterate(self, commands: list[tuple[str, Job, ApiError | None]], stopping: bool) -> None:
        for kind, job, error in commands:
            if kind == "add":
                self.add(job)
            else:
                self.drop(job, error)
        if stopping:
            self.abort_all()
        elif self.engine.has_work():
            self.step()

    def reset(self, error: ApiError) -> None:
        """Empty the engine and end every tracked job with ``error``."""
        self.engine.waiting.clear()
        self.engine.release([])
        for job in {id(t.job): t.job for t in self.tracks.values()}.values():
            job.emit(Event(error=error))
        for track in list(self.tracks.values()):
            self.forget(track)

    def add(self, job: Job) -> None:
        for index, seq in enumerate(job.seqs):
            self.tracks[seq.seq_id] = Track(job, index, seq)
        try:
            for seq in job.seqs:
                self.engine.add(seq)
        except Exception as e:  # a strategy's setup failed: this job only
            log.exception("job %d: setup failed", job.job_id)
            self.drop(job, ApiError(500, f"request failed: {e}", kind="server_error"))

    def drop(self, job: Job, error: ApiError | None) -> None:
        """End every live sequence of ``job`` without a result; send ``error`` if given."""
        tracks = [t for t in self.tracks.values() if t.job is job]
        for t in tracks:
            self.engine.cancel(t.seq.seq_id)
            self.forget(t)
        if tracks and error is not None:
            job.emit(Event(error=error))

    def forget(self, track: Track) -> None:
        del self.tracks[track.seq.seq_id]
        with self.lock:
            self.in_flight -= 1
            self.lock.notify_all()

    def abort_all(self) -> None:
        jobs = {id(t.job): t.job for t in self.tracks.values()}
        for job in jobs.values():
            self.drop(job, ApiError(503, "server shut down before the request finished",
                                    kind="server_error"))

    def step(self) -> None:
        before = {s.seq_id: progress(s) for s in self.engine.running}
        start = time.perf_counter()
        try:
            finished = self.engine.step()
        except WorkerDied as e:  # no step can run any more: answer 503 from now on
            self.fail(e)
            return
        except Exception as e:
            log.exception("engine step failed; isolating the failing sequence(s)")
            finished = self.recover(before, e)
        self.metrics.observe_step(time.perf_counter() - start)
        done = {s.seq_id for s in finished}
        for track in list(self.tracks.values()):
            try:
                self.update(track, track.seq.seq_id in done)
            except Exception as e:  # e.g. the tokenizer failed on this output: this job only
                log.exception("job %d: output failed", track.job.job_id)
                self.drop(track.job, ApiError(500, f"request failed: {e}", kind="server_error"))

    def fail(self, error: Exception) -> None:
        """The engine is gone (a tensor-parallel rank died): refuse new jobs and end every
        in-flight one with 503; ``/health`` answers 503 too."""
        log.error("engine unavailable: %s", error)
        with self.lock:
            self.accepting = False
            self.failure = f"engine unavailable: {error}"
        self.reset(ApiError(503, self.failure, kind="server_error"))

    def recover(self, before: dict, error: Exception) -> list[Sequence]:
        """Re-run, one at a time, the sequences the failed step did not advance; those that fail
        alone are the faulty ones and fail their jobs, as does the one whose own commit raised;
        the others go on (a batch-invariant engine gives them the same tokens)."""
        bad = []
        for seq in self.engine.running:
            if seq.step_error is not None:
                bad.append((seq, seq.step_error))
                continue
            if progress(seq) != before.get(seq.seq_id, (0, 0, False)):
                continue
            try:
                self.engine.step_alone(seq)
            except Exception as e:
                bad.append((seq, e))
        for seq, e in bad:
            if seq.seq_id in self.tracks:
                self.drop(self.tracks[seq.seq_id].job,
                          ApiError(500, f"request failed: {type(e).__name__}: {e}", kind="server_error"))
        live = {s.seq_id for s in self.engine.running} | {s.seq_id for s in self.engine.waiting}
        for track in [t for t in self.tracks.values() if t.seq.seq_id not in live and not t.seq.finished]:
            if track.seq.seq_id in self.tracks:  # lost by a failure outside any sequence
                self.drop(track.job, ApiError(500, f"request failed: {error}", kind="server_error"))
        return self.engine.release_finished()

    def update(self, track: Track, finished: bool) -> None:
        """Send what became final since the last step; finish on a stop token or stop string."""
        seq, job = track.seq, track.job
        if not (finished or job.stream or job.stops):
            return  # nothing to say before the end
        end = committed_end(seq)
        if end == track.end and not finished:
            return
        track.end = end
        ids = committed_ids(seq)
        text = self.decode(ids)
        cut = find_stop(text, job.stops)
        if cut is None and not finished:
            self.send(track, held_back(text, job.stops), ids)
            return
        if cut is not None:
            text = text[:cut]
            ids = ids[: tokens_through_stop(ids, job.stops, self.decode)]
            if not seq.finished:
                self.engine.cancel(seq.seq_id)
        self.send(track, text, ids)
        reason = "stop" if cut is not None or len(seq.output_ids()) < seq.params.max_new_tokens else "length"
        self.finish(track, text, reason, ids)

    def send(self, track: Track, text: str, ids: list[int]) -> None:
        """Stream the new part of ``text`` (of the committed ``ids``), with the logprobs of the
        tokens whose text it completes when the request asked for them."""
        if not (track.job.stream and len(text) > len(track.sent) and text.startswith(track.sent)):
            return
        logprobs = None
        if track.seq.params.logprobs is not None:
            self.extend_logprobs(track, ids)
            start = track.logprobs_sent
            while (track.logprobs_sent < len(ids) and track.logprobs_chars
                   + len(track.logprobs[track.logprobs_sent].token) <= len(text)):
                track.logprobs_chars += len(track.logprobs[track.logprobs_sent].token)
                track.logprobs_sent += 1
            logprobs = track.logprobs[start:track.logprobs_sent]
        track.job.emit(Event(track.index, text[len(track.sent):], logprobs))
        track.sent = text

    def extend_logprobs(self, track: Track, ids: list[int]) -> None:
        """``track.logprobs`` for every token of ``ids`` (committed tokens never change)."""
        if len(track.logprobs) < len(ids):
            track.logprobs += self.token_logprobs(track.seq, ids, start=len(track.logprobs))

    def finish(self, track: Track, text: str, reason: str, ids: list[int]) -> None:
        seq = track.seq
        seq.stats.output_tokens = len(ids)
        stats = dataclasses.replace(seq.stats)  # a copy: the engine thread owns seq.stats
        logprobs = None
        if seq.params.logprobs is not None:
            self.extend_logprobs(track, ids)
            logprobs = track.logprobs[:len(ids)]
        result = ChoiceResult(track.index, text, reason, seq.prompt_len, len(ids), stats, logprobs,
                              self.step_dicts(seq))
        self.metrics.observe_sequence(stats, seq.prompt_len)
        self.forget(track)
        track.job.emit(Event(track.index, result=result))

    def step_dicts(self, seq: Sequence) -> list[dict] | None:
        """The sequence's step records as JSON data (``"record_steps": true``), token text included."""
        if seq.trace is None:
            return None
        with self.tokenizer_lock:
            return [r.as_dict() for r in self.llm.steps(seq)]

    def token_logprobs(self, seq: Sequence, ids: list[int], start: int = 0) -> list[TokenLogprob]:
        """Output tokens ``ids[start:]`` as text with their logprobs. Each token's text is what it
        adds after the tokens before it (a word's leading space included), so the tokens join to
        the answer's text; its alternatives likewise."""
        out, recorded = [], seq.output_logprobs(len(ids))
        with self.tokenizer_lock:
            for i in range(start, len(ids)):
                tok, (lp, top, values) = ids[i], recorded[i]
                context = ids[max(0, i - PIECE_CONTEXT):i]
                before = self.text_of(context)
                out.append(TokenLogprob(self.piece(context, before, tok), lp,
                                        [(self.piece(context, before, t), v) for t, v in zip(top, values)]))
        return out

    def piece(self, context: list[int], before: str, tok: int) -> str:
        """The text ``tok`` adds after ``context`` (whose text is ``before``); the token alone
        where the two texts do not extend each other (a multi-byte character split)."""
        after = self.text_of(context + [tok])
        return after[len(before):] if after.startswith(before) else self.text_of([tok])

    def text_of(self, ids: list[int]) -> str:
        tok = self.llm.tokenizer
        return "" if tok is None else tok.decode(ids, skip_special_tokens=True)

    def decode(self, ids: list[int]) -> str:
        with self.tokenizer_lock:
            return self.text_of(ids)
