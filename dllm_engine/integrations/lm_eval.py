"""lm-evaluation-harness model ``dllm``: every lm-eval task through the engine, with any method.

``lm_eval`` finds models only in its own registry, so this module registers ``dllm`` when it is
imported: ``dllm lm-eval ...`` imports it and runs lm-eval's command line, and Python users import it
(or pass a ``DllmLM`` instance) before ``lm_eval.simple_evaluate``. Needs the ``lm-eval`` extra.

- ``generate_until``: every request joins the engine's continuous batch (``batch_size`` sequences
  at a time; the engine's output does not depend on the batch), each with its own ``max_gen_toks``
  and ``until`` strings; a sequence ends as soon as its finished blocks hold a stop string.
- ``loglikelihood``: the masked-diffusion Monte-Carlo bound (``eval/likelihood.py``).
- ``loglikelihood_rolling``: the same bound over the whole text, conditioned on BOS.
"""
from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import lm_eval.models  # noqa: F401  (lm-eval adds its own models only to an empty registry: first)
from lm_eval.api.instance import Instance
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model
from tqdm import tqdm

from ..engine.llm import LLM
from ..engine.sequence import Sequence, SequenceStats
from ..engine.stop_strings import committed_end, committed_ids, find_stop, tokens_through_stop
from ..eval.likelihood import LikelihoodConfig, loglikelihood
from ..sampling_params import FIELD_TYPES, SamplingParams, convert, parse_spec

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
        raise ValueError(f"unknown dllm model_args {unknown}: use pretrained, method, dtype, device, "
                         f"batch_size, mc_num, mc_batch, mc_cfg_scale, check_greedy, stats_path or a "
                         f"SamplingParams field ({', '.join(FIELD_TYPES)})")
    fields = {}
    for name, value in options.items():
        try:
            fields[name] = convert(name, str(value))
        except ValueError:
            raise ValueError(f"bad value {value!r} for model_args {name}") from None
    return fields


def engine_batch(batch_size: int | str | None, max_batch_size: int | None) -> int:
    """lm-eval's ``batch_size`` (an int, or ``auto``: the engine's default of 256 sequences)."""
    if batch_size is None or str(batch_size).startswith("auto"):
        return max_batch_size or 256
    if int(batch_size) < 1:
        raise ValueError(f"batch_size must be >= 1 or 'auto', got {batch_size}")
    return int(batch_size)


