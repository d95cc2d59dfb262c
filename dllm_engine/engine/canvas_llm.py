"""The offline API for a uniform-noise canvas model: what ``LLM(folder)`` returns for a
DiffusionGemma checkpoint (``model_type`` ``diffusion_gemma``; docs/models/diffusion-gemma.md).

The masked-diffusion families run through the engine's step loop (``engine.Engine``); this
family's sampler is its own (``decoding.diffusion_gemma``: random canvases, entropy-bound
acceptance, renoising, self-conditioning), so a call runs it directly: the requests are grouped
by their settings, each group in batches of at most ``max_num_seqs`` rows that fit the memory
budget, batch-invariantly (each row's positions count from its first token, a stopped row leaves
the forwards, every draw is keyed by the request's seed). A request's tokens then repeat for the
same batch; across batches they differ by what the kernels' rounding, amplified by
self-conditioning, makes of them (docs/models/diffusion-gemma.md#batch-invariance). Its surface is
``LLM``'s (``generate``, ``chat``, ``resolve``, ``seeds``, ``tokenizer``, ``GenerateResult`` of
``RequestOutput`` with ``SequenceStats``, ``record_steps`` traces as ``CanvasStep``s); what does
not apply to this family (another method, a temperature, logprobs, compiling, fixed shapes) is
refused up front, naming it. ``quantization="int8"`` quantizes the linear layers and the stacked
experts on load, as for the other families (``models/quantize.py``); ``tensor_parallel_size``
shards the model over processes, each running the same sampler batches (``canvas_parallel``).

Memory: ``kv_cache_memory`` (or on CUDA by default ``gpu_memory_utilization`` of the device less
the weights, as ``LLM``'s budget) caps each batch's bytes as ``batch_bytes`` counts them: per row
the encoder's K/V over its prompt and canvases, the decoder's logits in fp32 and two copies of the
self-conditioning (the step's and the next's, ``[canvas, vocab]`` each in the embedding dtype:
512 MiB a row at the release's 256 × 262,144 in bf16 with the logits), one layer's activations;
once per batch the sampler's two fp32 chunks (64 MiB each at most). A batch holds the rows that
fit; a request that cannot fit alone is refused before anything runs; a real out-of-memory lowers
the budget and, with nothing streamed, runs the batch again in halves (``run_batch``).
"""
from __future__ import annotations

import dataclasses
import json
import logging
import numbers
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from tqdm import tqdm

from ..decoding.diffusion_gemma import SAMPLING_CHUNK_ELEMENTS, CanvasBatch, GenerationSettings, load_generation_settings
from ..errors import UserError
from ..hub import model_name, resolve_model
from ..models.diffusion_gemma import MODEL_TYPE, DiffusionGemma, load_diffusion_gemma
from ..models.loader import parse_device
from ..sampling_params import ParamError, SamplingParams
from ..seeds import SeedStream
from ..spec import parse_spec
from ..tokenizer import load_tokenizer
from . import host_memory
from .llm import (PROGRESS_DELAY_S, GenerateResult, RequestOutput, check_options, memory_budget, parse_bytes,
                  prompt_list)
from .sequence import SequenceStats

log = logging.getLogger(__name__)
METHOD = "diffusion-gemma"  # what results and tables name this family's sampler
DOCS = "docs/models/diffusion-gemma.md"
# SamplingParams fields a canvas request reads; every other one must keep its default
READ = {"max_new_tokens", "steps", "block_length", "seed", "n", "stop_token_ids", "stop_at_eos", "record_steps"}
# why a field the masked-diffusion decoders read does not apply here, by field (else: generic)
WHY = {"method": "it samples with its own entropy-bound sampler, not a masked-diffusion decoder",
       "temperature": "its temperature falls from t_max to t_min over a canvas's steps (generation_config.json)",
       "logprobs": "its tokens are drawn from a renoised canvas, not committed one by one"}


