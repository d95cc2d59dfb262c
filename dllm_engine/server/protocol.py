"""OpenAI-compatible request models and response bodies (``/v1/completions``,
``/v1/chat/completions``), plus the error type every failure path turns into.

Besides the OpenAI fields, a request may set any ``SamplingParams`` option by its own name
(``method``, ``threshold``, ``block_length``, ``focus_alpha``, ...). Every field the OpenAI API
defines is accepted: those a diffusion decoder can honour are implemented (``top_p``, ``top_k``,
``logprobs``, ``n``), the others are accepted and ignored (``NO_OP_FIELDS``). Unknown fields are
refused (``extra="forbid"``), so a typo answers 400 naming the field instead of being ignored."""
from __future__ import annotations

import re
import time
import typing
from dataclasses import dataclass, field
from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, create_model, field_validator

from ..errors import UserError
from ..engine.sequence import SequenceStats
from ..resolve import COMMIT_FIELDS
from ..sampling_params import MAX_LOGPROBS, MAX_SEED, ParamError, SamplingParams


class ApiError(Exception):
    """An error answered as ``{"error": {...}}`` with an HTTP status."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind

    def __reduce__(self):  # picklable: a replica process sends it to the HTTP front
        return ApiError, (self.status, self.message, self.param, self.kind)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.status}}


# -- requests --------------------------------------------------------------------------------
OPENAI_NAMES = {"max_new_tokens": "max_tokens"}  # SamplingParams name -> request field name
OPENAI_FIELDS = ("max_new_tokens", "temperature", "seed", "top_p", "logprobs", "n")  # declared below
ENGINE_FIELDS = {name: hint for name, hint in typing.get_type_hints(SamplingParams).items()
                 if name not in OPENAI_FIELDS}
MAX_N = 16  # choices per prompt
# OpenAI fields a diffusion decoder has no use for: accepted (clients send them) and ignored
COMMON_NO_OPS = ("presence_penalty", "frequency_penalty", "logit_bias", "user", "service_tier",
                 "store", "metadata")
COMPLETION_NO_OPS = ("suffix", "echo", "best_of")  # echo: false only
CHAT_NO_OPS = ("tools", "tool_choice", "parallel_tool_calls", "functions", "function_call",
               "response_format", "modalities", "audio", "prediction", "reasoning_effort",
               "web_search_options")
NO_OP_FIELDS = COMMON_NO_OPS + COMPLETION_NO_OPS + CHAT_NO_OPS


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class RequestBase(BaseModel):
    """Fields shared by both endpoints; the engine's options are added by ``with_engine_fields``."""
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)  # NaN / inf: 400 naming the field
    model: Optional[str] = None
    max_tokens: Optional[int] = Field(None, ge=1)
    temperature: Optional[float] = Field(None, ge=0)
    top_p: Optional[float] = Field(None, gt=0, le=1)
    seed: Optional[int] = Field(None, ge=0, lt=MAX_SEED)
    stop: Optional[str | list[str]] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    n: int = Field(1, ge=1, le=MAX_N, description="choices per prompt (choice j uses seed + j)")
    # accepted, ignored (NO_OP_FIELDS)
    presence_penalty: Optional[float] = Field(None, ge=-2, le=2)
    frequency_penalty: Optional[float] = Field(None, ge=-2, le=2)
    logit_bias: Optional[dict[str, float]] = None
    user: Optional[str] = None
    service_tier: Optional[str] = None
    store: Optional[bool] = None
    metadata: Optional[dict[str, str]] = None

    @field_validator("stop")
    @classmethod
    def check_stop(cls, value: str | list[str] | None) -> str | list[str] | None:
        stops = [value] if isinstance(value, str) else (value or [])
        if any(not s for s in stops):
            raise UserError("stop strings must be non-empty")
        if len(stops) > 16:
            raise UserError(f"at most 16 stop strings, got {len(stops)}")
        return value

    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def max_new_tokens(self) -> int | None:
        return self.max_tokens

    def logprobs_option(self) -> int | None:
        """SamplingParams.logprobs: None = off, N = the chosen token's logprob and its top N."""
        return None

    def sampling_overrides(self) -> dict:
        """The options this request set (an explicit null included), in SamplingParams names."""
        given = self.model_fields_set
        out = {name: getattr(self, name) for name in ENGINE_FIELDS if name in given}
        for name in ("temperature", "seed", "top_p"):
            if name in given and getattr(self, name) is not None:
                out[name] = getattr(self, name)
        if self.max_new_tokens() is not None:
            out["max_new_tokens"] = self.max_new_tokens()
        if self.logprobs_option() is not None:
            out["logprobs"] = self.logprobs_option()
        # a request that sets any of threshold / factor / steps chooses the whole commit rule
        if any(name in out for name in COMMIT_FIELDS):
            out = {name: None for name in COMMIT_FIELDS} | out
        return out


