"""Offline API: ``LLM(path or Hugging Face id).generate(prompts, SamplingParams(...))``."""
from __future__ import annotations

import inspect
import itertools
import numbers
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from ..errors import UserError
from ..hub import model_name, resolve_model
from ..models import load_model
from ..models.compiled import check_compile, compile_model
from ..models.family import token_id
from ..models.loader import parse_device, read_generation_config
from ..models.quantize import check_quantization
from ..resolve import check_prompt, resolve_params, trained_block_size
from ..sampling_params import ParamError, SamplingParams
from ..seeds import SeedStream
from ..spec import parse_spec
from ..tokenizer import load_tokenizer
from ..strategies.base import merge_diagnostics
from .engine import Engine
from . import host_memory
from .sequence import Sequence, SequenceStats, TokenIds
from .trace import StepRecord, with_text


@dataclass
class RequestOutput:
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    stats: SequenceStats
    finish_reason: str  # "stop" (a stop token) or "length"
    # params.logprobs set: per output token (its logprob, top ids, their logprobs)
    logprobs: list[tuple[float, list[int], list[float]]] | None = None
    # params.record_steps: one record per forward (engine/trace.py, docs/traces.md); a canvas
    # family: one canvas_llm.CanvasStep per denoising step
    steps: list[StepRecord] | None = None
    # a canvas family (DiffusionGemma): the denoising steps of each canvas the request ran
    canvas_steps: list[int] | None = None


PROGRESS_DELAY_S = 2.0


class GenerateResult(list):
    """The outputs, in prompt order (with ``SamplingParams.n`` > 1, a list of the n answers of
    each prompt), plus ``stats`` (the call's summed ``SequenceStats``),
    ``method`` (as resolved for this model) and ``diagnostics`` (records of diagnostic
    strategies such as ``focus-probe``, summed over the call's sequences)."""
    stats: SequenceStats
    method: str
    diagnostics: dict


def prompt_list(prompts) -> list:
    """``generate``'s prompts as a list: one string or one list of token ids is one prompt."""
    if not isinstance(prompts, (str, list, tuple)):
        raise UserError("prompts are a string, a list of token ids, or a list of those; got "
                        + type(prompts).__name__ + (" (pass .tolist())" if hasattr(prompts, "tolist") else ""))
    if isinstance(prompts, str) or (prompts and isinstance(prompts[0], numbers.Integral)):
        return [prompts]
    return list(prompts)


def ids_list(value) -> list[int]:
    if value is None:
        return []
    return [value] if isinstance(value, int) else list(value)


@contextmanager
def quiet_transformers():
    """transformers' warnings off for the block (its "sequence length is longer than the
    specified maximum" would precede the engine's own, clearer context error)."""
    from transformers.utils import logging as hf_logging
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)


def check_options(device, tensor_parallel_size, compile: bool, compile_step: bool, quantization) -> None:
    """The options ``LLM`` can refuse before it reads or fetches anything."""
    if not isinstance(tensor_parallel_size, int) or tensor_parallel_size < 1:
        raise UserError(f"tensor_parallel_size must be an integer >= 1, got {tensor_parallel_size!r}")
    check_compile(compile, tensor_parallel_size, compile_step)
    check_quantization(quantization, parse_device(device), None)  # the dtype's check comes with the config


def memory_budget(device: torch.device, kv_cache_memory: int | None, utilization: float) -> int | None:
    """The engine's memory budget: ``kv_cache_memory`` when given; on CUDA by default the share
    ``utilization`` of the device's memory less what this process holds already (the weights), as
    vLLM's ``gpu_memory_utilization``; elsewhere none (a CPU's memory is the host's)."""
    if not 0 < utilization <= 1:
        raise UserError(f"gpu_memory_utilization must be in (0, 1], got {utilization}")
    if kv_cache_memory is not None or device.type != "cuda":
        return kv_cache_memory
    _, total = torch.cuda.mem_get_info(device)
    budget = int(utilization * total) - torch.cuda.memory_allocated(device)
    if budget <= 0:
        raise UserError(f"gpu_memory_utilization {utilization} leaves no memory for the KV cache: the "
                        f"weights take {torch.cuda.memory_allocated(device) / 2**30:.1f} GiB of "
                        f"{total / 2**30:.1f} GiB; raise it or give kv_cache_memory")
    return budget


