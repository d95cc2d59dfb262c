"""``dllm serve``: an OpenAI-compatible HTTP server over an ``EngineClient``: the engine
loop in this process, or Ray Serve replicas (``server.replicated``).

Routes: ``/v1/completions``, ``/v1/chat/completions`` (both with SSE streaming of committed text,
block by block), ``/v1/models``, ``/health``, ``/metrics`` (Prometheus)."""
from __future__ import annotations

import asyncio
import json
import secrets
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing, asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..engine.llm import LLM
from ..errors import UserError
from ..sampling_params import SamplingParams
from .engine_client import EngineClient, GenerateRequest, local_engine
from .limits import DEFAULT_MAX_REQUEST_BYTES, BodyLimit
from .loop import Event
from .metrics import Metrics
from .protocol import (ApiError, ChatCompletionRequest, CompletionRequest, TokenLogprob, chat_body,
                       chat_chunk, chat_logprobs, completion_body, completion_chunk,
                       completion_logprobs, now, usage, validation_error, value_error)

POLL_S = 0.1  # how often a waiting handler checks that its client is still connected


class ClientGone(Exception):
    """The client closed the connection before its answer was ready."""


def sse(payload: dict | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


class Server:
    """What the routes share: the LLM (tokenizer, config, validation), the engine client, default
    options and the HTTP side's metrics."""

    def __init__(self, llm: LLM, engine: EngineClient, defaults: SamplingParams, model_name: str,
                 metrics: Metrics, shutdown_timeout: float) -> None:
        self.llm, self.engine, self.defaults, self.model_name = llm, engine, defaults, model_name
        # a default the model cannot run would fail every request: refuse to start instead
        self.resolved = llm.resolve(defaults)
        self.metrics = metrics
        self.shutdown_timeout = shutdown_timeout
        self.created = now()

    # -- requests -> jobs --------------------------------------------------------------------
    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise ApiError(404, f"model {model!r} is not served here; use {self.model_name!r}",
                           "model", kind="not_found_error")

    def make_request(self, body, prompts: list[list[int]], request_id: str) -> GenerateRequest:
        """Validated here, before any engine sees the request (a bad option is a 400)."""
        if body.stop_strings() and self.llm.tokenizer is None:
            raise ApiError(400, "this model has no tokenizer, so stop strings cannot match; "
                           "use stop_token_ids", "stop")
        try:
            params = self.defaults.replace(**body.sampling_overrides())
            if params.seed is None:  # the LLM's stream: fresh unless the server was started with --seed
                params = params.replace(seed=self.llm.seeds.next())
            for ids in prompts:
                self.llm.resolve_for_prompt(params, len(ids))
        except UserError as e:
            raise value_error(e) from None
        return GenerateRequest(request_id, prompts, params, body.stop_strings(), body.stream, body.n)

    def encode(self, prompt: str | list[int]) -> list[int]:
        try:
            with self.engine.tokenizer_lock:
                return self.llm.encode(prompt)
        except UserError as e:
            raise value_error(e) from None

    def chat_prompt(self, body) -> list[int]:
        messages = body.conversation()  # a message without content: 400 before the template
        try:
            with self.engine.tokenizer_lock:
                ids = self.llm.apply_chat_template(messages)
            return self.llm.check_ids(ids)
        except UserError as e:
            raise value_error(e) from None

    # -- answers -----------------------------------------------------------------------------
    async def answer(self, request: Request, body, prompts: list[list[int]], chat: bool) -> Response:
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"  # unique across replicas
        start = time.perf_counter()
        events = self.events(self.make_request(body, prompts, rid), request)
        try:
            await anext(events)  # admitted, or the engine's 429 / 503 as this response's status
            if body.stream:
                include_usage = bool(body.stream_options and body.stream_options.include_usage)
                return StreamingResponse(self.stream(events, start, rid, chat, include_usage, len(prompts), body.n),
                                         media_type="text/event-stream")
            results = [ev.result async for ev in events if ev.result]
        except ClientGone:
            self.metrics.count_request("cancelled")
            return Response(status_code=499)
        finally:
            if not body.stream:
                await events.aclose()
        results.sort(key=lambda r: r.index)
        self.finished(start, 200)
        build = chat_body if chat else completion_body
        return JSONResponse(build(rid, self.model_name, now(), results, body.n))

    async def events(self, req: GenerateRequest, request: Request) -> AsyncIterator[Event]:
        """The engine's events for ``req``, ending with the last choice's result; raises an error
        event as ApiError, and ClientGone (cancelling the request) if the client goes away."""
        source = self.engine.generate(req)
        pending, getter = req.num_choices, None
        try:
            while pending:
                getter = getter or asyncio.ensure_future(anext(source))
                done, _ = await asyncio.wait({getter}, timeout=POLL_S)
                if not done:
                    if await request.is_disconnected():
                        raise ClientGone()
                    continue
                event, getter = getter.result(), None
                if event.error is not None:
                    raise event.error
                pending -= event.result is not None
                yield event
        finally:
            if getter is not None:
                getter.cancel()
                await asyncio.gather(getter, return_exceptions=True)
            await source.aclose()  # a request still running is cancelled

    async def stream(self, events: AsyncIterator[Event], start: float, rid: str, chat: bool,
                     include_usage: bool, num_prompts: int, n: int) -> AsyncIterator[str]:
        """SSE: committed text as blocks finish, a final chunk per choice, [DONE]."""
        created, results, status, first = now(), [], "cancelled", True

        streamed: dict[int, tuple[int, int]] = {}  # choice -> logprob tokens streamed, their chars

        def chunk(index: int, text: str, reason: str | None, role: bool = False,
                  logprobs: list[TokenLogprob] | None = None, steps: list[dict] | None = None) -> str:
            count, chars = streamed.get(index, (0, 0))
            streamed[index] = (count + len(logprobs or ()), chars + sum(len(t.token) for t in logprobs or ()))
            logprobs = logprobs or None  # a chunk that completes no token carries none
            if not chat:
                payload = completion_chunk(rid, self.model_name, created, index, text, reason,
                                           completion_logprobs(logprobs, chars))
            else:
                delta = ({"role": "assistant"} if role else {}) | ({"content": text} if text or role else {})
                payload = chat_chunk(rid, self.model_name, created, index, delta, reason, chat_logprobs(logprobs))
            if steps is not None:  # "record_steps": true: the trace rides on the choice's final chunk
                payload["choices"][0]["steps"] = steps
            return sse(payload)

        try:
            if chat:
                for i in range(num_prompts * n):
                    yield chunk(i, "", None, role=True)
            async with aclosing(events):
                async for event in events:
                    if event.text:
                        if first:
                            self.metrics.observe_first_chunk(time.perf_counter() - start)
                            first = False
                        yield chunk(event.index, event.text, None, logprobs=event.logprobs)
                    if event.result is not None:
                        results.append(event.result)
                        # logprobs came with the text they belong to; the final chunk has the rest
                        rest = event.result.logprobs
                        if rest is not None:
                            rest = rest[streamed.get(event.index, (0, 0))[0]:]
                        yield chunk(event.index, "", event.result.finish_reason, logprobs=rest,
                                    steps=event.result.steps)
            if include_usage:
                yield sse({"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                           "created": created, "model": self.model_name, "choices": [],
                           "usage": usage(results, n)})
            yield sse("[DONE]")
            status = 200
        except ApiError as e:
            status = e.status
            yield sse(e.body())
            yield sse("[DONE]")
        except ClientGone:
            pass
        finally:
            self.finished(start, status)

    def finished(self, start: float, status: int | str) -> None:
        self.metrics.count_request(status)
        self.metrics.observe_latency(time.perf_counter() - start)

    def models(self) -> dict:
        cfg = self.llm.model.config
        return {"object": "list", "data": [{
            "id": self.model_name, "object": "model", "created": self.created, "owned_by": "dllm-engine",
            "root": str(self.llm.path), "model_type": self.llm.model_type,
            "max_model_len": cfg.max_position_embeddings,
            "methods": list(self.llm.methods), "default_method": self.resolved.method,
            "defaults": self.resolved.describe(), "seed": self.llm.seeds.describe()}]}


def create_app(llm: LLM, defaults: SamplingParams | None = None, model_name: str | None = None,
               max_queue: int = 256, shutdown_timeout: float = 30.0,
               engine: EngineClient | None = None, api_key: str | None = None,
               max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES) -> FastAPI:
    """The FastAPI app serving ``llm``: on ``engine`` if given (``llm`` then only tokenizes and
    validates, and may live on the meta device), else on ``llm``'s own engine loop in this
    process (``max_queue`` waiting sequences). The engine starts and stops with the app's
    lifespan (``shutdown_timeout``: how long in-flight requests may finish before they are
    cancelled). ``api_key``: /v1/* requires ``Authorization: Bearer <api_key>``.
    ``max_request_bytes``: a larger body is refused with 413 before it is read whole (``limits``)."""
    metrics = Metrics()
    engine = engine or local_engine(llm, max_queue, metrics)  # a canvas model gets its own loop
    server = Server(llm, engine, defaults or SamplingParams(), model_name or llm.name, metrics,
                    shutdown_timeout)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        server.engine.start()
        yield
        await asyncio.to_thread(server.engine.shutdown, server.shutdown_timeout)

    app = FastAPI(title="dllm-engine", lifespan=lifespan)
    app.state.server = server
    add_error_handlers(app, server.metrics)
    if api_key:
        add_api_key_check(app, api_key, server.metrics)
    app.add_middleware(BodyLimit, max_bytes=max_request_bytes, metrics=server.metrics)
    add_routes(app, server)
    return app


def add_api_key_check(app: FastAPI, api_key: str, metrics: Metrics) -> None:
    app.add_middleware(ApiKeyCheck, expected=f"Bearer {api_key}".encode(), metrics=metrics)


class ApiKeyCheck:
    """/v1/* requires the key. A plain ASGI middleware: Starlette's ``@app.middleware`` wraps the
    request so that a handler no longer sees its client disconnect, and an abandoned
    non-streaming request would run to its end."""

    def __init__(self, app, expected: bytes, metrics: Metrics) -> None:
        self.app, self.expected, self.metrics = app, expected, metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1/"):
            given = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
            if not secrets.compare_digest(given, self.expected):
                self.metrics.count_request(401)
                err = ApiError(401, "missing or wrong API key: send the header `Authorization: "
                               "Bearer <key>` with the key the server was started with (--api-key)",
                               kind="authentication_error")
                await JSONResponse(err.body(), status_code=401)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def add_error_handlers(app: FastAPI, metrics: Metrics) -> None:
    def reply(err: ApiError) -> JSONResponse:
        metrics.count_request(err.status)
        headers = {"Retry-After": "1"} if err.status == 429 else None
        return JSONResponse(err.body(), status_code=err.status, headers=headers)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, err: ApiError) -> JSONResponse:
        return reply(err)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, err: RequestValidationError) -> JSONResponse:
        return reply(validation_error(list(err.errors())))

    @app.exception_handler(Exception)
    async def bug(request: Request, err: Exception) -> JSONResponse:
        """Anything but a user error (those are ApiError 400s) is a bug: a 500 in the OpenAI
        error format; Starlette raises it on after this reply, so the server logs its traceback."""
        return reply(ApiError(500, f"internal error: {type(err).__name__}: {err}", kind="server_error"))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, err: StarletteHTTPException) -> JSONResponse:
        """404 / 405 (and any other routing error) in the OpenAI error format."""
        route = f"{request.method} {request.url.path}"
        message = {404: f"no route {route}; the API is /v1/completions, /v1/chat/completions, "
                        f"/v1/models, /health, /metrics",
                   405: f"{route}: method not allowed here"}.get(err.status_code, f"{route}: {err.detail}")
        kind = "not_found_error" if err.status_code == 404 else "invalid_request_error"
        response = reply(ApiError(err.status_code, message, kind=kind))
        response.headers.update(err.headers or {})
        return response


def add_routes(app: FastAPI, server: Server) -> None:
    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        server.check_model(body.model)
        # off the event loop: a long prompt never holds up /health or other requests
        prompts = await asyncio.to_thread(lambda: [server.encode(p) for p in body.prompts()])
        return await server.answer(request, body, prompts, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        server.check_model(body.model)
        prompt = await asyncio.to_thread(server.chat_prompt, body)
        return await server.answer(request, body, [prompt], chat=True)

    @app.get("/v1/models")
    async def models() -> dict:
        return server.models()

    @app.get("/v1/models/{model:path}")
    async def model(model: str) -> dict:
        server.check_model(model)
        return server.models()["data"][0]

    @app.get("/health")
    async def health() -> JSONResponse:
        ok = await server.engine.is_healthy()
        return JSONResponse({"status": "ok" if ok else "unavailable"}, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        text = await server.engine.render_metrics(server.metrics)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")
