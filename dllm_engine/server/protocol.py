"""OpenAI-compatible request models and response bodies (``/v1/completions``,
``/v1/chat/completions``), plus the error type every failure path turns into.

Besides the OpenAI fields, a request may set any ``SamplingParams`` option by its own name
(``method``, ``threshold``, ``block_length``, ``focus_alpha``, ...). Unknown fields are refused
(``extra="forbid"``), so a typo answers 400 naming the field instead of being ignored."""
from __future__ import annotations

import re
import time
import typing
from dataclasses import dataclass, field
from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, create_model, field_validator

from ..engine.sequence import SequenceStats
from ..sampling_params import COMMIT_FIELDS, ParamError, SamplingParams


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
ENGINE_FIELDS = {name: hint for name, hint in typing.get_type_hints(SamplingParams).items()
                 if name not in ("max_new_tokens", "temperature", "seed")}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class RequestBase(BaseModel):
    """Fields shared by both endpoints; the engine's options are added by ``with_engine_fields``."""
    model_config = ConfigDict(extra="forbid")
    model: Optional[str] = None
    max_tokens: Optional[int] = Field(None, ge=1)
    temperature: Optional[float] = Field(None, ge=0)
    seed: Optional[int] = None
    stop: Optional[str | list[str]] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    n: int = Field(1, ge=1, le=1, description="one choice per prompt")
    user: Optional[str] = None

    @field_validator("stop")
    @classmethod
    def check_stop(cls, value: str | list[str] | None) -> str | list[str] | None:
        stops = [value] if isinstance(value, str) else (value or [])
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        if len(stops) > 16:
            raise ValueError(f"at most 16 stop strings, got {len(stops)}")
        return value

    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def max_new_tokens(self) -> int | None:
        return self.max_tokens

    def sampling_overrides(self) -> dict:
        """The options this request set (an explicit null included), in SamplingParams names."""
        given = self.model_fields_set
        out = {name: getattr(self, name) for name in ENGINE_FIELDS if name in given}
        for name in ("temperature", "seed"):
            if name in given and getattr(self, name) is not None:
                out[name] = getattr(self, name)
        if self.max_new_tokens() is not None:
            out["max_new_tokens"] = self.max_new_tokens()
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

    @field_validator("prompt")
    @classmethod
    def check_prompt(cls, value):
        if isinstance(value, list) and not value:
            raise ValueError("prompt list is empty")
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
    role: Literal["system", "user", "assistant"]
    content: str | list[TextPart]
    name: Optional[str] = None

    def as_dict(self) -> dict:
        text = self.content if isinstance(self.content, str) else " ".join(p.text for p in self.content)
        return {"role": self.role, "content": text}


class ChatBase(RequestBase):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)

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
class ChoiceResult:
    """The final outcome of one prompt of a request."""
    index: int
    text: str
    finish_reason: str  # "stop" (stop token or stop string) | "length"
    prompt_tokens: int
    completion_tokens: int
    stats: SequenceStats = field(default_factory=SequenceStats)


def usage(results: list[ChoiceResult]) -> dict:
    """OpenAI usage plus the SPEC §1 stats, summed over the request's choices."""
    stats = SequenceStats.total([r.stats for r in results], 0.0)
    prompt = sum(r.prompt_tokens for r in results)
    completion = sum(r.completion_tokens for r in results)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion, "nfe": stats.nfe,
            "decoded_tokens": stats.decoded_tokens,
            "processed_tokens": round(stats.processed_tokens, 2),
            "prefill_tokens": stats.prefill_tokens, "redundancy": round(stats.redundancy, 4)}


def envelope(request_id: str, model: str, obj: str, created: int, choices: list[dict]) -> dict:
    return {"id": request_id, "object": obj, "created": created, "model": model, "choices": choices}


def completion_body(request_id: str, model: str, created: int, results: list[ChoiceResult]) -> dict:
    choices = [{"index": r.index, "text": r.text, "finish_reason": r.finish_reason, "logprobs": None}
               for r in results]
    return {**envelope(request_id, model, "text_completion", created, choices), "usage": usage(results)}


def chat_body(request_id: str, model: str, created: int, results: list[ChoiceResult]) -> dict:
    choices = [{"index": r.index, "message": {"role": "assistant", "content": r.text},
                "finish_reason": r.finish_reason, "logprobs": None} for r in results]
    return {**envelope(request_id, model, "chat.completion", created, choices), "usage": usage(results)}


def completion_chunk(request_id: str, model: str, created: int, index: int, text: str,
                     finish_reason: str | None) -> dict:
    choice = {"index": index, "text": text, "finish_reason": finish_reason, "logprobs": None}
    return envelope(request_id, model, "text_completion", created, [choice])


def chat_chunk(request_id: str, model: str, created: int, index: int, delta: dict,
               finish_reason: str | None) -> dict:
    choice = {"index": index, "delta": delta, "finish_reason": finish_reason, "logprobs": None}
    return envelope(request_id, model, "chat.completion.chunk", created, [choice])


def now() -> int:
    return int(time.time())
