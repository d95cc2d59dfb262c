"""What one request may cost the server before it is refused: its body's bytes
(``--max-request-bytes``). The prompt's length against the model's positions is checked by
``LLM.check_text_fits`` before a long text is tokenized whole, and tokenizing runs off the event
loop (``app.py``), so a large request never holds up ``/health`` or the other requests."""
from __future__ import annotations

from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse

from .metrics import Metrics
from .protocol import ApiError

DEFAULT_MAX_REQUEST_BYTES = 8 * 2**20  # a 32k-token prompt is well under 1 MB of JSON


def too_large(max_bytes: int) -> str:
    return (f"request body larger than {max_bytes:,} bytes (the server's --max-request-bytes); "
            f"send a shorter prompt")


class BodyLimit:
    """ASGI middleware: a request whose body exceeds ``max_bytes`` gets 413 without its body being
    read whole: at once when its ``Content-Length`` says so, else (a chunked body) as soon as the
    bytes received pass the limit, through the app's HTTP error handler."""

    def __init__(self, app, max_bytes: int, metrics: Metrics) -> None:
        self.app, self.max_bytes, self.metrics = app, max_bytes, metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = next((v for k, v in scope["headers"] if k == b"content-length"), None)
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            self.metrics.count_request(413)
            err = ApiError(413, too_large(self.max_bytes), kind="invalid_request_error")
            await JSONResponse(err.body(), status_code=413, headers={"Connection": "close"})(scope, receive, send)
            return
        received = 0

        async def limited_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise StarletteHTTPException(413, too_large(self.max_bytes))
            return message

        await self.app(scope, limited_receive, send)
