"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API over the engine.

Text conversations: top-level system text, user/assistant/system turns (consecutive user or
assistant turns joined without separators, each system turn kept at its position), a final
assistant text turn continued in place (assistant prefill), stop_sequences, temperature, top_p,
top_k, output_config.format (with --structured-output), aggregate responses and the Anthropic SSE
block lifecycle. What needs a capability this server lacks (images, documents, tools, thinking) is
refused naming the field.

Errors use Anthropic's envelope (request_id in the body, a request-id header: app.py); admission
overload answers 529 and a queue timeout 504, as the spec maps them for these endpoints.
"""
from __future__ import annotations

from typing import Any

import orjson

from ninfer.engine.chat import Message
from ninfer.engine.request import OutputEvent, Usage
from ninfer.errors import RequestError
from ninfer.server.chat_output import ChatResult, Piece
from ninfer.server.chat_request import ChatRequest, merge_template_kwargs
from ninfer.server.chat_run import ChatEncoder, prepare, run_chat
from ninfer.server.errors import CLIENT_ERRORS, http_error
from ninfer.server.http import Call, anthropic_error_type
from ninfer.server.params import (bad, join_text_parts, message_role, opt_bool, opt_int, parse_stop, refuse_tools,
                                  sampling_from, unsupported)
from ninfer.server.sse import KEEPALIVE
from ninfer.server.structured import anthropic_format

ROLES = ("user", "assistant", "system")
MAX_STOP_SEQUENCES = 16
_SAMPLER_FIELDS = ("temperature", "top_p", "top_k")  # Anthropic's; OpenAI-only names are not read here
# content blocks that need a capability this server does not have: code, what is missing
_REFUSED_BLOCKS = {
    "image": ("vision_disabled", "image input needs a vision model; this server serves text only"),
    "document": ("documents_not_supported", "document blocks are not supported"),
    "search_result": ("search_results_not_supported", "search_result blocks are not supported"),
    "thinking": ("thinking_not_supported", "thinking blocks are not supported: this model has no thinking mode"),
    "redacted_thinking": ("thinking_not_supported",
                          "redacted_thinking blocks are not supported: this model has no thinking mode"),
    "tool_use": ("tools_not_supported", "tool use is not supported by this server"),
    "tool_result": ("tools_not_supported", "tool use is not supported by this server"),
}


def _block(block: dict[str, Any], p: str) -> str:
    """A non-text content block: refused, naming what is missing."""
    kind = block.get("type")
    if not isinstance(kind, str) or not kind:
        raise bad(f"{p}.type", f"{p}.type must be a content block type such as \"text\"")
    if kind in _REFUSED_BLOCKS:
        code, why = _REFUSED_BLOCKS[kind]
        raise RequestError(f"{p}: {why}", param=p, code=code)
    raise RequestError(f"{p}: {kind} blocks are not supported by this server", param=f"{p}.type",
                       code="content_block_not_supported")


def _text(content: Any, where: str) -> str:
    """A string, or an array of text blocks joined (their cache_control and citations are hints)."""
    return join_text_parts(content, where, _block)


def conversation(body: dict[str, Any]) -> tuple[list[Message], str | None]:
    """The turns the chat template renders, and the assistant prefill (None without one)."""
    value = body.get("messages")
    if value is None:
        raise bad("messages", "messages is required", code="missing_required_parameter")
    if not isinstance(value, list):
        raise bad("messages", "messages must be an array")
    if not value:
        raise bad("messages", "messages must contain at least one message")
    turns: list[Message] = []
    system = body.get("system")
    if system is not None:
        turns.append(Message("system", _text(system, "system")))
    for i, m in enumerate(value):
        where = f"messages[{i}]"
        role = message_role(m, where, ROLES)
        if "content" not in m:
            raise bad(f"{where}.content", f"{where}.content is required", code="missing_required_parameter")
        text = _text(m["content"], f"{where}.content")
        last = turns[-1] if turns else None
        if last is not None and role != "system" and last.role == role:
            last.content += text  # consecutive user (or assistant) turns are one turn
        else:
            turns.append(Message(role, text))
    prefill = None
    if turns[-1].role == "assistant":  # a final assistant turn is continued, not closed
        prefill = turns.pop().content
        if not any(t.role == "user" for t in turns):
            raise bad("messages", "an assistant prefill needs a user turn before it")
    return turns, prefill


def check_capabilities(body: dict[str, Any]) -> None:
    """Refuse fields that ask for what this server cannot do; neutral spellings pass."""
    refuse_tools(body)
    choice = body.get("tool_choice")
    if choice is not None:
        kind = choice.get("type") if isinstance(choice, dict) else None
        if kind not in ("auto", "none", "any", "tool"):
            raise bad("tool_choice", "tool_choice must be an object with type auto, none, any or tool")
        if kind in ("any", "tool"):
            raise bad("tool_choice", f"tool_choice {kind} needs tools, and none are declared")
    thinking = body.get("thinking")
    if thinking is not None:
        kind = thinking.get("type") if isinstance(thinking, dict) else None
        if kind not in ("disabled", "enabled", "adaptive"):
            raise bad("thinking.type", "thinking must be an object with type disabled, enabled or adaptive")
        if kind != "disabled":
            raise RequestError(f"thinking {kind} is not supported: this model has no thinking mode",
                               param="thinking", code="thinking_not_supported")
    output_config = body.get("output_config")
    if output_config is not None and not isinstance(output_config, dict):
        raise bad("output_config", "output_config must be an object")
    for name in ("mcp_servers", "container"):
        if body.get(name):
            raise unsupported(name, f"{name} is not supported: this server has no tool executor")


def decode_messages(call: Call, body: dict[str, Any], generate: bool = True) -> ChatRequest:
    """Validate a Messages body into the internal chat request. count_tokens (generate=False)
    ignores output_config.format and the output-only fields, as the spec says."""
    state = call.state
    model = body.get("model")
    if model is None:
        raise bad("model", "model is required", code="missing_required_parameter")
    if not isinstance(model, str) or not model:
        raise bad("model", "model must be a non-empty string")
    turns, prefill = conversation(body)
    check_capabilities(body)
    fmt = anthropic_format(body.get("output_config")) if generate else None
    if fmt is not None and prefill is not None:
        raise RequestError("an assistant prefill cannot be combined with output_config.format: the JSON value "
                           "starts the answer", param="messages", code="assistant_prefill_not_supported")
    kwargs = merge_template_kwargs(body.get("chat_template_kwargs"), {})
    chat = ChatRequest(protocol="anthropic", messages=turns, prefill=prefill, sampling=state.base_sampling,
                       template_kwargs=kwargs, response_format=fmt)
    if not generate:
        return chat
    max_tokens = opt_int(body, "max_tokens")
    if max_tokens is not None and max_tokens < 1:
        raise bad("max_tokens", "max_tokens must be a positive integer (omit it for the default output limit)")
    stop = parse_stop(body.get("stop_sequences"), MAX_STOP_SEQUENCES, "stop_sequences")
    if fmt is not None and state.grammars is not None and stop:
        raise RequestError("stop_sequences cannot be combined with output_config.format: the grammar ends the "
                           "output", param="stop_sequences", code="stop_not_supported")
    chat.stream = opt_bool(body, "stream") or False
    chat.sampling = sampling_from({k: body[k] for k in _SAMPLER_FIELDS if k in body}, state.base_sampling,
                                  greedy=state.config.sampler.greedy, negative_temperature_greedy=False)
    chat.max_tokens, chat.stop = max_tokens, stop
    chat.return_progress = True  # the admission event, where a stream's message_start gets its exact usage
    return chat


def _for_anthropic(e: RequestError) -> RequestError:
    """Anthropic's envelope has no param field, so the message names it; admission overload is
    529 and a queue timeout 504 on these endpoints."""
    if e.param and e.param not in e.message:
        e.message = f"{e.param}: {e.message}"
    if e.status == 429:
        e.status, e.type = 529, "overloaded_error"
    elif e.code == "request_queue_timeout":
        e.status, e.type = 504, "timeout_error"
    return e


async def handle_messages(call: Call) -> None:
    body = call.json()

    def decode(request_id: str) -> tuple[ChatRequest, ChatEncoder]:
        chat = decode_messages(call, body)
        return chat, MessagesEncoder(call, chat, body["model"])

    try:
        await run_chat(call, "anthropic", decode)
    except CLIENT_ERRORS as e:
        raise _for_anthropic(http_error(e)) from None


async def handle_count_tokens(call: Call) -> None:
    """The prompt's token count as /v1/messages would render it; nothing is generated."""
    try:
        chat = decode_messages(call, call.json(), generate=False)
        n = len(prepare(call.state, chat, "count").prompt_token_ids)
    except CLIENT_ERRORS as e:
        raise _for_anthropic(http_error(e)) from None
    await call.respond(200, {"input_tokens": n})


