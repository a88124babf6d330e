"""ASGI middleware around the routes: the API key, the request body's size cap, and internal errors answered as a
clean 500. Each answers with OpenAI's error body."""
from __future__ import annotations

import asyncio
import logging
import secrets

from fastapi.responses import JSONResponse
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException

from nanovllm.entrypoints.server.protocol import APIError

logger = logging.getLogger("nanovllm.server")

# Routes that answer without the API key: probes and scrapers (/version too, as in vLLM: it tells nothing private)
OPEN_PATHS = ("/health", "/metrics", "/version")


# Anthropic's error types for OpenAI's (the routes under ANTHROPIC_PATH answer with Anthropic's error body)
ANTHROPIC_PATH = "/v1/messages"
_ANTHROPIC_ERROR_TYPES = {"server_error": "api_error"}


def error_response(error: APIError, headers: dict | None = None, path: str = "") -> JSONResponse:
    """OpenAI's error body; Anthropic's ({"type": "error", "error": {"type", "message"}}) on its routes."""
    body = error.body
    if path.startswith(ANTHROPIC_PATH):
        kind = body["error"]["type"]
        if error.status_code == 413:
            kind = "request_too_large"
        body = {"type": "error", "error": {"type": _ANTHROPIC_ERROR_TYPES.get(kind, kind),
                                           "message": body["error"]["message"]}}
    return JSONResponse(body, status_code=error.status_code, headers=headers)


class APIKeyCheck:
    """Every route but OPEN_PATHS needs `Authorization: Bearer <api_key>` or `x-api-key: <api_key>` (Anthropic's
    clients send that one), the OpenAPI schema included. It answers before the body is read, so an unauthorized
    request gets 401 whatever it carries."""

    def __init__(self, app, api_key: str):
        self.app = app
        self.expected = api_key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            headers = Headers(scope=scope)
            scheme, _, token = headers.get("authorization", "").partition(" ")
            is_bearer = scheme.lower() == "bearer" and secrets.compare_digest(token.strip().encode(), self.expected)
            is_x_api_key = secrets.compare_digest(headers.get("x-api-key", "").strip().encode(), self.expected)
            if not (is_bearer or is_x_api_key):
                error = APIError(401, "missing or wrong API key: send 'Authorization: Bearer <key>' or "
                                      "'x-api-key: <key>'", type="authentication_error", code="invalid_api_key")
                return await error_response(error, path=scope["path"])(scope, receive, send)
        await self.app(scope, receive, send)


# A client that sends an over-cap body does not read the answer until it has sent it all; closing the connection on
# unread bytes resets it, and the client sees the reset instead of the 413 (and the openai client sends the body
# again, twice). So the rest of the body is read and dropped, up to these bounds, before the 413 goes out.
MAX_DRAIN_BYTES = 64 * 1024 * 1024
MAX_DRAIN_S = 10.0


class BodyTooLarge(StarletteHTTPException):
    """Raised from `receive` once a body without a Content-Length passes the cap (its rest read and dropped first,
    see MAX_DRAIN_BYTES); FastAPI lets an HTTPException raised while it reads the body through to the error
    handlers (any other exception would become a 400)."""

    def __init__(self, max_bytes: int):
        super().__init__(413, _too_large_message(max_bytes), headers={"Connection": "close"})


def _too_large_message(max_bytes: int) -> str:
    return f"the request body is larger than the server's cap of {max_bytes:,} bytes (--max-request-bytes)"


async def drain_body(receive, more_body: bool = True):
    """Read and drop the rest of a request body, up to MAX_DRAIN_BYTES and MAX_DRAIN_S: past those the connection is
    closed on what is left (the client may then see a reset)."""
    num_bytes = 0

    async def drain():
        nonlocal num_bytes, more_body
        while more_body and num_bytes <= MAX_DRAIN_BYTES:
            message = await receive()
            if message["type"] != "http.request":  # http.disconnect: the client is gone
                return
            num_bytes += len(message.get("body", b""))
            more_body = message.get("more_body", False)
    try:
        await asyncio.wait_for(drain(), MAX_DRAIN_S)
    except asyncio.TimeoutError:
        pass


class BodySizeLimit:
    """A request body over `max_bytes` gets 413: when its Content-Length says so, before the app sees it; else as
    soon as the bytes read pass the cap, so a huge body is never buffered whole. Either way the rest of the body is
    read and dropped first (drain_body), so the client, still sending, gets to read the 413; a client that sent
    `Expect: 100-continue` is answered at once and never sends the body. The 413 says `Connection: close`.
    (Starlette ships such a middleware only in its newest versions.)"""

    def __init__(self, app, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = Headers(scope=scope)
        length = headers.get("content-length", "")
        if length.isdigit() and int(length) > self.max_bytes:
            if headers.get("expect", "").lower() != "100-continue":
                await drain_body(receive)
            error = APIError(413, _too_large_message(self.max_bytes), code="request_too_large")
            return await error_response(error, {"Connection": "close"}, scope["path"])(scope, receive, send)
        num_bytes = 0

        async def receive_capped():
            nonlocal num_bytes
            message = await receive()
            num_bytes += len(message.get("body", b""))
            if num_bytes > self.max_bytes:
                await drain_body(receive, message.get("more_body", False))
                raise BodyTooLarge(self.max_bytes)
            return message
        await self.app(scope, receive_capped, send)


class InternalErrors:
    """An exception no handler took (a bug) is logged with its traceback and answered with a 500, and the
    connection stays usable. (Left to Starlette, the exception is raised again after the 500 is sent, and the
    server drops the keep-alive connection without saying so: the client's next request on it fails.) Once a
    response has started (a stream), the exception goes on up: the connection cannot be saved."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def send_tracked(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)
        try:
            await self.app(scope, receive, send_tracked)
        except Exception as e:
            if started:
                raise
            logger.exception("internal error answering %s %s", scope.get("method"), scope.get("path"))
            error = APIError(500, f"internal error: {e!r}", type="server_error")
            await error_response(error, path=scope["path"])(scope, receive, send)