@dataclass(frozen=True)
class CanvasParams:
    """One request's options as the canvas sampler runs them (``CanvasLLM.resolve``)."""

    settings: GenerationSettings
    canvas_length: int
    seed: int | None = None
    n: int = 1
    record_steps: bool = False  # each output's ``steps``: one ``CanvasStep`` per denoising step
    stop_token_ids: tuple[int, ...] = ()  # the request's own, beside EOS
    method: str = METHOD

    @property
    def max_new_tokens(self) -> int:
        return self.settings.max_new_tokens

    @property
    def temperature(self) -> float:
        """The first step's temperature: every canvas is sampled (a caller asking whether a run
        samples, as ``dllm generate`` does to pick a fresh seed, is told yes)."""
        return self.settings.t_max

    @property
    def block_length(self) -> int:
        """A canvas is this family's block."""
        return self.canvas_length

    def replace(self, **changes) -> CanvasParams:
        """A copy with ``changes``; ``max_new_tokens`` goes to the settings."""
        if "max_new_tokens" in changes:
            changes["settings"] = dataclasses.replace(changes.get("settings", self.settings),
                                                      max_new_tokens=changes.pop("max_new_tokens"))
        return dataclasses.replace(self, **changes)

    def describe(self) -> str:
        s = self.settings
        values = {"max_new_tokens": s.max_new_tokens, "canvas_length": self.canvas_length,
                  "steps": s.max_denoising_steps, "entropy_bound": s.entropy_bound, "t_max": s.t_max,
                  "t_min": s.t_min, "stability_threshold": s.stability_threshold,
                  "confidence_threshold": s.confidence_threshold, "stop_at_eos": bool(s.eos_token_ids),
                  "seed": self.seed, "n": self.n if self.n > 1 else None}
        return " ".join([self.method] + [f"{k}={v}" for k, v in values.items() if v is not None])


@dataclass
class CanvasStep:
    """One denoising step of one request (``record_steps``; docs/traces.md): the canvas it left
    and the argmax canvas (what the request would keep were the canvas to stop here)."""

    canvas: int  # which canvas: 0 is the first after the prompt
    step: int  # the step on that canvas, from 0
    token_ids: list[int]  # the canvas the step leaves: its accepted draws, fresh noise elsewhere
    accepted: list[bool]  # positions holding an accepted draw
    argmax_ids: list[int]
    finished: bool  # the canvas stopped after this step (stable and confident)
    seconds: float = 0.0  # from the start of the request's batch to the end of this step
    text: list[str] | None = None  # argmax_ids' token texts, where the model has a tokenizer

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass
class Request:
    index: int  # its place among the call's outputs
    prompt_ids: list[int]
    params: CanvasParams  # with its seed


