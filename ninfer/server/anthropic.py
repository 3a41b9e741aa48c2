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

from dataclasses import dataclass
from typing import Any

import orjson

from ninfer.engine.request import OutputEvent, PreparedRequest, Usage
from ninfer.errors import RequestError
from ninfer.server.errors import CLIENT_ERRORS, http_error
from ninfer.server.generate import Generation, new_request_id
from ninfer.server.http import Call, anthropic_error_type
from ninfer.server.openai_chat import template_kwargs
from ninfer.server.params import (bad, join_text_parts, message_role, opt_bool, opt_int, parse_stop, refuse_tools,
                                  sampling_from, unsupported)
from ninfer.server.sse import KEEPALIVE, TIMEOUT
from ninfer.server.structured import anthropic_format, constrain, with_instruction

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


def conversation(body: dict[str, Any]) -> tuple[list[dict[str, str]], str | None]:
    """The turns the chat template renders, and the assistant prefill (None without one)."""
    value = body.get("messages")
    if value is None:
        raise bad("messages", "messages is required", code="missing_required_parameter")
    if not isinstance(value, list):
        raise bad("messages", "messages must be an array")
    if not value:
        raise bad("messages", "messages must contain at least one message")
    turns: list[dict[str, str]] = []
    system = body.get("system")
    if system is not None:
        turns.append({"role": "system", "content": _text(system, "system")})
    for i, m in enumerate(value):
        where = f"messages[{i}]"
        role = message_role(m, where, ROLES)
        if "content" not in m:
            raise bad(f"{where}.content", f"{where}.content is required", code="missing_required_parameter")
        text = _text(m["content"], f"{where}.content")
        last = turns[-1] if turns else None
        if last is not None and role != "system" and last["role"] == role:
            last["content"] += text  # consecutive user (or assistant) turns are one turn
        else:
            turns.append({"role": role, "content": text})
    prefill = None
    if turns[-1]["role"] == "assistant":  # a final assistant turn is continued, not closed
        prefill = turns.pop()["content"]
        if not any(t["role"] == "user" for t in turns):
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


@dataclass(slots=True)
class MessagesRequest:
    req: PreparedRequest
    model: str  # the client's label, echoed back
    stream: bool


def _prompt_ids(call: Call, body: dict[str, Any], generate: bool = True) -> tuple[list[int], Any]:
    """Validate the conversation and render it to token ids; -> (ids, the output_config.format
    grammar or None). count_tokens (generate=False) ignores output_config.format, as the spec says."""
    model = body.get("model")
    if model is None:
        raise bad("model", "model is required", code="missing_required_parameter")
    if not isinstance(model, str) or not model:
        raise bad("model", "model must be a non-empty string")
    turns, prefill = conversation(body)
    check_capabilities(body)
    fmt = anthropic_format(body.get("output_config")) if generate else None
    grammar = constrain(call.state, fmt)
    if grammar is not None and prefill is not None:
        raise RequestError("an assistant prefill cannot be combined with output_config.format: the JSON value "
                           "starts the answer", param="messages", code="assistant_prefill_not_supported")
    tok = call.state.loaded.tokenizer
    kwargs = template_kwargs({"chat_template_kwargs": body.get("chat_template_kwargs")})
    prompt = tok.apply_chat_template(with_instruction(turns, fmt), add_generation_prompt=True, **kwargs)
    ids = tok.encode(prompt + (prefill or ""), add_special_tokens=False)
    if not ids:
        raise RequestError("the rendered prompt is empty", param="messages", code="invalid_prompt")
    return ids, grammar


