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

import asyncio
import base64
import json
from typing import Any

import orjson

from ninfer.engine.chat import Message, ToolCall
from ninfer.engine.request import OutputEvent, Usage
from ninfer.errors import RequestError
from ninfer.server.chat_output import ChatResult, Piece
from ninfer.server.chat_request import (ChatRequest, effort_kwargs, merge_template_kwargs, named_effort,
                                        parse_post_thinking)
from ninfer.server.chat_run import ChatEncoder, prepare, run_chat
from ninfer.server.errors import CLIENT_ERRORS, http_error
from ninfer.server.http import Call, anthropic_error_type
from ninfer.server.params import (bad, join_text_parts, message_role, opt_bool, opt_int, parse_stop, sampling_from,
                                  unsupported)
from ninfer.server.sse import KEEPALIVE
from ninfer.server.structured import anthropic_format
from ninfer.server.tools import anthropic_tool_choice, anthropic_tools, order_tool_results

ROLES = ("user", "assistant", "system")
MAX_STOP_SEQUENCES = 16
_SAMPLER_FIELDS = ("temperature", "top_p", "top_k")  # Anthropic's; OpenAI-only names are not read here
SIGNATURE_PREFIX = "ninfer-reasoning.v1:"
# content blocks that need a capability this server does not have: code, what is missing
_REFUSED_BLOCKS = {
    "image": ("vision_disabled", "image input needs a vision model; this server serves text only"),
    "document": ("documents_not_supported", "document blocks are not supported"),
    "search_result": ("search_results_not_supported", "search_result blocks are not supported"),
    "server_tool_use": ("tools_not_supported", "server tools are not supported: this server has no tool executor"),
    "web_search_tool_result": ("tools_not_supported", "server tool results are not supported"),
    "container_upload": ("container_not_supported", "container uploads are not supported"),
}


def _block(block: dict[str, Any], p: str) -> str:
    """A non-text content block inside text-only content: refused, naming what is missing."""
    kind = block.get("type")
    if not isinstance(kind, str) or not kind:
        raise bad(f"{p}.type", f"{p}.type must be a content block type such as \"text\"")
    if kind in _REFUSED_BLOCKS:
        code, why = _REFUSED_BLOCKS[kind]
        raise RequestError(f"{p}: {why}", param=p, code=code)
    if kind in ("thinking", "redacted_thinking", "tool_use", "tool_result"):
        raise RequestError(f"{p}: a {kind} block cannot appear here", param=f"{p}.type", code="invalid_value")
    raise RequestError(f"{p}: {kind} blocks are not supported by this server", param=f"{p}.type",
                       code="content_block_not_supported")


def _text(content: Any, where: str) -> str:
    """A string, or an array of text blocks joined (their cache_control and citations are hints)."""
    return join_text_parts(content, where, _block)


def signature(reasoning: str) -> str:
    """The compatibility signature of a thinking block: the reasoning itself, Base64 (not secret)."""
    return SIGNATURE_PREFIX + base64.b64encode(reasoning.encode()).decode()


def _thinking(block: dict[str, Any], p: str) -> str:
    """A replayed thinking block's reasoning; an empty one restores it from a NInfer signature."""
    text = block.get("thinking")
    if not isinstance(text, str):
        raise bad(f"{p}.thinking", f"{p}.thinking must be a string")
    sig = block.get("signature")
    if text or not isinstance(sig, str) or not sig.startswith(SIGNATURE_PREFIX):
        return text
    try:
        return base64.b64decode(sig[len(SIGNATURE_PREFIX):], validate=True).decode()
    except (ValueError, UnicodeDecodeError):
        raise RequestError(f"{p}.signature is not a valid {SIGNATURE_PREFIX} signature", param=f"{p}.signature",
                           code="invalid_thinking_signature") from None


def _tool_result(block: dict[str, Any], p: str) -> Message:
    call_id = block.get("tool_use_id")
    if not isinstance(call_id, str) or not call_id:
        raise bad(f"{p}.tool_use_id", f"{p}.tool_use_id must be a non-empty string")
    content = block.get("content", "")
    text = _text(content, f"{p}.content") if content is not None else ""
    is_error = block.get("is_error")
    if is_error is not None and not isinstance(is_error, bool):
        raise bad(f"{p}.is_error", f"{p}.is_error must be a boolean")
    return Message("tool", text, tool_call_id=call_id, is_error=bool(is_error))