class CanvasLLM:
    """``LLM`` for a DiffusionGemma checkpoint (see the module docstring); the arguments are
    ``LLM``'s, ``path`` the folder ``LLM`` resolved already."""

    family = MODEL_TYPE
    model_type = MODEL_TYPE  # what /v1/models reports
    methods = (METHOD,)

    def __init__(self, model, dtype: str = "auto", device: str = "cpu", max_num_seqs: int = 256,
                 keep_freed_memory: bool = False, tensor_parallel_size: int = 1, compile: bool = False,
                 fixed_shapes: bool = False, compile_step: bool = False, revision: str | None = None,
                 seed: int | None = 0, kv_cache_memory=None, gpu_memory_utilization: float = 0.9,
                 quantization: str | None = None, prefix_cache: bool = True, path=None) -> None:
        refuse_options({"fixed_shapes": fixed_shapes, "compile_step": compile_step})
        check_options(device, tensor_parallel_size, compile, False, quantization)
        if not isinstance(max_num_seqs, int) or isinstance(max_num_seqs, bool) or max_num_seqs < 1:
            raise UserError(f"max_num_seqs must be an integer >= 1, got {max_num_seqs!r}")
        self.device = parse_device(device)
        self.seeds = SeedStream(seed)
        self.max_num_seqs = max_num_seqs
        self.path = path if path is not None else resolve_model(model, revision)
        self.name = model_name(model)
        if keep_freed_memory and self.device.type == "cpu":
            host_memory.keep_freed_memory()
        self.parallel = None  # tensor parallelism: rank 0's handle (engine/canvas_parallel.py)
        if tensor_parallel_size > 1:
            from .parallel import TensorParallel
            self.parallel = TensorParallel.of_llm(self, self.path, dtype, quantization, self.device,
                                                  tensor_parallel_size, keep_freed_memory)
        if self.parallel is not None:
            self.model: DiffusionGemma = self.parallel.model
            self.device = self.model.embed_tokens.weight.device
        else:
            self.model = load_diffusion_gemma(self.path, dtype=dtype, device=self.device, quantization=quantization)
        if compile:  # its norms and dense MLPs (``models/compiled.py``; one process: check_options)
            from ..models.compiled import compile_model
            compile_model(self.model)
        # bytes a batch may take (None: no cap, a CPU's default): after the weights, as LLM's
        self.budget = memory_budget(self.device, parse_bytes(kv_cache_memory), gpu_memory_utilization)
        cfg = self.model.config
        self.tokenizer = load_tokenizer(self.path)
        self.settings = load_generation_settings(self.path, cfg.eos_token_ids, cfg.pad_token_id)

    def close(self) -> None:
        """Stop the tensor-parallel workers (nothing to do in one process)."""
        if self.parallel is not None:
            self.parallel.close()

    def clear_prefix_store(self) -> None:
        """``LLM``'s surface: this family keeps no prefix store (each call encodes its prompts)."""

    def new_batch(self, settings: GenerationSettings, observe=None) -> CanvasBatch:
        """A sampler run (``CanvasBatch``) on this model; under tensor parallelism one every
        rank runs alike (``canvas_parallel.MirroredBatch``)."""
        if self.parallel is None:
            return CanvasBatch(self.model, settings, None, observe=observe)
        from .canvas_parallel import MirroredBatch
        return MirroredBatch(self.parallel, self.model, settings, observe=observe)

    def __enter__(self) -> CanvasLLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- options --------------------------------------------------------------------------------
    def resolve(self, params: SamplingParams | CanvasParams | None = None) -> CanvasParams:
        """``params`` as this model runs them: ``max_new_tokens`` and ``steps`` (denoising steps
        per canvas) over the checkpoint's generation_config.json, ``stop_token_ids`` ending an
        answer as EOS does, ``stop_at_eos`` False running every canvas; ``block_length`` may only
        name the canvas length. Any other field set is a ``ParamError`` naming it."""
        if isinstance(params, CanvasParams):
            return params
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise UserError(f"params must be a SamplingParams, got {type(params).__name__}")
        defaults = SamplingParams()
        for f in dataclasses.fields(SamplingParams):
            if f.name not in READ and getattr(params, f.name) != getattr(defaults, f.name):
                why = WHY.get(f.name, "the masked-diffusion decoders and strategies read it")
                raise ParamError(f.name, f"{f.name}={getattr(params, f.name)!r} does not apply to {MODEL_TYPE}: "
                                         f"{why} ({DOCS})")
        canvas = self.model.config.canvas_length
        if params.block_length is not None and params.block_length != canvas:
            raise ParamError("block_length", f"block_length {params.block_length}: {MODEL_TYPE} denoises canvases "
                                             f"of its canvas_length, {canvas}; leave it unset")
        vocab = self.model.config.vocab_size
        if any(i >= vocab for i in params.stop_token_ids):
            raise ParamError("stop_token_ids", f"stop_token_ids must be ids in [0, {vocab}), the model's "
                                               f"vocabulary, got {list(params.stop_token_ids)}")
        eos = () if params.stop_at_eos is False else \
            tuple(dict.fromkeys((*self.settings.eos_token_ids, *params.stop_token_ids)))
        changes = {"eos_token_ids": eos}
        if params.max_new_tokens is not None:
            changes["max_new_tokens"] = params.max_new_tokens
        if params.steps is not None:
            changes["max_denoising_steps"] = params.steps
        return CanvasParams(dataclasses.replace(self.settings, **changes), canvas, params.seed, params.n,
                            params.record_steps, tuple(params.stop_token_ids))

    @staticmethod
    def parse_spec(spec: str, **defaults) -> SamplingParams:
        """A bench spec as this family reads it (``parse_canvas_spec``)."""
        return parse_canvas_spec(spec, **defaults)

    def resolve_for_prompt(self, params: SamplingParams, prompt_len: int) -> CanvasParams:
        """``resolve``, then checked against a prompt of ``prompt_len`` tokens (as ``LLM``'s)."""
        resolved = self.resolve(params)
        self.check_fits(prompt_len, resolved)
        return resolved

    def stop_ids(self, params: CanvasParams) -> frozenset[int]:
        """Where an answer ends: EOS and the request's stop ids (even when ``stop_at_eos`` is off:
        the text is cut there either way, as the other families cut it)."""
        return frozenset((*self.settings.eos_token_ids, *params.stop_token_ids))

    # -- prompts --------------------------------------------------------------------------------
    def encode(self, prompt: str | list[int]) -> list[int]:
        """A prompt's token ids: its text through the tokenizer, or its ids checked."""
        if not isinstance(prompt, (str, list, tuple)):
            raise UserError(f"a prompt is a string or a list of token ids, got {type(prompt).__name__}"
                            + (" (pass .tolist())" if hasattr(prompt, "tolist") else ""))
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise UserError(f"{self.path} has no tokenizer: give prompts as token ids")
            return self.check_ids(self.tokenizer.encode(prompt, add_special_tokens=False))
        return self.check_ids(list(prompt))

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise UserError(f"{self.path} has no chat template: give plain prompts (generate)")
        return list(self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                       return_dict=True)["input_ids"])

    def check_ids(self, ids: list[int]) -> list[int]:
        vocab = self.model.config.vocab_size
        if not ids:
            raise UserError("an empty prompt: give at least one token")
        if not all(isinstance(i, numbers.Integral) and not isinstance(i, bool) and 0 <= i < vocab for i in ids):
            bad = next(i for i in ids if not (isinstance(i, numbers.Integral) and 0 <= i < vocab))
            raise UserError(f"prompt token {bad!r} is not an id in [0, {vocab}), the model's vocabulary")
        return [int(i) for i in ids]

    def prompt_room(self, params: CanvasParams) -> int:
        """The model's positions left for a prompt beside every canvas ``params`` may run."""
        return self.model.config.max_position_embeddings - params.settings.num_canvases(params.canvas_length) \
            * params.canvas_length

    def check_fits(self, prompt_len: int, params: CanvasParams) -> None:
        """A prompt and its canvases within the model's positions."""
        if prompt_len > self.prompt_room(params):
            canvases = params.settings.num_canvases(params.canvas_length)
            limit = self.model.config.max_position_embeddings
            raise ParamError("max_new_tokens", f"a prompt of {prompt_len} tokens and {canvases} canvas(es) of "
                                               f"{params.canvas_length} need {prompt_len + canvases * params.canvas_length} "
                                               f"positions; the model has {limit}")

    def answer(self, ids: list[int], params: CanvasParams) -> tuple[list[int], bool]:
        """(the answer in the canvases ``ids``: cut at its first stop id and at ``max_new_tokens``,
        whether a stop id ended it within them)."""
        stops = self.stop_ids(params)
        end = next((i for i, t in enumerate(ids) if t in stops), None)
        stopped = end is not None and end < params.max_new_tokens
        return ids[:min(params.max_new_tokens, len(ids) if end is None else end)], stopped

    # -- generation -----------------------------------------------------------------------------
    def generate(self, prompts, params=None, use_tqdm: bool = False) -> GenerateResult:
        return self.run([self.encode(p) for p in prompt_list(prompts)], params, use_tqdm)

    def chat(self, conversations, params=None, use_tqdm: bool = False) -> GenerateResult:
        if conversations and isinstance(conversations, (list, tuple)) and isinstance(conversations[0], dict):
            conversations = [conversations]
        if not isinstance(conversations, (list, tuple)) or not all(
                isinstance(c, (list, tuple)) and all(isinstance(m, dict) for m in c) for c in conversations):
            raise UserError("a conversation is a list of messages, {'role': ..., 'content': ...}; "
                            "chat takes one conversation or a list of them")
        return self.run([self.apply_chat_template(list(c)) for c in conversations], params, use_tqdm)

    def run(self, prompt_ids: list[list[int]], params, use_tqdm: bool) -> GenerateResult:
        if not prompt_ids:
            raise UserError("no prompts given")
        given = params if isinstance(params, (list, tuple)) else [params] * len(prompt_ids)
        if len(given) != len(prompt_ids):
            raise UserError(f"{len(given)} SamplingParams for {len(prompt_ids)} prompts: give one, or one per prompt")
        per_prompt = [self.resolve(p) for p in given]  # every request checked before any runs
        requests, shape = [], []
        for ids, p in zip(prompt_ids, per_prompt):
            self.check_fits(len(ids), p)
            seeds = self.seeds.choice_seeds(p.seed, p.n)
            shape.append(len(seeds) if p.n > 1 else None)
            requests += [Request(len(requests) + j, ids, p.replace(seed=s)) for j, s in enumerate(seeds)]
        for r in requests:
            self.check_memory(r)
        start = time.perf_counter()
        outputs: list[RequestOutput | None] = [None] * len(requests)
        with tqdm(total=len(requests), desc="generate", unit="req", delay=PROGRESS_DELAY_S,
                  disable=not use_tqdm) as bar:
            for batch in self.batches(requests):
                for request, output in zip(batch, self.run_batch(batch)):
                    outputs[request.index] = output
                bar.update(len(batch))
        seconds = time.perf_counter() - start
        it = iter(outputs)
        result = GenerateResult([next(it) if n is None else [next(it) for _ in range(n)] for n in shape])
        result.stats = SequenceStats.total([o.stats for o in outputs], seconds)
        result.method = METHOD
        result.diagnostics = {}
        return result

    def batches(self, requests: list[Request]) -> list[list[Request]]:
        """Requests with the same settings (one sampler loop), in order, as many at a time as
        ``max_num_seqs`` and the memory budget allow."""
        groups: dict[GenerationSettings, list[Request]] = {}
        for r in requests:
            groups.setdefault(r.params.settings, []).append(r)
        out: list[list[Request]] = []
        for group in groups.values():
            batch: list[Request] = []
            for r in group:
                if batch and (len(batch) == self.max_num_seqs or not self.fits([*batch, r])):
                    out.append(batch)
                    batch = []
                batch.append(r)
            out.append(batch)
        return out

    def batch_bytes(self, batch: list[Request]) -> int:
        """The bytes a sampler loop over ``batch`` holds at its peak (see the module docstring):
        every row as wide as the widest, a prompt with every canvas it may run."""
        cfg = self.model.config
        canvas = batch[0].params.canvas_length
        columns = max(len(r.prompt_ids) + (r.params.settings.num_canvases(canvas) - 1) * canvas for r in batch)
        element = self.model.embed_tokens.weight.element_size()
        cache = sum(2 * spec.num_kv_heads * spec.head_dim * element
                    * (columns if spec.window is None else min(columns, spec.window - 1)) for spec in cfg.layers)
        widest = max(cfg.intermediate_size, cfg.moe_intermediate_size * cfg.top_k_experts,
                     max(cfg.num_heads * spec.head_dim for spec in cfg.layers))
        activations = canvas * (4 * cfg.hidden_size + 3 * widest) * 4  # one layer's, fp32 at most
        sampling = canvas * cfg.vocab_size * (4 + 2 * element)  # the logits, two self-conditionings
        chunks = 2 * 4 * min(SAMPLING_CHUNK_ELEMENTS, len(batch) * canvas * cfg.vocab_size)  # two fp32 copies
        return len(batch) * (cache + activations + sampling) + chunks

    def fits(self, batch: list[Request]) -> bool:
        return self.budget is None or self.batch_bytes(batch) <= self.budget

    def check_memory(self, request: Request) -> None:
        """A request that cannot fit the budget alone: refused before anything runs."""
        if not self.fits([request]):
            need, budget = self.batch_bytes([request]), self.budget
            raise UserError(f"a prompt of {len(request.prompt_ids)} tokens with {request.params.max_new_tokens} new "
                            f"tokens needs {need / 2**20:.1f} MiB for its sampler (K/V cache, [canvas, vocab] "
                            f"logits and self-conditioning), more than the {budget / 2**20:.1f} MiB budget "
                            f"(kv_cache_memory); raise it, or shorten the prompt or max_new_tokens")

    def run_batch(self, batch: list[Request],
                  on_canvas: Callable[[int, list[int]], None] | None = None) -> list[RequestOutput]:
        """``sample`` ``batch``; out of device memory, every later batch is held below the bytes
        this one needed, and with more than one row and nothing to stream (no ``on_canvas``: text
        already sent could not be taken back) it runs again in halves. Nothing is lost: each row still gets its
        answer (as its smaller batch samples it: docs/models/diffusion-gemma.md#batch-invariance)."""
        try:
            return self.sample(batch, on_canvas)
        except torch.OutOfMemoryError:
            limit = self.lower_budget(batch)
            if len(batch) == 1 or on_canvas is not None:
                raise
            log.warning("out of device memory sampling %d rows: in halves, and batches below %.1f MiB from now on",
                        len(batch), limit / 2**20)
            half = len(batch) // 2
            return self.run_batch(batch[:half]) + self.run_batch(batch[half:])

    def lower_budget(self, failed: list[Request]) -> int:
        """After an out-of-memory running ``failed``: the device's cached blocks released, and
        every later batch held below the bytes ``failed`` needed (what failed never runs
        again); returns that limit."""
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        limit = self.batch_bytes(failed) - 1
        self.budget = limit if self.budget is None else min(self.budget, limit)
        return limit

    def sample(self, batch: list[Request],
               on_canvas: Callable[[int, list[int]], None] | None = None) -> list[RequestOutput]:
        """One sampler loop over ``batch`` (left-padded), each row drawing by its own seed.
        ``on_canvas(row, argmax_ids)``: as each row's canvas ends (stopped, or out of steps), the
        canvas it keeps (before EOS cuts it): what the server streams."""
        settings = batch[0].params.settings
        watcher = StepWatcher(settings.max_denoising_steps, on_canvas)
        for i, r in enumerate(batch):
            watcher.watch(i, r.params.record_steps, stream=True)
        start = time.perf_counter()
        run = self.new_batch(settings, observe=watcher)  # what generate(batch_invariant=True) runs
        run.add([r.prompt_ids for r in batch], seeds=[r.params.seed for r in batch])
        while len(run):
            run.run_canvas()
        seconds = time.perf_counter() - start
        return [self.output(r, [t for c in row.token_ids for t in c], row.num_steps, seconds, watcher.traces.get(i))
                for i, (r, row) in enumerate(zip(batch, run.rows))]

    def output(self, request: Request, row: list[int], canvas_steps: list[int], seconds: float,
               trace: list[CanvasStep] | None = None) -> RequestOutput:
        """A row's answer (cut at its first stop id and at ``max_new_tokens``) and its counts."""
        canvas = request.params.canvas_length
        ids, stopped = self.answer(row, request.params)
        ran = [s for s in canvas_steps if s > 0]  # a canvas a row ran has at least one step
        prompt_len = len(request.prompt_ids)
        stats = SequenceStats(
            nfe=sum(ran) + len(ran),  # its decoder steps and its encoder passes (the prompt, each later canvas)
            decoded_tokens=len(ran) * canvas, output_tokens=len(ids),
            processed_tokens=float(prompt_len + sum(ran) * canvas + (len(ran) - 1) * canvas),
            prefill_tokens=prompt_len, seconds=seconds)
        text = self.tokenizer.decode(ids, skip_special_tokens=True) if self.tokenizer is not None else ""
        if trace is not None and self.tokenizer is not None:
            for step in trace:
                step.text = [self.tokenizer.decode([t], skip_special_tokens=False) for t in step.argmax_ids]
        return RequestOutput(prompt_token_ids=list(request.prompt_ids), token_ids=ids, text=text, stats=stats,
                             finish_reason="stop" if stopped else "length",
                             steps=trace, canvas_steps=ran)