@register_model("dllm")
class DllmLM(LM):
    def __init__(self, pretrained: str, method: str | None = None, dtype: str = "float32",
                 device: str = "cpu", batch_size: int | str | None = 1, max_batch_size: int | None = None,
                 mc_num: int = 128, mc_batch: int = 32, mc_cfg_scale: float = 0.0, check_greedy: bool = False,
                 stats_path: str | None = None, **sampling) -> None:
        super().__init__()
        fields = sampling_fields(sampling)
        self.llm = LLM(pretrained, dtype=dtype, device=device,
                       max_num_seqs=engine_batch(batch_size, max_batch_size))
        if self.llm.tokenizer is None:
            raise ValueError(f"{pretrained} has no tokenizer; lm-eval sends text")
        spec = parse_spec(method or "", **fields)
        # resolved once to fail before any request; the other fields stay unset, so a task's
        # max_gen_toks can still apply (make_sequence resolves each request)
        resolved = self.llm.resolve(spec)
        self.params = spec.replace(method=resolved.method)
        self.likelihood = LikelihoodConfig(int(mc_num), int(mc_batch), float(mc_cfg_scale),
                                           seed=resolved.seed)
        self.check_greedy = bool(check_greedy)
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
        if not self.chat_template():
            raise ValueError(f"{self.llm.path} has no chat template; run without --apply_chat_template")
        return self.llm.tokenizer.apply_chat_template(chat_history, tokenize=False,
                                                      add_generation_prompt=add_generation_prompt)

    # -- generate_until -------------------------------------------------------------------------
    def generate_until(self, requests: list[Instance], disable_tqdm: bool = False) -> list[str]:
        gens = [self.generation(*req.args) for req in requests]
        start = time.perf_counter()
        self.run(gens, disable_tqdm)
        seqs = [g.seq for g in gens]
        self.stats.generate.add(SequenceStats.total([s.stats for s in seqs], 0.0))
        self.stats.generate.seconds += time.perf_counter() - start
        self.stats.generate_requests += len(gens)
        self.report()
        return [g.text for g in gens]

    def generation(self, context: str, gen_kwargs: dict) -> Generation:
        """A sequence for one request: its own stop strings, token budget and temperature."""
        kwargs = dict(gen_kwargs)
        until = kwargs.pop("until", None) or []
        stops = [until] if isinstance(until, str) else list(until)
        max_tokens = self.params.max_new_tokens or kwargs.get("max_gen_toks")
        kwargs.pop("max_gen_toks", None)
        changes = {"max_new_tokens": self.canvas_tokens(max_tokens)} if max_tokens else {}
        do_sample, temperature = kwargs.pop("do_sample", False), float(kwargs.pop("temperature", 0.0) or 0.0)
        if do_sample or temperature > 0:  # greedy unless the task asks to sample (as HF generate)
            changes["temperature"] = temperature or 1.0
        if kwargs:
            log.warning("dllm ignores generation kwargs %s", sorted(kwargs))
        params = self.params.replace(**changes)
        seq = self.llm.make_sequence(self.prompt_ids(context, params), params)
        return Generation(seq, [s for s in stops if s], max_tokens or seq.params.max_new_tokens)

    def canvas_tokens(self, max_tokens: int) -> int:
        """Semi-AR decoders need whole blocks: round ``max_tokens`` up (the answer is cut back)."""
        if self.params.base_method == "block":
            return max_tokens
        block = self.params.block_length or self.llm.generation_config.get("block_length", 32)
        return -(-max_tokens // block) * block

    def prompt_ids(self, context: str, params: SamplingParams) -> list[int]:
        """The context's tokens, cut on the left to leave room for the canvas (as lm-eval's HF model)."""
        ids = self.llm.encode(context)
        room = self.llm.model.config.max_position_embeddings - (params.max_new_tokens or 0)
        if params.max_new_tokens and len(ids) > room:
            log.warning("context of %d tokens cut to its last %d to fit the model", len(ids), room)
            ids = ids[-room:]
        return ids

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
        pairs = [self.encode_pair(*req.args) for req in requests]
        start = time.perf_counter()
        values = [self.score(prompt, target) for prompt, target in
                  tqdm(pairs, desc="dllm loglikelihood", disable=disable_tqdm)]
        greedy = self.greedy(pairs) if self.check_greedy else [False] * len(pairs)
        self.stats.loglikelihood_seconds += time.perf_counter() - start
        self.stats.loglikelihood_requests += len(pairs)
        self.report()
        return list(zip(values, greedy))

    def loglikelihood_rolling(self, requests: list[Instance], disable_tqdm: bool = False) -> list[float]:
        """The bound over the whole text given BOS (no windows: the text must fit the context)."""
        bos = self.llm.tokenizer.bos_token_id
        if bos is None:
            raise NotImplementedError(f"loglikelihood_rolling scores a text given BOS, and {self.llm.path} "
                                      f"has no bos_token")
        texts = [self.llm.encode(req.args[0]) for req in requests]
        limit = self.llm.model.config.max_position_embeddings - 1
        if any(len(t) > limit for t in texts):
            raise NotImplementedError(f"loglikelihood_rolling over texts longer than the context "
                                      f"({limit} tokens): windowing a diffusion bound is not implemented")
        return [self.score([bos], t) for t in tqdm(texts, desc="dllm loglikelihood_rolling",
                                                   disable=disable_tqdm)]

    def encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """Token ids of context and continuation, split where the whole text's tokens split (trailing
        spaces of the context move to the continuation, as LLaDA's and lm-eval's HF models do)."""
        spaces = len(context) - len(context.rstrip())
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        tok = self.llm.tokenizer
        prompt = tok.encode(context, add_special_tokens=False) if context else []
        whole = tok.encode(context + continuation, add_special_tokens=False)
        if not prompt:
            if tok.bos_token_id is None:
                raise ValueError(f"an empty context needs a BOS token, and {self.llm.path} has none")
            return [tok.bos_token_id], whole
        return prompt, whole[len(prompt):]

    def score(self, prompt: list[int], target: list[int]) -> float:
        result = loglikelihood(self.llm.model, prompt, target, self.llm.token_ids.mask_id, self.likelihood)
        self.stats.loglikelihood_nfe += result.nfe
        return result.value

    def greedy(self, pairs: list[tuple[list[int], list[int]]]) -> list[bool]:
        """Whether one-token-per-step greedy decoding (LLaDA's check) writes exactly the target."""
        gens = [Generation(self.llm.make_sequence(prompt, self.greedy_params(len(target))), [], len(target))
                for prompt, target in pairs]
        self.run(gens)
        return [g.seq.canvas[g.seq.prompt_len: g.seq.prompt_len + len(t)].tolist() == t
                for g, (_, t) in zip(gens, pairs)]

    def greedy_params(self, n: int) -> SamplingParams:
        """One token per step over an ``n``-token canvas (block diffusion: the family's blocks)."""
        if self.llm.model.config.is_block_causal:
            return SamplingParams(method="block", max_new_tokens=n, unmasking="low_confidence_static",
                                  stop_at_eos=False)
        return SamplingParams(method="reference", max_new_tokens=n, block_length=n, stop_at_eos=False)

    # -- stats ------------------------------------------------------------------------------------
    def report(self) -> None:
        """Log the engine's stats so far; write them to ``stats_path`` when given."""
        stats = self.stats.as_dict()
        log.info("dllm engine stats (%s): %s", self.params.method, json.dumps(stats))
        if self.stats_path is not None:
            self.stats_path.parent.mkdir(parents=True, exist_ok=True)
            self.stats_path.write_text(json.dumps({"method": self.params.method, **stats}, indent=2) + "\n")