def _turn(role: str, content: Any, where: str) -> list[Message]:
    """One message as turns: tool results (a user turn's leading tool_result blocks) become tool
    turns; an assistant's thinking, text and tool_use blocks one assistant turn."""
    if isinstance(content, str):
        return [Message(role, content)]
    if not isinstance(content, list):
        raise bad(where, f"{where} must be a string or an array of content blocks")
    out: list[Message] = []
    main = Message(role)
    for j, block in enumerate(content):
        p = f"{where}[{j}]"
        if not isinstance(block, dict):
            raise bad(p, f"{p} must be a content block object")
        kind = block.get("type")
        if kind == "tool_result" and role == "user":
            if main.content:
                raise RequestError(f"{p}: tool_result blocks must lead their user turn", param=p,
                                   code="invalid_tool_history")
            out.append(_tool_result(block, p))
        elif kind == "thinking" and role == "assistant":
            main.reasoning = (main.reasoning or "") + _thinking(block, p)
        elif kind == "redacted_thinking" and role == "assistant":
            continue  # opaque provider data: no local prompt representation
        elif kind == "tool_use" and role == "assistant":
            call_id, name, args = block.get("id"), block.get("name"), block.get("input", {})
            if not isinstance(call_id, str) or not call_id:
                raise bad(f"{p}.id", f"{p}.id must be a non-empty string")
            if not isinstance(name, str) or not name:
                raise bad(f"{p}.name", f"{p}.name must be a non-empty string")
            if not isinstance(args, dict):
                raise bad(f"{p}.input", f"{p}.input must be an object")
            main.tool_calls.append(ToolCall(call_id, name, json.dumps(args, ensure_ascii=False)))
        else:
            main.content += join_text_parts([block], where, lambda b, _: _block(b, p))
    if main.content or main.reasoning or main.tool_calls or not out:
        out.append(main)
    return out


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
        for turn in _turn(role, m["content"], f"{where}.content"):
            last = turns[-1] if turns else None
            if last is not None and turn.role in ("user", "assistant") and last.role == turn.role \
                    and not last.tool_calls and not (turn.reasoning and (last.content or last.reasoning)):
                last.content += turn.content  # consecutive user (or assistant) turns are one turn
                last.reasoning = last.reasoning or turn.reasoning
                last.tool_calls += turn.tool_calls
            else:
                if turn.role == "system" and last is not None and last.tool_calls:
                    raise RequestError(f"{where}: a system message cannot come between a tool_use and its "
                                       "tool_result", param=where, code="invalid_tool_history")
                turns.append(turn)
    prefill = None
    last = turns[-1]
    if last.role == "assistant" and not last.tool_calls and not last.reasoning:  # continued, not closed
        prefill = turns.pop().content
        if not any(t.role == "user" for t in turns):
            raise bad("messages", "an assistant prefill needs a user turn before it")
    return order_tool_results(turns, _check_results), prefill


def _check_results(order: list[str], ids: list[str | None], later: bool) -> None:
    """A tool_use turn that a later turn follows: its next user turn answers every call, once."""
    if later and sorted(ids) != sorted(order):
        raise RequestError("the user turn after a tool_use turn must lead with exactly one tool_result "
                           f"for each tool_use id ({', '.join(order)})", param="messages", code="invalid_tool_history")


def check_capabilities(body: dict[str, Any]) -> None:
    """Refuse fields that ask for what this server cannot do; neutral spellings pass."""
    output_config = body.get("output_config")
    if output_config is not None and not isinstance(output_config, dict):
        raise bad("output_config", "output_config must be an object")
    for name in ("mcp_servers", "container"):
        if body.get(name):
            raise unsupported(name, f"{name} is not supported: this server has no tool executor")


def thinking_config(body: dict[str, Any]) -> tuple[bool | None, int | None, bool]:
    """thinking: -> (enable_thinking or None for the default, budget_tokens, display omitted)."""
    thinking = body.get("thinking")
    if thinking is None:
        return None, None, False
    kind = thinking.get("type") if isinstance(thinking, dict) else None
    if kind not in ("disabled", "enabled", "adaptive"):
        raise bad("thinking.type", "thinking must be an object with type disabled, enabled or adaptive")
    display = thinking.get("display")
    if display not in (None, "summarized", "omitted"):
        raise bad("thinking.display", "thinking.display must be summarized or omitted")
    budget = None
    if kind == "enabled":
        budget = thinking.get("budget_tokens")
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1024:
            raise bad("thinking.budget_tokens", "thinking.budget_tokens must be an integer >= 1024")
    return kind != "disabled", budget, display == "omitted"