def refuse_options(given: dict[str, bool], what: str = f"{MODEL_TYPE} yet",
                   why: str = f"its sampler runs in one process, eager; {DOCS}") -> None:
    """A ``UserError`` naming every option in ``given`` that is set (True): not available for
    ``what``, because ``why``. The options' names as the caller spells them (``compile``, ``--compile``)."""
    named = [name for name, on in given.items() if on]
    if named:
        raise UserError(f"{', '.join(named)}: not available for {what} ({why})")


def is_canvas_spec(spec: str | None) -> bool:
    """Whether ``spec`` names this family's sampler (``diffusion-gemma[:field=value,...]``)."""
    return (spec or "").strip().partition(":")[0] == METHOD


def parse_any_spec(spec: str, **defaults) -> SamplingParams:
    """``spec`` as the family it names reads it: ``parse_canvas_spec`` for this family's
    sampler, ``spec.parse_spec`` for a masked-diffusion method (what the command line and the
    playground take before any model loads)."""
    return (parse_canvas_spec if is_canvas_spec(spec) else parse_spec)(spec, **defaults)


def parse_canvas_spec(spec: str, **defaults) -> SamplingParams:
    """``diffusion-gemma[:field=value,...]`` (the fields ``CanvasLLM.resolve`` reads, e.g.
    ``steps``, ``seed``) as ``SamplingParams`` with no method: what a bench, the playground or
    ``--methods`` give this family. Another method is a ``UserError`` naming the one to give."""
    method, colon, fields = (spec or "").strip().partition(":")
    if method != METHOD:
        raise UserError(f"{method or 'an empty spec'!r}: a {MODEL_TYPE} model runs its own sampler; give "
                        f"{METHOD}[:field=value,...], e.g. {METHOD}:steps=8")
    return parse_spec(colon + fields, **defaults)


