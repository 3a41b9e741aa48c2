"""The ASGI application: routing, readiness, auth, CORS, body limit, request ids, version header.

A plain ASGI callable (no framework). Each HTTP request runs its handler in a task beside a
watcher of `receive()`: a client that disconnects gets its handler cancelled, which closes the
request's event pump and so cancels the request and frees its lane.
"""
from __future__ import annotations

import asyncio
import hmac
import logging
import re
import uuid
from typing import Any, Awaitable, Callable
from urllib.parse import parse_qsl

from ninfer.errors import RequestError
from ninfer.server import (anthropic, embeddings, infill, llamacpp, models_api, openai_chat, openai_completions,
                           openapi, ops, rerank, responses, slots)
from ninfer.server.errors import CLIENT_ERRORS, http_error
from ninfer.server.http import Call, Headers
from ninfer.server.router import ModelPool
from ninfer.version import version_string

log = logging.getLogger("ninfer.server")
Handler = Callable[[Call], Awaitable[None]]

LOADING_MESSAGE = "The model is still loading. Retry shortly."
CORS_ALLOW_HEADERS = "authorization, content-type, x-api-key, x-request-id, anthropic-version, anthropic-beta"
CORS_ALLOW_METHODS = b"GET, POST, DELETE, OPTIONS"

# (method, path) -> handler; the /v1/v1/... doubling is folded before the lookup
ROUTES: dict[tuple[str, str], Handler] = {
    ("GET", "/health"): ops.handle_health,
    ("GET", "/openapi.json"): openapi.handle_openapi,
    ("GET", "/v1"): ops.handle_index,
    ("GET", "/v1/models"): ops.handle_models,
    ("GET", "/props"): ops.handle_props,
    ("GET", "/v1/load"): ops.handle_load,
    ("GET", "/stats"): ops.handle_stats,
    ("GET", "/metrics"): ops.handle_metrics,
    ("GET", "/slots"): ops.handle_slots,
    ("POST", "/v1/chat/completions"): openai_chat.handle_chat,
    ("POST", "/chat/completions"): openai_chat.handle_chat,  # llama-server's un-prefixed alias
    ("POST", "/v1/completions"): openai_completions.handle_completions,
    ("POST", "/completion"): llamacpp.handle_completion,
    ("POST", "/completions"): llamacpp.handle_completion,
    ("POST", "/infill"): infill.handle_infill,
    ("POST", "/v1/embeddings"): embeddings.handle_embeddings,
    ("POST", "/embeddings"): embeddings.handle_embeddings,
    ("POST", "/v1/rerank"): rerank.handle_rerank,
    ("POST", "/rerank"): rerank.handle_rerank,
    ("POST", "/v1/reranking"): rerank.handle_rerank,
    ("POST", "/reranking"): rerank.handle_rerank,
    ("POST", "/tokenize"): llamacpp.handle_tokenize,
    ("POST", "/detokenize"): llamacpp.handle_detokenize,
    ("POST", "/apply-template"): openai_chat.handle_apply_template,
    ("POST", "/v1/messages"): anthropic.handle_messages,
    ("POST", "/v1/messages/count_tokens"): anthropic.handle_count_tokens,
    ("POST", "/v1/responses"): responses.handle_create,
    ("POST", "/responses"): responses.handle_create,  # llama-server's un-prefixed alias
    ("POST", "/v1/responses/input_tokens"): responses.handle_input_tokens,
    ("POST", "/v1/responses/compact"): responses.handle_compact,
    ("GET", "/models"): models_api.handle_list,
    ("POST", "/models/load"): models_api.handle_load,
    ("POST", "/models/unload"): models_api.handle_unload,
    ("POST", "/models/sleep"): models_api.handle_sleep,
    ("GET", "/models/sse"): models_api.handle_sse,
}
# How a route finds its model. USE (and POST /slots/{id}): it runs on the model its body's `model`
# (or ?model=) names, loaded or woken first when allowed, and counts as use. PEEK: it reads the named (or most recently used)
# loaded model without loading or waking it. Every other route needs no model.
USE_ROUTES = {
    ("POST", "/v1/chat/completions"), ("POST", "/v1/completions"), ("POST", "/completion"),
    ("POST", "/completions"), ("POST", "/tokenize"), ("POST", "/detokenize"), ("POST", "/apply-template"),
    ("POST", "/v1/messages"), ("POST", "/v1/messages/count_tokens"), ("POST", "/v1/responses"),
    ("POST", "/v1/responses/input_tokens"), ("POST", "/v1/responses/compact"),
    # llama-server's un-prefixed aliases and the routes issue 11 added
    ("POST", "/chat/completions"), ("POST", "/responses"), ("POST", "/infill"), ("POST", "/v1/embeddings"),
    ("POST", "/embeddings"), ("POST", "/v1/rerank"), ("POST", "/rerank"), ("POST", "/v1/reranking"),
    ("POST", "/reranking"),
}
HOST_ROUTES = {("POST", "/tokenize"), ("POST", "/detokenize"), ("POST", "/apply-template")}  # never wake a model
PEEK_ROUTES = {("GET", "/props"), ("GET", "/v1/load"), ("GET", "/stats"), ("GET", "/metrics"), ("GET", "/slots")}
# routes that need no request body (GET) on the stats port
STATS_ROUTES = {("GET", "/health"), ("GET", "/stats"), ("GET", "/v1/load"), ("GET", "/metrics")}
_MODEL_PATH = re.compile(r"^/v1/models/(.+)$")
_MODEL_ACTION = re.compile(r"^/v1/models/([^/]+)/(suspend|resume|residency)$")
_MODEL_ACTION_METHODS = {"suspend": "POST", "resume": "POST", "residency": "GET"}
_SLOT_PATH = re.compile(r"^/slots/([^/]+)$")  # POST /slots/{id}?action=save|restore|erase
# /v1/responses/{id}[/input_items|/cancel] -> the methods each answers
_RESPONSE_PATH = re.compile(r"^/v1/responses/([^/]+)(?:/(input_items|cancel))?$")
_RESPONSE_METHODS = {None: ("GET", "DELETE"), "input_items": ("GET",), "cancel": ("POST",)}
# protocols this server does not implement: answered in their own envelope, never faked
_NOT_SUPPORTED = {
    "/v1/messages/batches": "Message Batches are not supported by this server; send each request to /v1/messages",
}