def _stop_reason(call: Call, result: ChatResult) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a finished request."""
    event = result.final
    if result.finish_reason == "tool_calls":
        return "tool_use", None
    if event.finish_reason == "stop":
        if isinstance(event.stop_reason, str):
            return "stop_sequence", event.stop_reason
        return "end_turn", None
    if event.finish_reason == "length":
        u = event.usage
        if u is not None and u.prompt_tokens + u.completion_tokens >= call.state.loaded.max_context:
            return "model_context_window_exceeded", None
        return "max_tokens", None
    return "end_turn", None  # cancelled: the client is gone and reads nothing


def _usage(usage: Usage | None, output_tokens: int | None = None) -> dict[str, Any]:
    u = usage or Usage(0, 0, 0)
    return {"input_tokens": u.prompt_tokens - u.cached_tokens, "cache_creation_input_tokens": None,
            "cache_read_input_tokens": u.cached_tokens,
            "output_tokens": u.completion_tokens if output_tokens is None else output_tokens}


def _event(name: str, data: dict[str, Any]) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"


PING = _event("ping", {"type": "ping"})


class MessagesEncoder(ChatEncoder):
    """Message objects and the Anthropic SSE block lifecycle: message_start (at admission, with the
    exact cached/uncached split), content blocks (start, deltas, stop), message_delta with the
    stop reason and cumulative usage, message_stop. A keep-alive comment is followed by a ping,
    which clients skip."""

    def __init__(self, call: Call, chat: ChatRequest, model: str) -> None:
        super().__init__(call, chat)
        self.model = model  # the client's label, echoed back
        self.started = False  # message_start sent
        self.block: str | None = None  # the open content block's kind
        self.index = -1  # the open block's index

    def _message(self, content: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": f"msg_{self.req.request_id}", "type": "message", "role": "assistant", "model": self.model,
                "content": content, "stop_reason": None, "stop_sequence": None}

    async def respond(self, result: ChatResult) -> None:
        reason, sequence = _stop_reason(self.call, result)
        payload = self._message([{"type": "text", "text": result.content}])
        payload.update(stop_reason=reason, stop_sequence=sequence, usage=_usage(result.final.usage))
        await self.call.respond(200, payload)

    async def _start(self, cached: int) -> None:
        if self.started:
            return
        self.started = True
        if not self.call.started:
            await self.call.start_stream()
        usage = _usage(Usage(len(self.req.prompt_token_ids), 0, cached))
        await self._write("message_start", {"type": "message_start", "message": {**self._message([]), "usage": usage}})

    async def _write(self, name: str, data: dict[str, Any]) -> None:
        await self.call.write(_event(name, data))

    async def _open_block(self, kind: str, block: dict[str, Any]) -> None:
        if self.block == kind:
            return
        await self._close_block()
        self.index += 1
        self.block = kind
        await self._write("content_block_start", {"type": "content_block_start", "index": self.index,
                                                  "content_block": block})

    async def _close_block(self) -> None:
        if self.block is not None:
            await self._write("content_block_stop", {"type": "content_block_stop", "index": self.index})
            self.block = None

    async def keepalive(self) -> None:
        if not self.call.started:
            await self.call.start_stream()
        await self.call.write(KEEPALIVE + PING)

    async def progress(self, event: OutputEvent) -> None:
        await self._start(event.progress.cache)

    async def piece(self, piece: Piece) -> None:
        await self._start(piece.timings.cache_n if piece.timings is not None else 0)
        if piece.kind == "content":
            await self._open_block("text", {"type": "text", "text": ""})
            if piece.text:
                await self._write("content_block_delta", {"type": "content_block_delta", "index": self.index,
                                                          "delta": {"type": "text_delta", "text": piece.text}})

    async def finish(self, result: ChatResult) -> None:
        final = result.final
        await self._start(final.timings.cache_n if final.timings is not None else 0)
        if self.index < 0:  # no content at all: one empty text block, as the API always has one
            await self._open_block("text", {"type": "text", "text": ""})
        await self._close_block()
        reason, sequence = _stop_reason(self.call, result)
        await self._write("message_delta", {"type": "message_delta",
                                            "delta": {"stop_reason": reason, "stop_sequence": sequence},
                                            "usage": _usage(final.usage)})
        await self._write("message_stop", {"type": "message_stop"})

    async def fail(self, err: RequestError) -> None:
        e = _for_anthropic(err)
        await self._write("error", {"type": "error", "error": {"type": anthropic_error_type(e), "message": e.message}})