class StepWatcher:
    """What a sampler run reports after each denoising step (``generate``'s ``observe``): each
    watched row's ``CanvasStep`` (``record_steps``), and each row's canvas as it ends, stopped or
    out of steps (``on_canvas(row, argmax_ids)``: what the server streams). One read of the
    step's state, and only in runs that watch something."""

    def __init__(self, max_steps: int, on_canvas: Callable[[int, list[int]], None] | None = None) -> None:
        self.max_steps, self.on_canvas = max_steps, on_canvas
        self.traces: dict[int, list[CanvasStep]] = {}  # generation row -> its steps so far
        self.streams: set[int] = set()  # the rows whose ended canvases go to ``on_canvas``
        self.start = time.perf_counter()

    def watch(self, row: int, record_steps: bool, stream: bool = False) -> None:
        if record_steps:
            self.traces[row] = []
        if stream and self.on_canvas is not None:
            self.streams.add(row)

    def forget(self, row: int) -> list[CanvasStep] | None:
        """Stop watching ``row``; its trace."""
        self.streams.discard(row)
        return self.traces.pop(row, None)

    @property
    def needed(self) -> bool:
        return bool(self.streams) or bool(self.traces)

    def __call__(self, canvases: torch.Tensor, rows: torch.Tensor, state) -> None:
        if not self.needed:  # nothing watched: no read at all
            return
        values = zip(canvases.tolist(), rows.tolist(), state.canvas_ids.tolist(), state.accepted.tolist(),
                     state.argmax_ids.tolist(), state.num_steps.tolist(), state.finished.tolist())
        for canvas, row, ids, accepted, argmax, steps_run, finished in values:
            if row in self.traces:
                self.traces[row].append(CanvasStep(canvas, steps_run - 1, ids, accepted, argmax, finished,
                                                   time.perf_counter() - self.start))
            if row in self.streams and (finished or steps_run == self.max_steps):
                self.on_canvas(row, argmax)