def normalize_path(path: str) -> str:
    """/v1/v1/... answers as /v1/... (clients given the /v1 base that append /v1 themselves)."""
    if path == "/v1/v1" or path.startswith("/v1/v1/"):
        path = path[3:]
    if len(path) > 1 and path.endswith("/"):
        path = path.rstrip("/") or "/"
    return path


def cors_allowed(cors: bool, origins: tuple[str, ...], origin: str | None) -> bool:
    """Whether a request gets CORS headers: --cors on, and its Origin in --cors-origin when that
    lists any (a request without an Origin is not a cross-origin browser request)."""
    if not cors:
        return False
    return not origins or origin is None or origin.rstrip("/") in origins


def _not_supported_route(path: str) -> str | None:
    for prefix, message in _NOT_SUPPORTED.items():
        if path == prefix or path.startswith(prefix + "/"):
            return message
    return None


def requested_model(call: Call) -> str | None:
    """The model a request names: its body's `model` (POST), else the `model` query parameter."""
    if call.method == "POST" and call.body.strip():  # a slot erase may have no body: ?model= names it
        model = call.json().get("model")
        if model is not None and not isinstance(model, str):
            raise RequestError("model must be a string", param="model", code="invalid_value")
        if model:
            return model
    return call.query.get("model") or None


def _autoload(call: Call) -> bool | None:
    """?autoload=0|1 overrides --models-autoload for one request (None: the server's default)."""
    value = call.query.get("autoload")
    if value is None:
        return None
    if value not in ("0", "1", "true", "false"):
        raise RequestError("autoload must be 0 or 1", param="autoload", code="invalid_value")
    return value in ("1", "true")


def _close_if_body_unread(call: Call) -> Headers:
    """`connection: close` on an answer sent before the request's body was read (no route, no key,
    413, still loading): the HTTP layer then closes the connection rather than skip unread bytes,
    and a client must hear it, or the next request it sends on that connection is lost."""
    if call.extra.get("body_read"):
        return []
    length = call.headers.get("content-length", "").strip()
    if "transfer-encoding" in call.headers or (length and length != "0"):
        return [(b"connection", b"close")]
    return []


