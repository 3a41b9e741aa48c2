"""Server-sent events and the pump that reads engine events with a keep-alive deadline.

`EventPump.next(timeout)` keeps one pending `__anext__` task across timeouts, so waiting for
a keep-alive interval never cancels the engine stream; `aclose()` cancels it (the engine then
cancels the request).
"""
from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator

import orjson

from ninfer.engine.request import OutputEvent
from ninfer.errors import RequestError

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
    """Reads `OutputEvent`s from an engine async iterator, with timeouts that keep the read alive."""

    def __init__(self, events: AsyncIterator[OutputEvent]) -> None:
        self._events = events
        self._pending: asyncio.Future[OutputEvent] | None = None
        self.done = False

    async def next(self, timeout: float | None) -> OutputEvent | Timeout | None:
        """The next event, TIMEOUT when none came in `timeout` s, None at the end of the stream.

        Raises whatever the engine raised (RequestError at submission, for instance).
        """
        if self.done:
            return None
        if self._pending is None:
            self._pending = asyncio.ensure_future(self._events.__anext__())
        done, _ = await asyncio.wait({self._pending}, timeout=timeout)
        if not done:
            return TIMEOUT
        task, self._pending = self._pending, None
        try:
            event = task.result()
        except StopAsyncIteration:
            self.done = True
            return None
        if event.finish_reason is not None:
            self.done = True
        return event

    async def aclose(self) -> None:
        """Stop reading: cancel a pending read and close the engine stream (cancels the request)."""
        self.done = True
        if self._pending is not None:
            self._pending.cancel()
            try:
                await self._pending
            except BaseException:  # noqa: BLE001 - the read is abandoned on purpose
                pass
            self._pending = None
        aclose = getattr(self._events, "aclose", None)
        if aclose is not None:
            try:
                await aclose()
            except RuntimeError:  # closing a generator that is mid-`__anext__` elsewhere
                pass