def group_key(params: CanvasParams) -> GenerationSettings:
    """What requests sampled in one ``CanvasGroup`` share: their settings but ``max_new_tokens``
    (each row's own; 1 here)."""
    return dataclasses.replace(params.settings, max_new_tokens=1)


class CanvasGroup:
    """Requests of one ``group_key`` sampled together, joining and leaving between any two
    denoising steps (``decoding.diffusion_gemma.CanvasBatch.run_step``): the server's continuous
    batching for this family. ``add`` queues a request for the next step; ``run_step`` runs one
    denoising step of every row and returns the requests that finished with their outputs;
    ``leave`` drops requests whose clients went away. ``on_canvas(request, argmax_ids)``: the
    canvases of the requests added with ``stream``, each as it ends."""

    def __init__(self, llm: CanvasLLM, key: GenerationSettings,
                 on_canvas: Callable[[Request, list[int]], None] | None = None) -> None:
        self.llm, self.key = llm, key
        self.requests: dict[int, Request] = {}  # generation row -> its request, while it runs
        self.started: dict[int, float] = {}
        self.watcher = StepWatcher(key.max_denoising_steps,
                                   (lambda row, ids: on_canvas(self.requests[row], ids)) if on_canvas else None)
        settings = dataclasses.replace(key, max_new_tokens=llm.settings.max_new_tokens)
        self.run = llm.new_batch(settings, observe=self.watcher)  # each row's seed comes with it

    def __len__(self) -> int:
        return len(self.requests)

    def fits(self, request: Request) -> bool:
        """Whether ``request`` may join: ``takes`` it, and within the memory budget with the rows
        running (``batch_bytes``: the widest row's columns for every row)."""
        return self.takes(request) and self.llm.fits([*self.requests.values(), request])

    def takes(self, request: Request) -> bool:
        """Whether ``request``'s settings and ``max_num_seqs`` let it join, memory aside."""
        return group_key(request.params) == self.key and len(self) < self.llm.max_num_seqs

    def add(self, request: Request, stream: bool = False) -> None:
        row, = self.run.add([request.prompt_ids], [request.params.max_new_tokens], seeds=[request.params.seed])
        self.requests[row] = request
        self.started[row] = time.perf_counter()
        self.watcher.watch(row, request.params.record_steps, stream)

    def leave(self, requests: list[Request]) -> None:
        """``requests`` leave before the next step (their clients went away)."""
        gone = [row for row, r in self.requests.items() if any(r is q for q in requests)]
        self.run.leave(gone)
        for row in gone:
            self.watcher.forget(row)
            del self.requests[row], self.started[row]

    def run_step(self) -> list[tuple[Request, RequestOutput]]:
        """One denoising step of every row (the queued ones joining first); the requests that finished."""
        done = []
        for row in self.run.run_step():
            trace = self.watcher.forget(row)
            request, started = self.requests.pop(row), self.started.pop(row)
            canvases = self.run.rows[row]
            ids = [t for c in canvases.token_ids for t in c]
            done.append((request, self.llm.output(request, ids, canvases.num_steps, time.perf_counter() - started,
                                                  trace)))
            canvases.token_ids = []  # in the output now: a long-running group keeps no finished row's tokens
        return done