UNITS = {"": 1, "b": 1, "k": 2**10, "kb": 2**10, "kib": 2**10, "m": 2**20, "mb": 2**20, "mib": 2**20,
         "g": 2**30, "gb": 2**30, "gib": 2**30}


# ``LLM.check_text_fits``: a long text's prefix of this many characters per position decides
# whether it can fit (typical text has 3-5 characters per token); the token its end cuts may
# split into a few, so this many tokens are allowed over the positions
PREFIX_CHARS = 8
CUT_MARGIN = 16


def parse_bytes(value: int | str | None) -> int | None:
    """A byte count from an int or a string such as ``512MiB``, ``4G`` or ``1.5GiB`` (binary units)."""
    if value is None or isinstance(value, int):
        return value
    text = str(value).strip().lower().replace(" ", "")
    number = text.rstrip("abgikm")
    unit = text[len(number):]
    try:
        if unit not in UNITS:
            raise ValueError
        return int(float(number) * UNITS[unit])
    except ValueError:
        raise UserError(f"kv_cache_memory must be a number of bytes such as 2GiB or 512MiB, got {value!r}") from None


class LLM:
    def __new__(cls, model: str | Path, *args, **kwargs):
        """``LLM``, or for a DiffusionGemma checkpoint (a uniform-noise canvas family with its own
        sampler) a ``canvas_llm.CanvasLLM``, which answers the same calls. The options are
        checked and the model resolved (a Hub id fetched) once, here."""
        if cls is not LLM:
            return super().__new__(cls)
        bound = inspect.signature(LLM.__init__).bind(None, model, *args, **kwargs)
        bound.apply_defaults()
        options = {k: v for k, v in bound.arguments.items() if k != "self"}
        check_options(options["device"], options["tensor_parallel_size"], options["compile"],
                      options["compile_step"], options["quantization"])  # before any download
        path = resolve_model(model, options["revision"])
        from .canvas_llm import CanvasLLM, is_canvas_checkpoint
        if is_canvas_checkpoint(path):
            return CanvasLLM(**options, path=path)
        self = super().__new__(cls)
        self._path = path
        return self

    def __init__(self, model: str | Path, dtype: str = "auto", device: str = "cpu",
                 max_num_seqs: int = 256, keep_freed_memory: bool = False,
                 tensor_parallel_size: int = 1, compile: bool = False, fixed_shapes: bool = False,
                 compile_step: bool = False, revision: str | None = None, seed: int | None = 0,
                 kv_cache_memory: int | str | None = None, gpu_memory_utilization: float = 0.9,
                 quantization: str | None = None, prefix_cache: bool = True) -> None:
        """``model``: a checkpoint folder, or a Hugging Face id (``org/name``) at ``revision``
        (a branch, tag or commit hash; default ``main``), fetched into huggingface_hub's cache
        unless it is there already (``hub.resolve_model``; docs/models/hub.md). ``name`` is the
        id, or the folder's name; ``path`` the folder read.

        ``dtype``: ``"auto"`` (default) is the checkpoint's own: config.json's ``torch_dtype``,
        else the dtype its weights are stored in (bf16 for the released models, float32 for the
        embedded ones; ``models/loader.resolve_dtype``); or float32 / bfloat16 / float16.

        ``seed``: seeds the stream of seeds that requests without their own take, in the order
        they are submitted (``seeds.SeedStream``): the default 0 gives a script the same answers
        every run, while copies of a prompt and repeated calls sample independently; None draws
        them from the operating system. A request's own ``SamplingParams.seed`` wins.

        ``keep_freed_memory``: on CPU, tune this process's glibc allocator to reuse freed
        activations (faster, keeps the peak heap; process-wide: see ``engine/host_memory.py``).

        ``tensor_parallel_size`` N > 1: the model is split over N processes, one per device
        (``engine/parallel.py``); this process is rank 0. Under torchrun, ranks other than 0
        serve inside this call and exit when rank 0 calls ``close()`` (or exits).

        ``compile``: torch.compile the layers' norms and MLPs (``models/compiled.py``; not
        bit-exact, off by default; one process only).

        ``fixed_shapes``: every step's rows, tokens and keys rounded up to a bucket (at most a
        quarter more), with a mask and indexed K/V writes, so a CUDA graph or a static compile
        can capture one step per shape (``engine/shapes.py``; same tokens; off by default: padding costs compute).
        ``compile_step``: fixed shapes, and the layer stack of every step without layer hooks
        compiled, one graph per shape (``models/compiled.compile_step``; CUDA graphs on CUDA;
        not bit-exact; one process only).

        ``quantization``: ``"int8"`` (CPU and CUDA) or ``"int4"`` (CUDA, bfloat16) weight-only
        quantization of the linear layers through torchao, from the checkpoint's own weights on
        load (``models/quantize.py``, docs/quantization.md; ``model.quantization`` says what it
        quantized). Not bit-exact with the unquantized model.

        ``prefix_cache``: block-causal families (SDAR, LLaDA2.x) reuse the K/V of the final blocks
        earlier requests computed when a prompt starts with the same tokens (exact: same tokens;
        ``engine/prefix_cache.py``; off under tensor parallelism), and the ``n`` copies of a
        prompt, in every family, compute their first forward once (exact: the same inputs)."""
        self.device = parse_device(device)
        self.seeds = SeedStream(seed)
        check_options(device, tensor_parallel_size, compile, compile_step, quantization)
        # resolved by __new__ (after the options' checks: bad options fail before any download)
        self.path = getattr(self, "_path", None) or resolve_model(model, revision)
        self.name = model_name(model)
        if keep_freed_memory and self.device.type == "cpu":
            host_memory.keep_freed_memory()
        self.parallel = None
        if tensor_parallel_size > 1:
            from .parallel import TensorParallel
            self.parallel = TensorParallel.of_llm(self, self.path, dtype, quantization, self.device,
                                                  tensor_parallel_size, keep_freed_memory)
        if self.parallel is not None:
            self.model = self.parallel.model
        else:
            self.model = load_model(self.path, dtype=dtype, device=self.device, quantization=quantization)
        if compile:
            compile_model(self.model)
        self.tokenizer = self.load_tokenizer()
        self.generation_config = read_generation_config(self.path)
        self.token_ids = self.resolve_ids()
        runner = self.parallel.runner if self.parallel is not None else None
        self.engine = Engine(self.model, max_num_seqs=max_num_seqs, runner=runner, fixed_shapes=fixed_shapes,
                             compile_step=compile_step,
                             kv_cache_memory=memory_budget(self.device, parse_bytes(kv_cache_memory),
                                                           gpu_memory_utilization),
                             prefix_cache=prefix_cache and self.parallel is None)
        self.counter = itertools.count()

    @property
    def model_type(self) -> str:
        """config.json's model_type (what /v1/models reports)."""
        return self.model.config.model_type

    @property
    def methods(self) -> tuple[str, ...]:
        """The base decoders this model's attention pattern runs."""
        return tuple(self.model.family.methods)

    @property
    def tensor_parallel_size(self) -> int:
        return 1 if self.parallel is None else self.parallel.size

    def clear_prefix_store(self) -> None:
        """Forget the prefix store's blocks (``prefix_cache``), so the next call starts cold
        (``dllm bench``: no spec reuses another's blocks)."""
        if self.engine.prefix_store is not None:
            self.engine.prefix_store.clear()

    def close(self) -> None:
        """Stop the tensor-parallel workers (nothing to do in one process)."""
        if self.parallel is not None:
            self.parallel.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def load_tokenizer(self):
        """The checkpoint's tokenizer (``tokenizer.load_tokenizer``: never its remote code); None
        when the folder has no tokenizer files or they cannot be loaded (one warning says why):
        token-id prompts still work."""
        files = ("tokenizer.json", "tokenizer_config.json", "vocab.json")
        if not any((self.path / name).is_file() for name in files):
            return None
        return load_tokenizer(self.path)

    def token_by_name(self, name: str | None) -> int | None:
        """The tokenizer's id of token ``name``; None without a tokenizer or when it does not
        know the token (``convert_tokens_to_ids`` gives the unknown token's id, or None, then)."""
        tok = self.tokenizer
        if tok is None or name is None:
            return None
        i = token_id(tok.convert_tokens_to_ids(name), None)
        return None if i is None or i == tok.unk_token_id else i

    def resolve_ids(self) -> TokenIds:
        """mask / eos / stop ids from config.json, generation_config.json, then the tokenizer (a
        null or negative id counts as absent). The mask id falls back to the family's mask token
        looked up by name (LLaDA2.0 declares none); the stop ids are every eos id plus the family's
        end-of-turn token when the tokenizer has it (a chat answer ends with it)."""
        cfg, gen, tok, family = self.model.config, self.generation_config, self.tokenizer, self.model.family
        candidates = (cfg.mask_token_id, gen.get("mask_token_id"),
                      getattr(tok, "mask_token_id", None) if tok is not None else None,
                      self.token_by_name(family.mask_token))
        mask = next((i for i in (token_id(c, None) for c in candidates) if i is not None), None)
        if mask is None:
            by_name = f" (nor a {family.mask_token} token)" if family.mask_token else ""
            raise UserError(f"{self.path}: no mask_token_id in config.json, generation_config.json "
                            f"or the tokenizer{by_name}")
        if mask >= cfg.vocab_size:
            raise UserError(f"{self.path}: mask token id {mask} is outside the model's vocabulary "
                            f"of {cfg.vocab_size}")
        stops = [i for i in (token_id(x, None) for x in ids_list(gen.get("eos_token_id"))) if i is not None]
        if cfg.eos_token_id >= 0:
            stops.append(cfg.eos_token_id)
        if tok is not None and token_id(tok.eos_token_id, None) is not None:
            stops.append(tok.eos_token_id)
        if not stops:
            raise UserError(f"{self.path}: no eos_token_id in config.json or the tokenizer")
        eos = cfg.eos_token_id if cfg.eos_token_id >= 0 else stops[0]
        end_of_turn = self.token_by_name(family.end_of_turn_token)
        if end_of_turn is not None:
            stops.append(end_of_turn)
        return TokenIds(mask_id=mask, eos_id=eos, stop_ids=frozenset(stops))

    # -- prompts ---------------------------------------------------------------------------
    def encode(self, prompt: str | list[int]) -> list[int]:
        if not isinstance(prompt, (str, list, tuple)):
            raise UserError(f"a prompt is a string or a list of token ids, got {type(prompt).__name__}"
                            + (" (pass .tolist())" if hasattr(prompt, "tolist") else ""))
        if isinstance(prompt, str):
            if not prompt.strip():
                raise UserError("prompt is empty")
            if self.tokenizer is None:
                raise UserError(f"{self.path} has no tokenizer; pass token-id prompts")
            self.check_text_fits(prompt)
            with quiet_transformers():  # the context check below says it better than its warning
                ids = self.tokenizer.encode(prompt, add_special_tokens=False)
            return self.check_ids(ids)
        return self.check_ids(list(prompt))

    def check_text_fits(self, text: str) -> None:
        """Refuse a text too long for the model's positions without tokenizing it whole: a
        prefix of ``PREFIX_CHARS`` characters per position is tokenized first, and when it alone
        holds more tokens than the positions (less ``CUT_MARGIN`` for the word its end cuts) the
        rest is never read. A shorter text, or a long one whose prefix fits (few tokens per
        character), is tokenized whole and checked by its tokens as usual."""
        limit = self.model.config.max_position_embeddings
        window = PREFIX_CHARS * (limit + CUT_MARGIN)
        if self.tokenizer is None or len(text) <= window:
            return
        with quiet_transformers():
            n = len(self.tokenizer.encode(text[:window], add_special_tokens=False))
        if n - CUT_MARGIN > limit:
            raise UserError(f"prompt is longer than the model's {limit:,} positions: its first {window:,} "
                            f"characters (of {len(text):,}) are already {n:,} tokens")

    def check_ids(self, ids: list[int]) -> list[int]:
        vocab = self.model.config.vocab_size
        if not ids:
            raise UserError("prompt is empty")
        if not all(isinstance(i, numbers.Integral) and not isinstance(i, bool) for i in ids):
            raise UserError("a token-id prompt holds integers only, got "
                            + ", ".join(sorted({type(i).__name__ for i in ids})))
        if any(i < 0 or i >= vocab for i in ids):
            raise UserError(f"prompt has token ids outside [0, {vocab}), the model's vocabulary")
        if self.token_ids.mask_id in ids:  # block diffusion would fill it in the prompt's last block
            raise UserError(f"prompt holds the mask token (id {self.token_ids.mask_id}): the decoders "
                            "fill masks after the prompt only (infilling is not supported)")
        return [int(i) for i in ids]

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise UserError(f"{self.path} has no chat template in its tokenizer_config.json")
        if not messages:
            raise UserError("conversation is empty")
        self.check_text_fits(" ".join(m["content"] for m in messages
                                      if isinstance(m, dict) and isinstance(m.get("content"), str)))
        with quiet_transformers():
            return list(self.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                           tokenize=True, return_dict=False))

    @staticmethod
    def parse_spec(spec: str, **defaults) -> SamplingParams:
        """A bench spec, ``method[:field=value,...]``, as this model reads it (``spec.parse_spec``)."""
        return parse_spec(spec, **defaults)

    def resolve(self, params: SamplingParams | None = None) -> SamplingParams:
        """``params`` with every field filled for this model (``resolve_params``)."""
        cfg = self.model.config
        return resolve_params(params or SamplingParams(), self.model.family.methods,
                              self.generation_config, cfg.logit_shift, trained_block_size(cfg))

    def resolve_for_prompt(self, params: SamplingParams, prompt_len: int) -> SamplingParams:
        """``resolve``, then checked against a prompt of ``prompt_len`` tokens."""
        p = self.resolve(params)
        check_prompt(p, prompt_len, self.model.config.max_position_embeddings)
        vocab = self.model.config.vocab_size
        if any(i >= vocab for i in p.stop_token_ids):
            raise ParamError("stop_token_ids", f"stop_token_ids must be ids in [0, {vocab}), the "
                             f"model's vocabulary, got {list(p.stop_token_ids)}")
        return p

    def make_sequence(self, prompt_ids: list[int], params: SamplingParams) -> Sequence:
        """One request's sequence; without a seed of its own it takes the stream's next."""
        if params.seed is None:
            params = params.replace(seed=self.seeds.next())
        p = self.resolve_for_prompt(params, len(prompt_ids))
        ids = self.token_ids
        if p.stop_token_ids:
            ids = TokenIds(ids.mask_id, ids.eos_id, ids.stop_ids | frozenset(p.stop_token_ids))
        seq = Sequence(next(self.counter), prompt_ids, p, ids, self.device)
        self.engine.check_fits(seq)  # a request that could never fit the memory budget: refused now
        return seq

    # -- generation ------------------------------------------------------------------------
    def generate(self, prompts: list[str] | list[list[int]] | str,
                 params: SamplingParams | list[SamplingParams] | None = None, use_tqdm: bool = False) -> GenerateResult:
        return self.run([self.encode(p) for p in prompt_list(prompts)], params, use_tqdm)

    def chat(self, conversations: list[list[dict]], params: SamplingParams | list[SamplingParams] | None = None,
             use_tqdm: bool = False) -> GenerateResult:
        if not isinstance(conversations, (list, tuple)) or not all(
                isinstance(m, dict) or (isinstance(m, (list, tuple)) and all(isinstance(x, dict) for x in m))
                for m in conversations):
            raise UserError("a conversation is a list of messages, {'role': ..., 'content': ...}; "
                            "chat takes one conversation or a list of them")
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        return self.run([self.check_ids(self.apply_chat_template(c)) for c in conversations],
                        params, use_tqdm)

    def run(self, prompt_ids: list[list[int]], params: SamplingParams | list[SamplingParams] | None,
            use_tqdm: bool) -> GenerateResult:
        if not prompt_ids:
            raise UserError("no prompts given")
        per_prompt = self.params_per_prompt(params, len(prompt_ids))
        groups = [[self.make_sequence(ids, p.replace(seed=seed))  # validate all first
                   for seed in self.seeds.choice_seeds(p.seed, p.n)] for ids, p in zip(prompt_ids, per_prompt)]
        seqs = [seq for group in groups for seq in group]
        start = time.perf_counter()
        try:
            self.drive(seqs, use_tqdm)
        except BaseException:
            self.engine.abort({s.seq_id for s in seqs})  # leave the engine empty and usable
            raise
        # a prompt asking for n > 1 answers gets the list of them
        result = GenerateResult([self.output(g[0]) if p.n == 1 else [self.output(s) for s in g]
                                 for g, p in zip(groups, per_prompt)])
        result.stats = SequenceStats.total([s.stats for s in seqs], time.perf_counter() - start)
        result.method = seqs[0].params.method
        methods = dict.fromkeys(s.params.method for s in seqs)  # a list of params may mix methods
        result.diagnostics = merge_diagnostics([self.engine.pipeline(m).diagnostics(
            [s for s in seqs if s.params.method == m]) for m in methods])
        return result

    @staticmethod
    def params_per_prompt(params: SamplingParams | list[SamplingParams] | None, count: int) -> list[SamplingParams]:
        """One SamplingParams per prompt: ``params`` for all (None: the defaults), or a list of
        one per prompt."""
        given = list(params) if isinstance(params, (list, tuple)) else [params] * count
        if len(given) != count:
            raise UserError(f"{len(given)} SamplingParams for {count} prompts: give one, or one per prompt")
        for p in given:
            if p is not None and not isinstance(p, SamplingParams):
                raise UserError(f"params must be a SamplingParams, got {type(p).__name__}"
                                + (" (SamplingParams(**params))" if isinstance(p, dict) else ""))
        return [SamplingParams() if p is None else p for p in given]

    def drive(self, seqs: list[Sequence], use_tqdm: bool) -> None:
        """Add ``seqs`` to the engine and step until it is idle."""
        for seq in seqs:
            self.engine.add(seq)
        # committed slots of every canvas; shown only once a run has lasted PROGRESS_DELAY_S
        with tqdm(total=sum(s.canvas_len - s.prompt_len for s in seqs), desc="generate", unit="tok",
                  delay=PROGRESS_DELAY_S, disable=not use_tqdm) as bar:
            while self.engine.has_work():
                self.engine.step()
                bar.update(sum(s.canvas_len - s.prompt_len if s.finished else s.stats.decoded_tokens
                               for s in seqs) - bar.n)
            bar.update(bar.total - bar.n)  # adaptive length may have cut canvases short

    def output(self, seq: Sequence) -> RequestOutput:
        ids = seq.output_ids()
        text = self.tokenizer.decode(ids, skip_special_tokens=True) if self.tokenizer else ""
        logprobs = seq.output_logprobs(len(ids)) if seq.params.logprobs is not None else None
        return RequestOutput(prompt_token_ids=seq.canvas[: seq.prompt_len].tolist(), token_ids=ids,
                             text=text, stats=seq.stats,
                             finish_reason="stop" if len(ids) < seq.params.max_new_tokens else "length",
                             logprobs=logprobs, steps=self.steps(seq))

    def steps(self, seq: Sequence) -> list[StepRecord] | None:
        """``seq``'s step records (None unless it recorded them), with token text where the
        model has a tokenizer."""
        if seq.trace is None:
            return None
        if self.tokenizer is None:
            return list(seq.trace.records)
        return with_text(seq.trace.records, self.token_text)

    def token_text(self, token_id: int) -> str:
        """One token's text as a trace shows it (special tokens by name)."""
        return self.tokenizer.decode([token_id], skip_special_tokens=False)