class ClientGone(Exception):
    """The client disconnected before the request was read."""


class App:
    """The ASGI callable over the server's models. `stats_only` serves only /health, /stats, /v1/load
    and /metrics."""

    def __init__(self, pool: ModelPool, *, stats_only: bool = False) -> None:
        self.pool = pool
        self.stats_only = stats_only
        self._version = version_string().encode()

    async def __call__(self, scope: dict[str, Any], receive: Callable, send: Callable) -> None:
        kind = scope["type"]
        if kind == "lifespan":
            await self._lifespan(receive, send)
        elif kind == "http":
            await self._http(scope, receive, send)

    async def _lifespan(self, receive: Callable, send: Callable) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _http(self, scope: dict[str, Any], receive: Callable, send: Callable) -> None:
        cfg = self.pool.config
        method = scope["method"].upper()
        if method == "HEAD":  # a GET whose body the HTTP layer drops (headers and length kept)
            method = "GET"
        path = normalize_path(scope["path"])
        headers: dict[str, str] = {}
        for k, v in scope["headers"]:
            headers[k.decode("latin-1").lower()] = v.decode("latin-1")
        is_anthropic = path == "/v1/messages" or path.startswith("/v1/messages/")
        request_id = ("req_" if is_anthropic else "") + uuid.uuid4().hex
        base: Headers = [(b"x-ninfer-version", self._version),
                         (b"request-id" if is_anthropic else b"x-request-id", request_id.encode())]
        cors = cors_allowed(cfg.cors, cfg.cors_origins, headers.get("origin"))
        if cors:
            base += [(b"access-control-allow-origin", headers.get("origin", "*").encode("latin-1")),
                     (b"access-control-expose-headers", b"x-request-id, request-id, x-ninfer-version"),
                     (b"vary", b"origin")]
            if headers.get("origin"):
                base.append((b"access-control-allow-credentials", b"true"))
        query = dict(parse_qsl(scope.get("query_string", b"").decode("latin-1")))
        call = Call(method=method, path=path, query=query, headers=headers, request_id=request_id,
                    state=None, send=send, base_headers=base, anthropic=is_anthropic, pool=self.pool)
        call.extra["cors"] = cors
        try:
            await self._dispatch(call, receive)
        except CLIENT_ERRORS as e:
            if not call.started:
                err = http_error(e)
                retry = [(b"retry-after", b"2")] if err.code == "model_loading" else []
                await call.respond_error(err, retry + _close_if_body_unread(call))
            else:
                await call.end()
        except ClientGone:
            return
        except Exception:  # noqa: BLE001 - an unexpected failure answers 500, never a dropped socket
            log.exception("unhandled error on %s %s", method, path)
            if not call.started:
                await call.respond_error(RequestError("internal server error", status=500,
                                                      code="internal_error", type="server_error"),
                                         _close_if_body_unread(call))
            else:
                await call.end()

    async def _dispatch(self, call: Call, receive: Callable) -> None:
        if not self.pool.ready:
            raise RequestError(LOADING_MESSAGE, status=503, code="model_loading", type="service_unavailable")
        if call.method == "OPTIONS":
            await self._preflight(call)
            return
        if call.path != "/health":
            self._authenticate(call)
        handler = self._route(call)
        call.body = await self._read_body(call, receive)
        await self._run(call, self._bind(call, handler), receive)

    def _bind(self, call: Call, handler: Handler) -> Handler:
        """The handler with its model bound to the call (see USE_ROUTES)."""
        pool = self.pool
        key = (call.method, call.path)
        if key in PEEK_ROUTES:
            call.state = pool.peek(call.query.get("model"))
            return handler
        if key not in USE_ROUTES and "slot_id" not in call.extra:  # POST /slots/{id} uses its model
            call.state = pool.default_state()
            return handler

        async def bound(call: Call) -> None:
            slot = pool.resolve(requested_model(call) if pool.router else None)
            call.state = await pool.acquire(slot, _autoload(call), wake=key not in HOST_ROUTES)
            try:
                await handler(call)
            finally:
                pool.release(slot)

        return bound

    async def _preflight(self, call: Call) -> None:
        """200 (as llama-server answers) with the allowed methods and headers under --cors; an
        origin outside --cors-origin gets 403, so the browser's refusal has a reason on the wire."""
        cfg = self.pool.config
        if cfg.cors and not call.extra["cors"]:
            raise RequestError(f"origin {call.headers.get('origin')!r} is not allowed (--cors-origin)",
                               status=403, code="cors_origin_not_allowed", type="permission_error")
        headers: Headers = []
        if cfg.cors:
            requested = call.headers.get("access-control-request-headers", "")
            allow = CORS_ALLOW_HEADERS + (", " + requested if requested else "")
            headers = [(b"access-control-allow-methods", CORS_ALLOW_METHODS),
                       (b"access-control-allow-headers", allow.encode("latin-1")),
                       (b"access-control-max-age", b"86400")]
        await call.respond_raw(200, b"", headers)

    def _authenticate(self, call: Call) -> None:
        """The key as an OpenAI bearer token or an Anthropic x-api-key header: either one that
        matches admits the request (a stale Authorization does not override a right x-api-key).
        Compared in constant time, every offered value, so timing tells nothing about the key."""
        key = self.pool.config.api_key
        if key is None:
            return
        expected = key.encode()
        offered = []
        if "x-api-key" in call.headers:
            offered.append(call.headers["x-api-key"].strip())
        auth = call.headers.get("authorization", "")
        if auth[:7].lower() == "bearer ":
            offered.append(auth[7:].strip())
        matched = False
        for given in offered:
            matched |= hmac.compare_digest(given.encode("latin-1"), expected)
        if not matched:
            raise RequestError("Invalid API key: send it as Authorization: Bearer <key> or x-api-key",
                               status=401, code="invalid_api_key", type="authentication_error")

    def _route(self, call: Call) -> Handler:
        path, method = call.path, call.method
        if self.stats_only and (method, path) not in STATS_ROUTES:
            raise RequestError(f"{path} is not served on the stats port", status=404, code="not_found")
        message = _not_supported_route(path)
        if message is not None:
            raise RequestError(message, status=404 if method != "POST" else 400, code="endpoint_not_supported",
                               type="invalid_request_error")
        handler = ROUTES.get((method, path))
        if handler is not None:
            return handler
        a = _MODEL_ACTION.match(path)
        if a and method == _MODEL_ACTION_METHODS[a.group(2)]:
            call.extra["model_id"], call.extra["action"] = a.group(1), a.group(2)
            return models_api.handle_model_action
        m = _MODEL_PATH.match(path)
        if a is None and m and method == "GET":
            call.extra["model_id"] = m.group(1)
            return ops.handle_model
        r = _RESPONSE_PATH.match(path)
        if r and method in _RESPONSE_METHODS[r.group(2)]:
            call.extra["response_id"], call.extra["action"] = r.group(1), r.group(2)
            return responses.handle_resource
        s = _SLOT_PATH.match(path)
        if s and method == "POST":
            call.extra["slot_id"] = s.group(1)
            return slots.handle_slot_action
        if any(p == path for _, p in ROUTES) or a or m or r or s:
            raise RequestError(f"method {method} is not allowed on {path}", status=405,
                               code="method_not_allowed")
        raise RequestError(f"no route for {method} {path}", status=404, code="not_found")

    async def _read_body(self, call: Call, receive: Callable) -> bytes:
        """The whole body, or 413 request_too_large as soon as it passes --max-request-mib."""
        limit = self.pool.config.max_request_bytes
        declared = call.headers.get("content-length")
        too_large = RequestError(f"the request body exceeds --max-request-mib "
                                 f"({self.pool.config.max_request_mib} MiB)", status=413,
                                 code="request_too_large")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise too_large
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise ClientGone()
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise too_large
            chunks.append(chunk)
            if not message.get("more_body", False):
                call.extra["body_read"] = True
                return b"".join(chunks)

    async def _run(self, call: Call, handler: Handler, receive: Callable) -> None:
        """Run the handler; cancel it when the client disconnects first."""
        task = asyncio.ensure_future(handler(call))

        async def watch() -> None:
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    return

        watcher = asyncio.ensure_future(watch())
        try:
            await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not task.done():
                task.cancel()
                try:
                    await task
                except BaseException:  # noqa: BLE001 - the client is gone; nothing to answer
                    pass
            watcher.cancel()
        if not task.cancelled():
            task.result()  # re-raise a handler error for the envelope