def decode_messages(call: Call, body: dict[str, Any], generate: bool = True) -> ChatRequest:
    """Validate a Messages body into the internal chat request. count_tokens (generate=False)
    ignores output_config.format and the output-only fields, as the spec says."""
    state = call.state
    model = body.get("model")
    if model is None:
        raise bad("model", "model is required", code="missing_required_parameter")
    if not isinstance(model, str) or not model:
        raise bad("model", "model must be a non-empty string")
    state.resolve_model(model)  # any label on a single-model server (echoed back); --strict-model-name checks it
    turns, prefill = conversation(body)
    check_capabilities(body)
    fmt = anthropic_format(body.get("output_config")) if generate else None
    if fmt is not None and prefill is not None:
        raise RequestError("an assistant prefill cannot be combined with output_config.format: the JSON value "
                           "starts the answer", param="messages", code="assistant_prefill_not_supported")
    enable, budget, omitted = thinking_config(body)
    kwargs = merge_template_kwargs(body.get("chat_template_kwargs"),
                                   {"enable_thinking": enable, "preserve_thinking": opt_bool(body, "preserve_thinking")})
    effort = (body.get("output_config") or {}).get("effort")
    named = named_effort(effort, kwargs)
    kwargs = effort_kwargs(effort, "output_config.effort", kwargs)
    tools = anthropic_tools(body)
    choice, parallel = anthropic_tool_choice(body, tools)
    chat = ChatRequest(protocol="anthropic", messages=turns, prefill=prefill, sampling=state.base_sampling,
                       template_kwargs=kwargs, requested_effort=named, response_format=fmt, tools=tools,
                       tool_choice=choice,
                       parallel_tool_calls=parallel, thinking_budget=budget, omit_reasoning=omitted)
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
                                  greedy=state.config.sampler.greedy, negative_temperature_greedy=False,
                                  max_temperature=1.0)
    chat.max_tokens, chat.stop = max_tokens, stop
    chat.return_progress = True  # the admission event, where a stream's message_start gets its exact usage
    chat.post_thinking = parse_post_thinking(body, max_temperature=1.0)
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
        with call.state.counting_tokens():  # rendering runs off the loop, so several run at once
            n = len((await asyncio.to_thread(prepare, call.state, chat, "count", False)).prompt_token_ids)
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
        self.reasoning = ""  # the thinking block's text so far (its signature carries it)

    def _message(self, content: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": f"msg_{self.req.request_id}", "type": "message", "role": "assistant", "model": self.model,
                "content": content, "stop_reason": None, "stop_sequence": None}

    def _thinking_block(self, reasoning: str) -> dict[str, Any]:
        return {"type": "thinking", "thinking": "" if self.chat.omit_reasoning else reasoning,
                "signature": signature(reasoning)}

    async def respond(self, result: ChatResult) -> None:
        reason, sequence = _stop_reason(self.call, result)
        content: list[dict[str, Any]] = []
        if result.reasoning:
            content.append(self._thinking_block(result.reasoning))
        if result.content or not (result.reasoning or result.tool_calls):
            content.append({"type": "text", "text": result.content})
        content += [{"type": "tool_use", "id": c.id, "name": c.name, "input": json.loads(c.arguments)}
                    for c in result.tool_calls]
        payload = self._message(content)
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
        if self.block == "thinking":
            await self._write("content_block_delta", {"type": "content_block_delta", "index": self.index,
                                                      "delta": {"type": "signature_delta",
                                                                "signature": signature(self.reasoning)}})
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
        if piece.kind == "reasoning":
            await self._open_block("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            self.reasoning += piece.text
            if piece.text and not self.chat.omit_reasoning:
                await self._write("content_block_delta", {"type": "content_block_delta", "index": self.index,
                                                          "delta": {"type": "thinking_delta", "thinking": piece.text}})
        elif piece.kind == "content":
            if not piece.text:
                return
            await self._open_block("text", {"type": "text", "text": ""})
            await self._write("content_block_delta", {"type": "content_block_delta", "index": self.index,
                                                      "delta": {"type": "text_delta", "text": piece.text}})
        elif piece.kind == "tool_start":
            await self._close_block()
            await self._open_block("tool_use", {"type": "tool_use", "id": piece.call.id, "name": piece.call.name,
                                                "input": {}})
        elif piece.kind == "tool_args":
            await self._write("content_block_delta", {"type": "content_block_delta", "index": self.index,
                                                      "delta": {"type": "input_json_delta", "partial_json": piece.text}})
        elif piece.kind == "tool_done":
            await self._close_block()

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
