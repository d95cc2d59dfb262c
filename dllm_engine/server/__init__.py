"""OpenAI-compatible serving: ``create_app(llm)`` for an ASGI app, ``run_server`` for ``dllm serve``."""
from __future__ import annotations

from ..engine.llm import LLM
from ..sampling_params import SamplingParams
from .app import create_app
from .loop import EngineLoop

__all__ = ["create_app", "EngineLoop", "run_server"]


def run_server(llm: LLM, host: str = "127.0.0.1", port: int = 8000,
               defaults: SamplingParams | None = None, model_name: str | None = None,
               max_queue: int = 256, shutdown_timeout: float = 30.0, log_level: str = "info") -> None:
    """Serve until SIGINT/SIGTERM; then in-flight requests get ``shutdown_timeout`` s to finish."""
    import uvicorn
    app = create_app(llm, defaults, model_name, max_queue, shutdown_timeout)
    uvicorn.run(app, host=host, port=port, log_level=log_level,
                timeout_graceful_shutdown=shutdown_timeout)
