"""One HTTP exchange over raw ASGI: the parsed request and the ways to answer it.

A handler receives a `Call`; it answers once with `respond`/`respond_error`, or streams with
`start_stream` + `write` (+ `end`). Errors raised as `RequestError` before the response starts
are turned into the protocol's envelope by the app.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Awaitable, Callable

import orjson

from ninfer.errors import RequestError

if TYPE_CHECKING:
    from ninfer.server.router import ModelPool
    from ninfer.server.state import ServerState

Send = Callable[[dict[str, Any]], Awaitable[None]]
Headers = list[tuple[bytes, bytes]]

JSON_TYPE = (b"content-type", b"application/json")


def openai_error_body(err: RequestError) -> bytes:
    return orjson.dumps({"error": {"message": err.message, "type": err.type,
                                   "param": err.param, "code": err.code, **err.extra}})


def anthropic_error_type(err: RequestError) -> str:
    """Anthropic's error category for an HTTP status."""
    return {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
            404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
            504: "timeout_error", 529: "overloaded_error"}.get(err.status, "api_error")


def anthropic_error_body(err: RequestError, request_id: str) -> bytes:
    return orjson.dumps({"type": "error", "error": {"type": anthropic_error_type(err), "message": err.message},
                         "request_id": request_id})


@dataclass(slots=True)
class Call:
    """A parsed request (path already normalized: /v1/v1/... -> /v1/...) and its response channel."""

    method: str
    path: str
    query: dict[str, str]
    headers: dict[str, str]  # lower-case names
    request_id: str
    state: ServerState | None  # the model this call runs on (None: a route that needs none, none loaded)
    send: Send
    base_headers: Headers  # version, request id, CORS: on every response of this call
    anthropic: bool = False  # answer errors in Anthropic's envelope
    body: bytes = b""
    started: bool = False
    finished: bool = False
    status: int = 0
    extra: dict[str, Any] = field(default_factory=dict)
    pool: ModelPool | None = None  # the server's models (the /models routes, the router)
    received_at: float = field(default_factory=time.monotonic)  # when the request arrived
    _parsed: dict[str, Any] | None = None

    def json(self) -> dict[str, Any]:
        """The body as a JSON object, or a 400 naming what is wrong with it (parsed once)."""
        if self._parsed is None:
            self._parsed = self._parse()
        return self._parsed

    def _parse(self) -> dict[str, Any]:
        if not self.body.strip():
            raise RequestError("the request body is empty; send a JSON object", code="invalid_json")
        try:
            value = orjson.loads(self.body)
        except orjson.JSONDecodeError as e:
            raise RequestError(f"the request body is not valid JSON: {e}", code="invalid_json") from None
        if not isinstance(value, dict):
            raise RequestError("the request body must be a JSON object", code="invalid_request")
        return value

    async def respond(self, status: int, payload: Any, headers: Headers = ()) -> None:
        """Send a complete JSON response."""
        body = payload if isinstance(payload, bytes) else orjson.dumps(payload)
        await self.respond_raw(status, body, [JSON_TYPE, *headers])

    async def respond_raw(self, status: int, body: bytes, headers: Headers) -> None:
        self.started = True
        self.status = status
        await self.send({"type": "http.response.start", "status": status,
                         "headers": [*self.base_headers, *headers,
                                     (b"content-length", str(len(body)).encode())]})
        await self.send({"type": "http.response.body", "body": body})
        self.finished = True

    async def respond_error(self, err: RequestError, headers: Headers = ()) -> None:
        if self.anthropic:
            body = anthropic_error_body(err, self.request_id)
        else:
            body = openai_error_body(err)
        await self.respond(err.status, body, headers)

    async def start_stream(self, content_type: bytes = b"text/event-stream") -> None:
        self.started = True
        self.status = 200
        await self.send({"type": "http.response.start", "status": 200,
                         "headers": [*self.base_headers, (b"content-type", content_type),
                                     (b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]})

    async def write(self, data: bytes) -> None:
        await self.send({"type": "http.response.body", "body": data, "more_body": True})

    async def end(self) -> None:
        if not self.finished:
            self.finished = True
            await self.send({"type": "http.response.body", "body": b"", "more_body": False})
