"""The one chat path: a decoded `ChatRequest` is rendered once, submitted, and its events run
through one generation loop into protocol-neutral pieces (chat_output.py), which the protocol's
`ChatEncoder` writes as chunks, events or one final object.

    decoder (protocol) -> ChatRequest -> prepare (render, grammar) -> PreparedRequest
        -> Generation (engine events) -> ChatOutput (pieces) -> ChatEncoder (protocol)
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from ninfer.engine.chat import render
from ninfer.engine.request import OutputEvent, PreparedRequest
from ninfer.errors import RequestError
from ninfer.server.chat_output import ChatOutput, ChatResult, Piece
from ninfer.server.chat_request import ChatRequest
from ninfer.server.errors import CLIENT_ERRORS, http_error
from ninfer.server.generate import Generation, new_request_id
from ninfer.server.http import Call
from ninfer.server.sse import TIMEOUT
from ninfer.server.state import ServerState
from ninfer.server.structured import constrain, with_instruction


def prepare(state: ServerState, chat: ChatRequest, request_id: str) -> PreparedRequest:
    """Render the conversation and build what the engine runs. Raises client errors."""
    loaded = state.loaded
    assert loaded is not None
    grammar = constrain(state, chat.response_format)
    rendered = render(loaded.tokenizer, with_instruction(chat.messages, chat.response_format), tools=chat.tools,
                      kwargs=chat.template_kwargs, prefill=chat.prefill)
    if not rendered.ids:
        raise RequestError("the rendered prompt is empty", param="messages", code="invalid_prompt")
    # timings_per_token and return_progress shape a stream only: the engine does the work only then
    hints: dict[str, Any] = {"protocol": chat.protocol, "timings_per_token": chat.stream and chat.timings_per_token,
                             "return_progress": chat.stream and chat.return_progress}
    return PreparedRequest(request_id=request_id, prompt_token_ids=rendered.ids, sampling=chat.sampling,
                           max_tokens=chat.max_tokens, stop=list(chat.stop), ignore_eos=chat.ignore_eos,
                           grammar=grammar, hints=hints)


class ChatEncoder:
    """A protocol's output side. The loop calls `respond` once (aggregate) or, streaming,
    `keepalive`/`progress`/`piece` as things happen, then `finish` or `fail`. `open` is the
    encoder's to call: a protocol decides which event starts its stream."""

    def __init__(self, call: Call, chat: ChatRequest) -> None:
        self.call = call
        self.chat = chat
        self.req: PreparedRequest | None = None  # set once prepared
        self.created = 0

    async def respond(self, result: ChatResult) -> None:
        raise NotImplementedError

    async def keepalive(self) -> None:
        raise NotImplementedError

    async def progress(self, event: OutputEvent) -> None:
        """A prompt-progress event (only when the request asked for them)."""

    async def piece(self, piece: Piece) -> None:
        raise NotImplementedError

    async def finish(self, result: ChatResult) -> None:
        raise NotImplementedError

    async def fail(self, err: RequestError) -> None:
        """An error after the stream started, in the protocol's own stream envelope."""
        raise NotImplementedError


Decode = Callable[[str], tuple[ChatRequest, ChatEncoder]]


async def run_chat(call: Call, protocol: str, decode: Decode) -> None:
    """Decode (given the request id), prepare, generate, encode: every chat protocol's handler.
    Errors before generation count as rejections of `protocol` and propagate to the envelope."""
    state = call.state
    request_id = new_request_id()
    try:
        chat, encoder = decode(request_id)
        req = await asyncio.to_thread(prepare, state, chat, request_id)
    except CLIENT_ERRORS as e:
        err = http_error(e)
        state.reject(protocol, err)
        raise err
    encoder.req = req
    out = ChatOutput()
    async with Generation(call, req, chat.stream) as gen:
        encoder.created = gen.created
        if not chat.stream:
            async for event in gen.events(None):
                assert isinstance(event, OutputEvent)
                out.feed(event)
            await encoder.respond(out.result)
            return
        try:
            async for event in gen.events(state.config.keepalive_seconds):
                if event is TIMEOUT:
                    await encoder.keepalive()
                    continue
                assert isinstance(event, OutputEvent)
                if event.progress is not None:
                    await encoder.progress(event)
                    continue
                for piece in out.feed(event):
                    await encoder.piece(piece)
                if event.finish_reason is not None:
                    await encoder.finish(out.result)
        except CLIENT_ERRORS as e:
            if not call.started:
                raise
            await encoder.fail(http_error(e))
        await call.end()
