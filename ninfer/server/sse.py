"""Server-sent events and the pump that hands one request's engine events to the asyncio loop.

The engine calls `EventPump.sink` on its worker thread; the event is queued on the loop thread
(call_soon_threadsafe), where `next(timeout)` returns it, waiting with a plain timer when none is
queued, so a keep-alive timeout never disturbs the request. `close()` cancels an unfinished one.
"""
from __future__ import annotations

import asyncio
from collections import deque
from typing import TYPE_CHECKING, Any

import orjson

from ninfer.engine.request import OutputEvent
from ninfer.errors import RequestError

if TYPE_CHECKING:
    from ninfer.engine.engine import Engine

KEEPALIVE = b": keep-alive\n\n"
DONE = b"data: [DONE]\n\n"


class Timeout:
    """Marker: no event within the timeout."""


TIMEOUT = Timeout()


def sse_error(e: RequestError) -> bytes:
    """An error after the stream started: one data event in the OpenAI error envelope."""
    return sse_data({"error": {"message": e.message, "type": e.type, "param": e.param, "code": e.code}})


def sse_data(payload: Any) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


class EventPump:
    """The events of one request submitted with `sink`, read on the loop that made the pump."""

    def __init__(self, engine: Engine, request_id: str) -> None:
        self._engine = engine
        self._request_id = request_id
        self._loop = asyncio.get_running_loop()
        self._events: deque[OutputEvent] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self.done = False  # the final event was read, or the pump was closed

    def sink(self, event: OutputEvent) -> None:
        """The engine's callback (its worker thread): queue the event on the loop."""
        try:
            self._loop.call_soon_threadsafe(self._push, event)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            self._engine.cancel(self._request_id)

    def _push(self, event: OutputEvent) -> None:
        self._events.append(event)
        _wake(self._waiter)

    async def next(self, timeout: float | None) -> OutputEvent | Timeout | None:
        """The next event, TIMEOUT when none came in `timeout` s, None after the final event."""
        if self.done:
            return None
        if not self._events:
            waiter = self._waiter = self._loop.create_future()
            timer = None if timeout is None else self._loop.call_later(timeout, _wake, waiter)
            try:
                await waiter
            finally:
                self._waiter = None
                if timer is not None:
                    timer.cancel()
            if not self._events:
                return TIMEOUT
        event = self._events.popleft()
        if event.finish_reason is not None:
            self.done = True
        return event

    def close(self) -> None:
        """Stop reading: an unfinished request is cancelled (the engine frees its lane)."""
        if not self.done:
            self.done = True
            self._engine.cancel(self._request_id)


def _wake(waiter: asyncio.Future[None] | None) -> None:
    if waiter is not None and not waiter.done():
        waiter.set_result(None)
