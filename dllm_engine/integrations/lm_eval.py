"""lm-evaluation-harness model ``dllm``: every lm-eval task through the engine, with any method.

``lm_eval`` finds models only in its own registry, so this module registers ``dllm`` when it is
imported: ``dllm lm-eval ...`` imports it and runs lm-eval's command line, and Python users import it
(or pass a ``DllmLM`` instance) before ``lm_eval.simple_evaluate``. Needs the ``lm-eval`` extra.

- ``generate_until``: every request joins the engine's continuous batch (``batch_size`` sequences
  at a time; the engine's output does not depend on the batch), each with its own ``max_gen_toks``
  and ``until`` strings (its kwargs normalised by lm-eval's ``normalize_gen_kwargs``, as its HF
  model); a sequence ends as soon as its finished blocks hold a stop string. A context too long for
  the model's context beside the canvas keeps its last tokens; a sampled request's seed is the base
  seed + its index in the call (lm-eval's ``repeats`` send one request several times).
- ``loglikelihood``: the masked-diffusion Monte-Carlo bound (``eval/likelihood.py``), the context
  cut on the left so context + continuation fit the model's context (as lm-eval's HF model).
- A DiffusionGemma checkpoint gets ``CanvasLM``: ``generate_until`` through its own sampler
  (``engine.canvas_llm``), no log-likelihoods.
- ``loglikelihood_rolling``: the same bound over the whole text, conditioned on the prefix token
  (BOS, else EOS: lm-eval's ``prefix_token_id``).
"""
from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import jinja2
import lm_eval.models  # noqa: F401  (lm-eval adds its own models only to an empty registry: first)
from lm_eval.api.instance import Instance
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import normalize_gen_kwargs
from tqdm import tqdm

from ..errors import UserError
from ..hub import resolve_model
from ..engine.canvas_llm import is_canvas_checkpoint
from ..engine.llm import LLM, quiet_transformers
from ..engine.sequence import Sequence, SequenceStats
from ..engine.stop_strings import committed_end, committed_ids, find_stop, tokens_through_stop
from ..eval.likelihood import LikelihoodConfig, loglikelihood
from ..methods import BLOCK, REFERENCE
from ..models.loader import parse_device
from ..sampling_params import MAX_SEED, SamplingParams
from ..spec import FIELD_TYPES, convert, parse_spec

log = logging.getLogger("lm_eval.models.dllm")  # under lm-eval's logger: its CLI prints these


@dataclass
class Generation:
    """One ``generate_until`` request in flight."""
    seq: Sequence
    stops: list[str]
    max_tokens: int  # the request's max_gen_toks (the canvas may be longer: whole blocks)
    end: int = -1  # committed canvas end when the stops were last checked
    text: str | None = None  # the answer, once known


@dataclass
class RunStats:
    """What the engine did during an lm-eval run (beside lm-eval's own metrics)."""
    generate: SequenceStats = field(default_factory=SequenceStats)
    generate_requests: int = 0
    loglikelihood_requests: int = 0
    loglikelihood_nfe: int = 0
    loglikelihood_seconds: float = 0.0

    def as_dict(self) -> dict:
        g = self.generate
        return {"generate_until": {"requests": self.generate_requests, **g.as_dict(),
                                   "tokens_per_step": round(g.tokens_per_step, 3),
                                   "throughput": round(g.output_tokens / g.seconds, 2) if g.seconds else 0.0},
                "loglikelihood": {"requests": self.loglikelihood_requests, "nfe": self.loglikelihood_nfe,
                                  "seconds": round(self.loglikelihood_seconds, 4)}}


def sampling_fields(options: dict) -> dict:
    """``model_args`` that are SamplingParams fields, converted from lm-eval's parsed values;
    anything else is refused with the names that are accepted."""
    unknown = sorted(set(options) - set(FIELD_TYPES))
    if unknown:
        raise UserError(f"unknown dllm model_args {unknown}: use pretrained, revision, method, dtype, "
                        f"device, batch_size, mc_num, mc_batch, mc_cfg_scale, check_greedy, stats_path or a "
                        f"SamplingParams field ({', '.join(FIELD_TYPES)})")
    fields = {}
    for name, value in options.items():
        try:
            fields[name] = convert(name, str(value))
        except ValueError:
            raise UserError(f"bad value {value!r} for model_args {name}") from None
    return fields


