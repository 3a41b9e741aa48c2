"""One chat request's output as protocol-neutral pieces: reasoning deltas, content deltas, and
tool calls (start, argument deltas, done). Every chat protocol's encoder consumes these; the
aggregate result is the same pieces joined.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ninfer.engine.chat import ToolCall
from ninfer.engine.request import OutputEvent, Timings, TokenLogprob


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
    """Turns a request's engine events into pieces and accumulates the result."""

    def __init__(self) -> None:
        self.result = ChatResult()

    def feed(self, event: OutputEvent) -> list[Piece]:
        """The pieces one engine event releases (a final event also flushes what was held)."""
        r = self.result
        r.token_ids.extend(event.token_ids)
        pieces: list[Piece] = []
        if event.text or event.logprobs:
            r.content += event.text
            r.logprobs.extend(event.logprobs)
            pieces.append(Piece("content", event.text, logprobs=event.logprobs))
        if event.finish_reason is not None:
            r.final = event
        if pieces and event.timings is not None:
            pieces[0].timings = event.timings
        return pieces


def piece_dict(piece: Piece) -> dict[str, Any]:
    """A piece as plain data (tests and logs)."""
    out: dict[str, Any] = {"kind": piece.kind}
    if piece.kind in ("reasoning", "content", "tool_args"):
        out["text"] = piece.text
    if piece.call is not None:
        out.update(index=piece.index, name=piece.call.name, arguments=piece.call.arguments)
    return out