def prepare_messages(call: Call, body: dict[str, Any], request_id: str) -> MessagesRequest:
    state = call.state
    ids, grammar = _prompt_ids(call, body)
    max_tokens = opt_int(body, "max_tokens")
    if max_tokens is not None and max_tokens < 1:
        raise bad("max_tokens", "max_tokens must be a positive integer (omit it for the default output limit)")
    stop = parse_stop(body.get("stop_sequences"), MAX_STOP_SEQUENCES, "stop_sequences")
    if grammar is not None and stop:
        raise RequestError("stop_sequences cannot be combined with output_config.format: the grammar ends the "
                           "output", param="stop_sequences", code="stop_not_supported")
    stream = opt_bool(body, "stream") or False
    sampling = sampling_from({k: body[k] for k in _SAMPLER_FIELDS if k in body}, state.base_sampling,
                             greedy=state.config.sampler.greedy, negative_temperature_greedy=False,
                             max_temperature=1.0)
    # return_progress: the admission event, where a stream's message_start gets its exact usage
    req = PreparedRequest(request_id=request_id, prompt_token_ids=ids, sampling=sampling, max_tokens=max_tokens,
                          stop=stop, grammar=grammar, hints={"protocol": "anthropic", "return_progress": stream})
    return MessagesRequest(req=req, model=body["model"], stream=stream)


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
    try:
        try:
            m = prepare_messages(call, body, new_request_id())
        except CLIENT_ERRORS as e:
            err = http_error(e)
            call.state.reject("anthropic", err)
            raise err
        async with Generation(call, m.req, m.stream) as gen:
            await (_stream(call, gen, m) if m.stream else _aggregate(call, gen, m))
    except CLIENT_ERRORS as e:
        raise _for_anthropic(http_error(e)) from None


async def handle_count_tokens(call: Call) -> None:
    """The prompt's token count as /v1/messages would render it; nothing is generated."""
    try:
        body = call.json()
        with call.state.counting_tokens():  # rendering runs off the loop, so several run at once
            n = len((await asyncio.to_thread(_prompt_ids, call, body, False))[0])
    except CLIENT_ERRORS as e:
        raise _for_anthropic(http_error(e)) from None
    await call.respond(200, {"input_tokens": n})


def _stop_reason(call: Call, event: OutputEvent) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a final event."""
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


def _message(gen: Generation, m: MessagesRequest, content: list[dict[str, Any]]) -> dict[str, Any]:
    return {"id": f"msg_{gen.req.request_id}", "type": "message", "role": "assistant", "model": m.model,
            "content": content, "stop_reason": None, "stop_sequence": None}


async def _aggregate(call: Call, gen: Generation, m: MessagesRequest) -> None:
    out = await gen.collect()
    assert out.final is not None
    reason, sequence = _stop_reason(call, out.final)
    payload = _message(gen, m, [{"type": "text", "text": out.text}])
    payload.update(stop_reason=reason, stop_sequence=sequence, usage=_usage(out.final.usage))
    await call.respond(200, payload)


def _event(name: str, data: dict[str, Any]) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"


PING = _event("ping", {"type": "ping"})


async def _stream(call: Call, gen: Generation, m: MessagesRequest) -> None:
    """message_start (at admission, with the exact cached/uncached split), one text block, then
    message_delta with the stop reason and cumulative usage, message_stop. A keep-alive comment
    is followed by a ping, which clients skip."""
    prompt_n = len(m.req.prompt_token_ids)
    started = False

    async def start(cached: int) -> None:
        nonlocal started
        started = True
        if not call.started:
            await call.start_stream()
        usage = _usage(Usage(prompt_n, 0, cached))
        await call.write(_event("message_start", {"type": "message_start",
                                                  "message": {**_message(gen, m, []), "usage": usage}}))
        await call.write(_event("content_block_start", {"type": "content_block_start", "index": 0,
                                                        "content_block": {"type": "text", "text": ""}}))

    try:
        async for event in gen.events(call.state.config.keepalive_seconds):
            if event is TIMEOUT:
                if not call.started:
                    await call.start_stream()
                await call.write(KEEPALIVE + PING)
                continue
            if not started:
                progress = event.progress
                await start(progress.cache if progress is not None else
                            (event.timings.cache_n if event.timings is not None else 0))
            if event.progress is not None:
                continue
            if event.text:
                await call.write(_event("content_block_delta", {
                    "type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": event.text}}))
            if event.finish_reason is not None:
                reason, sequence = _stop_reason(call, event)
                await call.write(_event("content_block_stop", {"type": "content_block_stop", "index": 0}))
                await call.write(_event("message_delta", {
                    "type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
                    "usage": _usage(event.usage)}))
                await call.write(_event("message_stop", {"type": "message_stop"}))
    except CLIENT_ERRORS as e:
        if not call.started:
            raise
        e = _for_anthropic(http_error(e))
        await call.write(_event("error", {"type": "error",
                                          "error": {"type": anthropic_error_type(e), "message": e.message}}))
    await call.end()