def is_canvas_checkpoint(folder) -> bool:
    """Whether ``folder``'s config.json names the canvas family (read without loading anything)."""
    file = Path(folder) / "config.json"
    try:
        return json.loads(file.read_text(encoding="utf-8")).get("model_type") == MODEL_TYPE
    except (OSError, ValueError, AttributeError):
        return False  # LLM's own loading says what is wrong with the folder



def refuse_canvas(model, revision: str | None, what: str) -> None:
    """A ``UserError`` when ``model`` (a folder or Hub id, resolved as ``LLM`` resolves it) is a
    canvas checkpoint and ``what`` (a command) does not run this family yet: said before any
    weight loads."""
    if is_canvas_checkpoint(resolve_model(model, revision)):
        raise UserError(f"{what} does not run {MODEL_TYPE} yet: its sampler runs from Python (LLM(...).generate, "
                        f".chat), dllm generate, serve, playground, bench, profile, eval and lm-eval's generate_until "
                        f"({DOCS})")


def format_canvas_steps(steps: list[CanvasStep]) -> str:
    """``dllm generate --show-steps``'s view of a canvas family's trace: one line per denoising
    step, the argmax canvas with the positions whose draw was not accepted marked ``~``."""
    lines = []
    for s in steps:
        words = s.text if s.text is not None else [str(t) for t in s.argmax_ids]
        shown = " ".join(w if ok else f"~{w}" for w, ok in zip(words, s.accepted))
        lines.append(f"canvas {s.canvas} step {s.step:>2}: {sum(s.accepted)}/{len(s.accepted)} accepted"
                     f"{' (stopped)' if s.finished else ''} | {shown}")
    return "\n".join(lines)
