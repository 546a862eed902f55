"""What every HTTP request passes before a route sees it: the API key and the request-body limit.

Both are plain ASGI middleware. Starlette's `BaseHTTPMiddleware` (`@app.middleware("http")`) runs
the route in a task of its own and hands it a `receive` that never reports the client's
disconnect, so a non-streaming request whose client left would run to completion behind it.
These pass `receive` through (wrapped only to count body bytes), so `Request.is_disconnected`
keeps working.
"""

from __future__ import annotations

import secrets

from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pagedserve.server.errors import APIError, error_response

PROTECTED_PREFIXES = ("/v1", "/tokenize", "/detokenize")
"""Paths that need the API key when one is set; probes (/health, /version, /metrics) never do."""


class ApiKeyGuard:
    """Answers 401 to a request for a protected path without 'Authorization: Bearer KEY'."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and str(scope["path"]).startswith(PROTECTED_PREFIXES):
            given = dict(scope["headers"]).get(b"authorization", b"")
            # A constant-time comparison: the time taken must not reveal how much of a guess matched.
            if not secrets.compare_digest(given, self.expected):
                err = APIError(
                    401,
                    "invalid or missing API key: send 'Authorization: Bearer <key>'",
                    kind="authentication_error",
                )
                await error_response(err)(scope, receive, send)
                return
        await self.app(scope, receive, send)


class BodyLimit:
    """Answers 413 to a request whose body exceeds `max_bytes`: at once when its Content-Length
    says so, or as soon as a streamed (chunked) body passes the limit, before it is parsed."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    def _too_large(self, size: str) -> APIError:
        return APIError(
            413,
            f"the request body is {size}, over this server's limit of {self.max_bytes} bytes "
            "(--max-request-body-mb)",
            kind="invalid_request_error",
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            await error_response(self._too_large(f"{int(length)} bytes"))(scope, receive, send)
            return
        received = 0

        async def counted() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    # Raised while the route reads its body: FastAPI re-raises HTTP exceptions
                    # from body parsing, and the app's handler renders them in OpenAI's shape.
                    err = self._too_large(f"more than {received} bytes")
                    raise StarletteHTTPException(413, err.message)
            return message

        await self.app(scope, counted, send)