def engine_batch(batch_size: int | str | None, max_batch_size: int | None) -> int:
    """lm-eval's ``batch_size`` (an int, or ``auto``: the engine's default of 256 sequences)."""
    if batch_size is None or str(batch_size).startswith("auto"):
        return max_batch_size or 256
    if int(batch_size) < 1:
        raise UserError(f"batch_size must be >= 1 or 'auto', got {batch_size}")
    return int(batch_size)


def available_device(device: str) -> str:
    """``device``, or the CPU when it names an accelerator this machine does not have: lm-eval's
    ``--device`` defaults to cuda:0, and its HF model falls back to the CPU then; so does this
    model, with one warning."""
    try:
        parse_device(device)
    except ValueError as e:
        if str(device).split(":")[0] not in ("cuda", "mps"):
            raise
        log.warning("%s; running on the CPU, as lm-eval's HF model does (lm-eval's --device "
                    "defaults to cuda:0; pass --device cpu to say so)", str(e).split("; use")[0])
        return "cpu"
    return device


@register_model("dllm")
class DllmLM(LM):
    def __new__(cls, pretrained: str | None = None, *args, **kwargs):
        """A DiffusionGemma checkpoint gets ``CanvasLM`` (generation only), every other this class."""
        if cls is DllmLM and pretrained is not None:
            revision = kwargs.get("revision")
            if is_canvas_checkpoint(resolve_model(str(pretrained), None if revision is None else str(revision))):
                return super().__new__(CanvasLM)
        return super().__new__(cls)

    def __init__(self, pretrained: str, method: str | None = None, dtype: str = "auto",
                 device: str = "cpu", batch_size: int | str | None = 1, max_batch_size: int | None = None,
                 mc_num: int = 128, mc_batch: int = 32, mc_cfg_scale: float = 0.0, check_greedy: bool = False,
                 stats_path: str | None = None, revision: str | None = None, **sampling) -> None:
        super().__init__()
        fields = sampling_fields(sampling)
        revision = None if revision is None else str(revision)  # lm-eval parses "2024" as a number
        self.llm = LLM(str(pretrained), revision=revision, dtype=dtype, device=available_device(device),
                       max_num_seqs=engine_batch(batch_size, max_batch_size))
        if self.llm.tokenizer is None:
            raise UserError(f"{pretrained} has no tokenizer; lm-eval sends text")
        spec = parse_spec(method or "", **fields)
        # resolved once to fail before any request; the other fields stay unset, so a task's
        # max_gen_toks can still apply (make_sequence resolves each request)
        resolved = self.llm.resolve(spec)
        self.params = spec.replace(method=resolved.method)
        self.defaults = resolved  # a request's default max_gen_toks, block_length
        self.base_seed = 0 if spec.seed is None else spec.seed  # model_args' seed, else 0
        self.window = self.llm.model.config.max_position_embeddings
        self.likelihood = LikelihoodConfig(int(mc_num), int(mc_batch), float(mc_cfg_scale),
                                           seed=self.base_seed)
        self.check_greedy = bool(check_greedy)
        self.warned_unchecked_greedy = False
        self.stats_path = Path(stats_path) if stats_path else None
        self.stats = RunStats()
        self._device = self.llm.device

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None) -> "DllmLM":
        from lm_eval.utils import simple_parse_args_string
        return cls.create_from_arg_obj(simple_parse_args_string(arg_string), additional_config)

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict, additional_config: dict | None = None) -> "DllmLM":
        """``model_args`` win over lm-eval's own flags (its ``--device`` defaults to cuda:0)."""
        extra = {k: v for k, v in (additional_config or {}).items() if v is not None}
        return cls(**{**extra, **arg_dict})

    # -- chat template ------------------------------------------------------------------------
    @property
    def tokenizer_name(self) -> str:
        return str(self.llm.path).replace("/", "__")

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        return getattr(self.llm.tokenizer, "chat_template", None)

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """As lm-eval's HF model: lm-eval asks for no generation prompt when the task prefills the
        answer (``gen_prefix``), which then continues the final assistant message; a template that
        refuses the system role gets the conversation without it."""
        if not self.chat_template():
            raise UserError(f"{self.llm.path} has no chat template; run without --apply_chat_template")

        def render(messages: list[dict[str, str]]) -> str:
            return self.llm.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                continue_final_message=not add_generation_prompt)
        try:
            return render(chat_history)
        except jinja2.exceptions.TemplateError:
            log.warning("the chat template failed; applying it again without the system role")
            return render([m for m in chat_history if m["role"] != "system"])

    # -- generate_until -------------------------------------------------------------------------
    def generate_until(self, requests: list[Instance], disable_tqdm: bool = False) -> list[str]:
        gens = [self.generation(*req.args, index=i) for i, req in enumerate(requests)]
        start = time.perf_counter()
        self.run(gens, disable_tqdm)
        seqs = [g.seq for g in gens]
        self.stats.generate.add(SequenceStats.total([s.stats for s in seqs], 0.0))
        self.stats.generate.seconds += time.perf_counter() - start
        self.stats.generate_requests += len(gens)
        self.report()
        return [g.text for g in gens]

    def generation(self, context: str, gen_kwargs: dict, index: int = 0) -> Generation:
        """A sequence for one request: its own stop strings, token budget and sampling.

        ``gen_kwargs`` go through lm-eval's ``normalize_gen_kwargs``, as in its HF model:
        ``do_sample=False`` is greedy whatever the temperature, ``temperature > 0`` alone samples,
        and ``max_new_tokens`` / ``max_tokens`` / ``max_completion_tokens`` are aliases of
        ``max_gen_toks`` (default: the checkpoint's ``max_new_tokens``). ``model_args`` win:
        their ``max_new_tokens``, ``temperature``, ``top_p``, ``top_k``. A sampled request's seed is
        the base seed + ``index``, its place in the call (lm-eval's ``repeats`` send the same
        request several times), so the samples differ and a run repeats them; greedy requests keep
        the base seed."""
        kwargs = dict(normalize_gen_kwargs(dict(gen_kwargs or {}), self.defaults.max_new_tokens))
        stops = [s for s in kwargs.pop("until") if isinstance(s, str) and s]
        max_tokens = self.params.max_new_tokens or int(kwargs.pop("max_gen_toks"))
        kwargs.pop("max_gen_toks", None)
        changes = {"max_new_tokens": self.canvas_tokens(max_tokens)}
        do_sample, temperature = bool(kwargs.pop("do_sample")), float(kwargs.pop("temperature", 0.0))
        if self.params.temperature is None:  # greedy unless the task samples (as HF generate)
            changes["temperature"] = (temperature or 1.0) if do_sample else 0.0
        for name, kind in (("top_p", float), ("top_k", int)):
            value = kwargs.pop(name, None)
            if value is not None and getattr(self.params, name) is None:
                changes[name] = kind(value)
        if kwargs:
            log.warning("dllm ignores generation kwargs %s", sorted(kwargs))
        params = self.params.replace(**changes)
        resolved = self.llm.resolve(params)
        sampled = resolved.temperature > 0  # sampled: a seed of its own
        params = params.replace(seed=(self.base_seed + index * sampled) % MAX_SEED)
        resolved = resolved.replace(seed=params.seed)
        seq = self.llm.make_sequence(self.prompt_ids(context, resolved), params)
        return Generation(seq, stops, max_tokens)

    def canvas_tokens(self, max_tokens: int) -> int:
        """Semi-AR decoders need whole blocks: round ``max_tokens`` up (the answer is cut back)."""
        if self.params.decoder.block_causal:
            return max_tokens
        block = self.defaults.block_length
        return -(-max_tokens // block) * block

    def room(self, params: SamplingParams) -> int:
        """How many prompt tokens fit the model's context beside the canvas of ``params`` (resolved):
        whole blocks after the prompt, and for block diffusion (blocks aligned to position 0) up to
        the end of the block that holds the last new token. Below 1: none."""
        room = self.window - params.generation_slots
        if params.decoder.block_causal:
            block = params.block_length
            room = min(room, self.window // block * block - params.max_new_tokens)
        return room

    def prompt_ids(self, context: str, params: SamplingParams) -> list[int]:
        """The context's tokens (the prefix token for an empty one), cut on the left to leave room
        for the canvas of ``params`` (resolved), as lm-eval's HF model cuts for ``max_gen_toks``."""
        ids = self.tokens(context) or [self.prefix_token_id]
        room = self.room(params)
        if room < 1:
            raise UserError(f"max_gen_toks {params.max_new_tokens} ({params.generation_slots} canvas "
                            f"slots in blocks of {params.block_length}) leaves no room for a prompt in "
                            f"the model's context of {self.window} tokens")
        if len(ids) > room:
            log.warning("context of %d tokens cut to its last %d to fit the model's context of %d "
                        "tokens beside the canvas", len(ids), room, self.window)
            ids = ids[-room:]
        return ids

    def tokens(self, text: str) -> list[int]:
        """``text``'s token ids, no special tokens added ([] for an empty text)."""
        if not text:
            return []
        with quiet_transformers():  # its "longer than the model" warning: the callers cut
            ids = self.llm.tokenizer.encode(text, add_special_tokens=False)
        return self.llm.check_ids(ids) if ids else []

    @property
    def prefix_token_id(self) -> int:
        """What an empty context becomes (lm-eval's ``prefix_token_id``): BOS, else EOS."""
        tok = self.llm.tokenizer
        for token in (tok.bos_token_id, tok.eos_token_id):
            if token is not None:
                return token
        return self.llm.token_ids.eos_id

    def run(self, gens: list[Generation], disable_tqdm: bool = True) -> None:
        """Drive the engine until every request has its text."""
        engine = self.llm.engine
        for g in gens:
            engine.add(g.seq)
        live = {g.seq.seq_id: g for g in gens}
        bar = tqdm(total=len(gens), desc="dllm generate_until", disable=disable_tqdm)
        while engine.has_work():
            engine.step()
            for g in [g for g in live.values() if self.check(g)]:
                del live[g.seq.seq_id]
                bar.update(1)
        bar.close()

    def check(self, gen: Generation) -> bool:
        """Look at newly committed text: done when the sequence finished or a stop string showed
        up (the sequence then leaves the engine at once)."""
        seq = gen.seq
        end = committed_end(seq)
        if end == gen.end and not seq.finished:
            return False
        gen.end = end
        ids = committed_ids(seq)[: gen.max_tokens]
        text = self.decode(ids)
        cut = find_stop(text, gen.stops)
        if cut is None and not seq.finished:
            return False
        if cut is not None:
            text = text[:cut]
            ids = ids[: tokens_through_stop(ids, gen.stops, self.decode)]
            if not seq.finished and self.llm.engine.cancel(seq.seq_id):
                seq.stats.seconds = time.perf_counter() - seq.start_time
        seq.stats.output_tokens = len(ids)
        gen.text = text
        return True

    def decode(self, ids: list[int]) -> str:
        return self.llm.tokenizer.decode(ids, skip_special_tokens=True)

    # -- log-likelihoods --------------------------------------------------------------------------
    def loglikelihood(self, requests: list[Instance], disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        """(log p, is_greedy) per request; an empty continuation is (0.0, True), as in lm-eval's HF
        model. ``is_greedy`` is checked only with ``check_greedy=true`` (else False, with a
        warning once per run)."""
        pairs = self.fit([self.encode_pair(*req.args) for req in requests])
        start = time.perf_counter()
        values = [self.score(prompt, target) if target else 0.0 for prompt, target in
                  tqdm(pairs, desc="dllm loglikelihood", disable=disable_tqdm)]
        if self.check_greedy:
            greedy = self.greedy(pairs)
        else:
            greedy = [not target for _, target in pairs]
            if not all(greedy):
                self.warn_unchecked_greedy()
        self.stats.loglikelihood_seconds += time.perf_counter() - start
        self.stats.loglikelihood_requests += len(pairs)
        self.report()
        return list(zip(values, greedy))

    def warn_unchecked_greedy(self) -> None:
        if not self.warned_unchecked_greedy:
            self.warned_unchecked_greedy = True
            log.warning("dllm returns is_greedy=False for every non-empty continuation: it checks it only "
                        "with check_greedy=true in --model_args (a greedy decode per request, LLaDA's "
                        "check), so greedy-match metrics of this run mean nothing")

    def fit(self, pairs: list[tuple[list[int], list[int]]]) -> list[tuple[list[int], list[int]]]:
        """Each (context, continuation) within the model's context: a context too long keeps its
        last tokens (as lm-eval's HF model); a continuation that leaves no room for one context
        token is an error."""
        fitted, cut = [], 0
        for prompt, target in pairs:
            room = self.window - len(target)
            if room < 1:
                raise UserError(f"a continuation of {len(target)} tokens does not fit the model's "
                                f"context of {self.window} tokens with a context token before it")
            if len(prompt) > room:
                prompt, cut = prompt[-room:], cut + 1
            fitted.append((prompt, target))
        if cut:
            log.warning("%d of %d loglikelihood contexts cut to their last tokens to fit the model's "
                        "context of %d tokens", cut, len(pairs), self.window)
        return fitted

    def loglikelihood_rolling(self, requests: list[Instance], disable_tqdm: bool = False) -> list[float]:
        """The bound over the whole text given the prefix token (BOS, else EOS); an empty text
        scores 0.0 (no windows: the text must fit the context)."""
        prefix = self.prefix_token_id
        texts = [self.tokens(req.args[0]) for req in requests]
        limit = self.window - 1
        if any(len(t) > limit for t in texts):
            raise NotImplementedError(f"loglikelihood_rolling over texts longer than the context "
                                      f"({limit} tokens): windowing a diffusion bound is not implemented")
        return [self.score([prefix], t) if t else 0.0
                for t in tqdm(texts, desc="dllm loglikelihood_rolling", disable=disable_tqdm)]

    def encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """Token ids of context and continuation, split where the whole text's tokens split (trailing
        spaces of the context move to the continuation, as LLaDA's and lm-eval's HF models do). An
        empty context is the prefix token (lm-eval's rule: unless the text starts with it)."""
        spaces = len(context) - len(context.rstrip())
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        prompt, whole = self.tokens(context), self.tokens(context + continuation)
        if not prompt:
            prefix = self.prefix_token_id
            return (whole[:1], whole[1:]) if whole[:1] == [prefix] else ([prefix], whole)
        return prompt, whole[len(prompt):]

    def score(self, prompt: list[int], target: list[int]) -> float:
        result = loglikelihood(self.llm.model, prompt, target, self.llm.token_ids.mask_id, self.likelihood)
        self.stats.loglikelihood_nfe += result.nfe
        return result.value

    def greedy(self, pairs: list[tuple[list[int], list[int]]]) -> list[bool]:
        """Whether one-token-per-step greedy decoding (LLaDA's check) writes exactly the target (an
        empty one: True). The prompt keeps its last tokens if the check's canvas needs more room
        (block diffusion: whole blocks); a target whose canvas leaves none is not greedy."""
        checked, gens, unfit = [], [], 0
        for i, (prompt, target) in enumerate(pairs):
            if not target:
                continue
            params = self.greedy_params(len(target))
            room = self.room(self.llm.resolve(params))
            if room < 1:
                unfit += 1
                continue
            checked.append(i)
            gens.append(Generation(self.llm.make_sequence(prompt[-room:], params), [], len(target)))
        self.run(gens)
        results = [not target for _, target in pairs]
        for i, g in zip(checked, gens):
            target = pairs[i][1]
            results[i] = g.seq.canvas[g.seq.prompt_len: g.seq.prompt_len + len(target)].tolist() == target
        if unfit:
            log.warning("is_greedy left False for %d continuations whose greedy canvas does not fit the "
                        "model's context of %d tokens", unfit, self.window)
        return results

    def greedy_params(self, n: int) -> SamplingParams:
        """One token per step over an ``n``-token canvas (block diffusion: the family's blocks)."""
        if self.llm.model.config.is_block_causal:
            return SamplingParams(method=BLOCK.name, max_new_tokens=n, unmasking="low_confidence_static",
                                  stop_at_eos=False)
        return SamplingParams(method=REFERENCE.name, max_new_tokens=n, block_length=n, stop_at_eos=False)

    # -- stats ------------------------------------------------------------------------------------
    def report(self) -> None:
        """Log the engine's stats so far; write them to ``stats_path`` when given."""
        stats = self.stats.as_dict()
        log.info("dllm engine stats (%s): %s", self.params.method, json.dumps(stats))
        if self.stats_path is not None:
            self.stats_path.parent.mkdir(parents=True, exist_ok=True)
            self.stats_path.write_text(json.dumps({"method": self.params.method, **stats}, indent=2) + "\n")


class CanvasLM(DllmLM):
    """The lm-eval model ``dllm`` of a DiffusionGemma checkpoint (``engine.canvas_llm``):
    ``generate_until`` through ``CanvasLLM`` (its requests batched as ``LLM.generate`` batches
    them, ``batch_size`` rows at a time; each request samples with the base seed + its index, its
    answer cut at its first ``until`` string and at its ``max_gen_toks``); the log-likelihoods
    are not defined for uniform-noise diffusion here (no bound implemented), so those tasks stop
    with that error. ``model_args``: ``pretrained``, ``revision``, ``dtype``, ``device``,
    ``batch_size``, ``stats_path`` and the SamplingParams fields the family reads (``steps``,
    ``max_new_tokens``, ``seed``, ...)."""

    def __init__(self, pretrained: str, method: str | None = None, dtype: str = "auto", device: str = "cpu",
                 batch_size: int | str | None = 1, max_batch_size: int | None = None, stats_path: str | None = None,
                 revision: str | None = None, **sampling) -> None:
        LM.__init__(self)
        if method is not None:
            raise UserError(f"method {method!r}: diffusion_gemma samples with its own sampler; leave method out")
        self.llm = LLM(str(pretrained), revision=None if revision is None else str(revision), dtype=dtype,
                       device=available_device(device), max_num_seqs=engine_batch(batch_size, max_batch_size))
        if self.llm.tokenizer is None:
            raise UserError(f"{pretrained} has no tokenizer; lm-eval sends text")
        self.params = SamplingParams(**sampling_fields(sampling))
        self.defaults = self.llm.resolve(self.params)  # refuses what does not apply, before any request
        self.base_seed = 0 if self.params.seed is None else self.params.seed
        self.stats_path = Path(stats_path) if stats_path else None
        self.stats = RunStats()
        self._device = self.llm.device

    def generate_until(self, requests: list[Instance], disable_tqdm: bool = False) -> list[str]:
        contexts, params, stops = [], [], []
        for index, req in enumerate(requests):
            context, gen_kwargs = req.args
            kwargs = dict(normalize_gen_kwargs(dict(gen_kwargs or {}), self.defaults.max_new_tokens))
            stops.append([s for s in kwargs.pop("until") if isinstance(s, str) and s])
            max_tokens = self.params.max_new_tokens or int(kwargs.pop("max_gen_toks"))
            p = self.params.replace(max_new_tokens=max_tokens, seed=(self.base_seed + index) % MAX_SEED)
            room = self.llm.prompt_room(self.llm.resolve(p))
            if room < 1:
                raise UserError(f"max_gen_toks {max_tokens} leaves no room for a prompt beside its canvases in the "
                                f"model's {self.llm.model.config.max_position_embeddings} positions")
            ids = self.tokens(context) or [self.prefix_token_id]
            if len(ids) > room:  # as lm-eval's HF model: the context keeps its last tokens
                log.warning("context of %d tokens cut to its last %d to fit beside the canvases", len(ids), room)
            contexts.append(ids[-room:])
            params.append(p)
        start = time.perf_counter()
        outs = self.llm.run(contexts, params, use_tqdm=not disable_tqdm)
        texts = []
        for out, until in zip(outs, stops):
            cut = find_stop(out.text, until)
            texts.append(out.text if cut is None else out.text[:cut])
        self.stats.generate.add(outs.stats)
        self.stats.generate.seconds += time.perf_counter() - start
        self.stats.generate_requests += len(requests)
        self.report()
        return texts

    def loglikelihood(self, requests: list[Instance], disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        raise NotImplementedError("diffusion_gemma has no log-likelihood here (a uniform-noise model: the "
                                  "masked-diffusion bound does not apply); run generate_until tasks")

    def loglikelihood_rolling(self, requests: list[Instance], disable_tqdm: bool = False) -> list[float]:
        return self.loglikelihood(requests, disable_tqdm)

    @property
    def prefix_token_id(self) -> int:
        tok = self.llm.tokenizer
        return next(t for t in (tok.bos_token_id, tok.eos_token_id, *self.llm.settings.eos_token_ids)
                    if t is not None)

    def report(self) -> None:
        stats = self.stats.as_dict()
        log.info("dllm engine stats (diffusion-gemma): %s", json.dumps(stats))
        if self.stats_path is not None:
            self.stats_path.parent.mkdir(parents=True, exist_ok=True)
            self.stats_path.write_text(json.dumps({"method": "diffusion-gemma", **stats}, indent=2) + "\n")
