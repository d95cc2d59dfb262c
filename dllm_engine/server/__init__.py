"""OpenAI-compatible serving: ``create_app(llm)`` for an ASGI app, ``run_server`` for ``dllm serve``."""
from __future__ import annotations

import threading

import uvicorn

from ..engine.llm import LLM
from ..sampling_params import SamplingParams
from .app import create_app
from .engine_client import EngineClient
from .limits import DEFAULT_MAX_REQUEST_BYTES
from .loop import EngineLoop

__all__ = ["create_app", "EngineLoop", "run_server", "shutdown_timeouts"]

REPLY_GRACE_S = 5.0  # uvicorn waits this much longer than the app, so cancelled requests get their 503


def shutdown_timeouts(shutdown_timeout: float) -> tuple[float, float]:
    """(the app's drain period, uvicorn's graceful timeout). The app's must end first: when it
    does, in-flight requests are answered 503; were uvicorn's first, it would cancel their
    handlers and the clients would see a 500 or a dropped connection instead."""
    return shutdown_timeout, shutdown_timeout + REPLY_GRACE_S


class DrainingServer(uvicorn.Server):
    """uvicorn, plus: the first SIGINT/SIGTERM starts the engine loop's drain at once (uvicorn
    runs the app's lifespan shutdown only after its own graceful wait)."""

    def __init__(self, config: uvicorn.Config, engine: EngineClient, drain_s: float) -> None:
        super().__init__(config)
        self.engine, self.drain_s = engine, drain_s

    def handle_exit(self, sig, frame) -> None:
        if not self.should_exit:
            threading.Thread(target=self.engine.shutdown, args=(self.drain_s,), daemon=True).start()
        super().handle_exit(sig, frame)


def run_server(llm: LLM, host: str = "127.0.0.1", port: int = 8000,
               defaults: SamplingParams | None = None, model_name: str | None = None,
               max_queue: int = 256, shutdown_timeout: float = 30.0, log_level: str = "info",
               api_key: str | None = None, max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES) -> None:
    """Serve until SIGINT/SIGTERM; then in-flight requests get ``shutdown_timeout`` s to finish
    and are answered 503 after it. New connections are refused from the signal on."""
    drain_s, graceful_s = shutdown_timeouts(shutdown_timeout)
    app = create_app(llm, defaults, model_name, max_queue, drain_s, api_key=api_key,
                     max_request_bytes=max_request_bytes)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                            timeout_graceful_shutdown=graceful_s)
    try:
        DrainingServer(config, app.state.server.engine, drain_s).run()
    except KeyboardInterrupt:  # uvicorn re-raises the SIGINT it handled (as uvicorn.run swallows it)
        pass