def with_engine_fields(name: str, base: type[BaseModel]) -> type[BaseModel]:
    """``base`` plus every SamplingParams option as an optional field of the same name."""
    # unset -> None (the server's default); an explicit null is accepted only where the option
    # itself may be None, so {"focus_alpha": null} is a 400, not a crash
    fields = {n: (hint, None) for n, hint in ENGINE_FIELDS.items()}
    return create_model(name, __base__=base, **fields)


class CompletionBase(RequestBase):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: Optional[int] = Field(None, ge=0, le=5, description="logprobs of the output tokens "
                                    "and of the top N alternatives at each")
    suffix: Optional[str] = None  # accepted, ignored
    echo: Optional[bool] = None  # false accepted; true refused (no prompt log-probabilities)
    best_of: Optional[int] = None  # accepted, ignored

    def logprobs_option(self) -> int | None:
        return self.logprobs

    @field_validator("echo")
    @classmethod
    def check_echo(cls, value):
        if value:  # a client scoring the prompt (lm-eval's log-likelihood) would read wrong numbers
            raise UserError("echo is not supported: log-probabilities cover the generated tokens "
                            "only, never the prompt's")
        return value

    @field_validator("prompt")
    @classmethod
    def check_prompt(cls, value):
        if isinstance(value, list) and not value:
            raise UserError("prompt list is empty")
        return value

    def prompts(self) -> list[str | list[int]]:
        """One entry per choice: a string or a list of token ids."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        return list(p)


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: Optional[str | list[TextPart]] = None
    name: Optional[str] = None
    tool_calls: Optional[list[dict]] = None  # an assistant's earlier tool calls: accepted, ignored
    tool_call_id: Optional[str] = None
    refusal: Optional[str] = None

    def as_dict(self) -> dict:
        """For the chat template: ``developer`` (OpenAI's newer name for system) becomes system;
        other roles pass through for the checkpoint's template to render."""
        content = self.content or ""
        text = content if isinstance(content, str) else " ".join(p.text for p in content)
        return {"role": "system" if self.role == "developer" else self.role, "content": text}


class ChatBase(RequestBase):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    logprobs: Optional[bool] = None
    top_logprobs: Optional[int] = Field(None, ge=0, le=MAX_LOGPROBS)
    # accepted, ignored (CHAT_NO_OPS)
    tools: Optional[list[dict]] = None
    tool_choice: Optional[str | dict] = None
    parallel_tool_calls: Optional[bool] = None
    functions: Optional[list[dict]] = None
    function_call: Optional[str | dict] = None
    response_format: Optional[dict] = None
    modalities: Optional[list[str]] = None
    audio: Optional[dict] = None
    prediction: Optional[dict] = None
    reasoning_effort: Optional[str] = None
    web_search_options: Optional[dict] = None

    def conversation(self) -> list[dict]:
        """The messages for the chat template. A message without content is refused as OpenAI
        refuses it; only an assistant message carrying ``tool_calls`` may leave it out."""
        for i, m in enumerate(self.messages):
            if m.content is None and not (m.role == "assistant" and m.tool_calls):
                raise ApiError(400, f"Missing required parameter: 'messages[{i}].content'.",
                               f"messages.{i}.content")
        return [m.as_dict() for m in self.messages]

    def logprobs_option(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise ApiError(400, "top_logprobs needs \"logprobs\": true", "top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None

    def max_new_tokens(self) -> int | None:
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise ApiError(400, "set max_tokens or max_completion_tokens, not both", "max_tokens")
        return self.max_completion_tokens or self.max_tokens


CompletionRequest = with_engine_fields("CompletionRequest", CompletionBase)
ChatCompletionRequest = with_engine_fields("ChatCompletionRequest", ChatBase)


# -- error mapping ---------------------------------------------------------------------------
PARAM_NAMES = [*OPENAI_NAMES, *ENGINE_FIELDS, "temperature", "seed", "prompt", "conversation"]
PARAM_RE = re.compile(r"\b(" + "|".join(sorted(PARAM_NAMES, key=len, reverse=True)) + r")\b")


def value_error(err: ValueError) -> ApiError:
    """A ValueError from SamplingParams / LLM -> 400 naming the request field it is about."""
    message = str(err)
    for engine_name, api_name in OPENAI_NAMES.items():
        message = message.replace(engine_name, api_name)
    found = PARAM_RE.search(str(err))
    param = err.param if isinstance(err, ParamError) else found.group(1) if found else None
    param = {"conversation": "messages", **OPENAI_NAMES}.get(param, param)
    return ApiError(400, message, param)


UNION_TAG = re.compile(r"str|int|float|bool|.*\[.*\]")


def validation_error(errors: list[dict]) -> ApiError:
    """FastAPI/pydantic validation errors -> one 400 naming the first offending field."""
    first = errors[0]
    # the field path, without "body" and pydantic's union-member tags such as "list[int]"
    loc = [str(x) for x in first.get("loc", ()) if x != "body" and not UNION_TAG.fullmatch(str(x))]
    path = ".".join(loc) or None
    if first.get("type") == "json_invalid":
        return ApiError(400, f"request body is not valid JSON: {first.get('msg')}")
    if first.get("type") == "extra_forbidden":
        return ApiError(400, f"unknown field {path!r}: not an OpenAI or dllm-engine option", path)
    if path is None:
        return ApiError(400, f"request body: {first.get('msg')}")
    return ApiError(400, f"{path}: {first.get('msg')}", path)


# -- responses -------------------------------------------------------------------------------
@dataclass
class TokenLogprob:
    """One output token as text, its logprob, and the top alternatives (text, logprob)."""
    token: str
    logprob: float
    top: list[tuple[str, float]]


@dataclass
class ChoiceResult:
    """The final outcome of one prompt of a request."""
    index: int
    text: str
    finish_reason: str  # "stop" (stop token or stop string) | "length"
    prompt_tokens: int
    completion_tokens: int
    stats: SequenceStats = field(default_factory=SequenceStats)
    logprobs: list[TokenLogprob] | None = None
    steps: list[dict] | None = None  # "record_steps": true: StepRecord.as_dict() per forward


def with_steps(choice: dict, result: ChoiceResult) -> dict:
    """``choice`` plus the extension field ``steps`` when the request asked for it
    (``"record_steps": true``; docs/traces.md)."""
    return choice if result.steps is None else {**choice, "steps": result.steps}


def completion_logprobs(items: list[TokenLogprob] | None, offset: int = 0) -> dict | None:
    """The legacy completions format: parallel lists, top alternatives as {token: logprob};
    ``text_offset`` counts from ``offset`` (the answer's text streamed before these tokens)."""
    if items is None:
        return None
    offsets = [offset]
    for t in items[:-1]:
        offsets.append(offsets[-1] + len(t.token))
    return {"tokens": [t.token for t in items], "token_logprobs": [t.logprob for t in items],
            "top_logprobs": [dict(t.top) for t in items], "text_offset": offsets}


def chat_logprobs(items: list[TokenLogprob] | None) -> dict | None:
    if items is None:
        return None

    def entry(token: str, logprob: float) -> dict:
        return {"token": token, "logprob": logprob, "bytes": list(token.encode())}
    return {"content": [entry(t.token, t.logprob) | {"top_logprobs": [entry(*x) for x in t.top]}
                        for t in items]}


def usage(results: list[ChoiceResult], n: int = 1) -> dict:
    """OpenAI usage plus the engine's stats (``SequenceStats``), summed over the request's choices; each prompt's
    tokens count once however many (``n``) choices sample it, as OpenAI counts them."""
    stats = SequenceStats.total([r.stats for r in results], 0.0)
    prompt = sum(r.prompt_tokens for r in results if r.index % n == 0)
    completion = sum(r.completion_tokens for r in results)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            # OpenAI's field: prompt tokens whose K/V were reused (the prefix store, engine/prefix_cache.py,
            # or another copy's first forward: engine/batch_step.py), summed over the choices as the stats are
            "prompt_tokens_details": {"cached_tokens": stats.cached_tokens}, "nfe": stats.nfe,
            "decoded_tokens": stats.decoded_tokens,
            "processed_tokens": round(stats.processed_tokens, 2),
            "prefill_tokens": stats.prefill_tokens, "redundancy": round(stats.redundancy, 4)}


def envelope(request_id: str, model: str, obj: str, created: int, choices: list[dict]) -> dict:
    return {"id": request_id, "object": obj, "created": created, "model": model, "choices": choices}


def completion_body(request_id: str, model: str, created: int, results: list[ChoiceResult],
                    n: int = 1) -> dict:
    choices = [with_steps({"index": r.index, "text": r.text, "finish_reason": r.finish_reason,
                           "logprobs": completion_logprobs(r.logprobs)}, r) for r in results]
    return {**envelope(request_id, model, "text_completion", created, choices), "usage": usage(results, n)}


def chat_body(request_id: str, model: str, created: int, results: list[ChoiceResult], n: int = 1) -> dict:
    choices = [with_steps({"index": r.index, "message": {"role": "assistant", "content": r.text},
                           "finish_reason": r.finish_reason, "logprobs": chat_logprobs(r.logprobs)}, r)
               for r in results]
    return {**envelope(request_id, model, "chat.completion", created, choices), "usage": usage(results, n)}


def completion_chunk(request_id: str, model: str, created: int, index: int, text: str,
                     finish_reason: str | None, logprobs: dict | None = None) -> dict:
    choice = {"index": index, "text": text, "finish_reason": finish_reason, "logprobs": logprobs}
    return envelope(request_id, model, "text_completion", created, [choice])


def chat_chunk(request_id: str, model: str, created: int, index: int, delta: dict,
               finish_reason: str | None, logprobs: dict | None = None) -> dict:
    choice = {"index": index, "delta": delta, "finish_reason": finish_reason, "logprobs": logprobs}
    return envelope(request_id, model, "chat.completion.chunk", created, [choice])


def now() -> int:
    return int(time.time())
