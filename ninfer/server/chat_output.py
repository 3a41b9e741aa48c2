"""One chat request's output as protocol-neutral pieces: reasoning deltas, content deltas, and
tool calls (start, argument deltas, done). Every chat protocol's encoder consumes these; the
aggregate result is the same pieces joined.
"""
from __future__ import annotations

import uuid
from dataclasses import dataclass, field, replace
from typing import Any

from ninfer.engine.chat import Tool, ToolCall
from ninfer.engine.request import OutputEvent, Timings, TokenLogprob
from ninfer.server.toolcalls import CallDelta, Parser, ToolCallStream


@dataclass(slots=True)
class Piece:
    """kind: "reasoning" | "content" | "tool_start" | "tool_args" | "tool_done".
    tool_*: `index` is the call's position in the output, `call` the call so far (tool_done: whole)."""

    kind: str
    text: str = ""
    logprobs: tuple[TokenLogprob, ...] = ()  # content: the records published with this text
    index: int = 0
    call: ToolCall | None = None
    timings: Timings | None = None  # the engine event's timings (first piece of that event)


@dataclass(slots=True)
class ChatResult:
    """The whole output of a finished request."""

    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    final: OutputEvent | None = None

    @property
    def finish_reason(self) -> str:
        """stop | length | tool_calls | cancelled (the engine's reason, tool_calls when calls came)."""
        assert self.final is not None and self.final.finish_reason is not None
        if self.tool_calls and self.final.finish_reason == "stop":
            return "tool_calls"
        return self.final.finish_reason


class ChatOutput:
    """Turns a request's engine events into pieces and accumulates the result. With callable
    tools, content goes through the tool-call parser (toolcalls.py); a stream (`stream`) gets each
    XML-form call a parameter at a time. parallel_tool_calls false keeps the first call."""

    def __init__(self, tools: list[Tool] = (), parallel_tool_calls: bool = True, stream: bool = True) -> None:
        self.result = ChatResult()
        self._tools = {t.engine_name: t for t in tools}
        self._calls = ToolCallStream(Parser({n: t.parameters for n, t in self._tools.items()}), early=stream) \
            if tools else None
        self._parallel = parallel_tool_calls

    def feed(self, event: OutputEvent) -> list[Piece]:
        """The pieces one engine event releases (a final event also flushes what was held)."""
        r = self.result
        r.token_ids.extend(event.token_ids)
        final = event.finish_reason is not None
        pieces: list[Piece] = []
        if event.reasoning:
            r.reasoning += event.reasoning
            pieces.append(Piece("reasoning", event.reasoning))
        text, deltas = event.text, []
        if self._calls is not None and not self._calls.done and (text or final):
            text, deltas = self._calls.feed(text, final=final)
        if text or event.logprobs:
            r.content += text
            r.logprobs.extend(event.logprobs)
            pieces.append(Piece("content", text, logprobs=event.logprobs))
        for delta in deltas:
            if delta.index == 0 or self._parallel:
                pieces += self._call_pieces(delta)
        if final:
            r.final = event
        if pieces and event.timings is not None:
            pieces[0].timings = event.timings
        return pieces

    def log_fields(self) -> dict[str, Any]:
        """The request log's request_done.result fields of the output (tool_call_parse: null without
        callable tools)."""
        return {"tool_call_parse": self._calls.report if self._calls is not None else None}

    def _call_pieces(self, delta: CallDelta) -> list[Piece]:
        calls = self.result.tool_calls
        index = len(calls) - 1
        pieces = []
        if delta.index >= len(calls):  # a new call: its id and name
            tool = self._tools.get(delta.name)
            calls.append(ToolCall(id=f"call_{uuid.uuid4().hex[:24]}", name=tool.name if tool else delta.name,
                                  arguments="", namespace=tool.namespace if tool else None))
            index = len(calls) - 1
            pieces.append(Piece("tool_start", index=index, call=replace(calls[index])))
        call = calls[index]
        if delta.text:
            call.arguments += delta.text
            pieces.append(Piece("tool_args", delta.text, index=index, call=call))
        if delta.done:
            pieces.append(Piece("tool_done", index=index, call=call))
        return pieces


def piece_dict(piece: Piece) -> dict[str, Any]:
    """A piece as plain data (tests and logs)."""
    out: dict[str, Any] = {"kind": piece.kind}
    if piece.kind in ("reasoning", "content", "tool_args"):
        out["text"] = piece.text
    if piece.call is not None:
        out.update(index=piece.index, name=piece.call.name, arguments=piece.call.arguments)
    return out
