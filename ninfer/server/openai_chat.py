"""POST /v1/chat/completions (and the rendering /apply-template shares): the Chat Completions
decoder (a body -> the internal ChatRequest, with field-specific 400s; options the engine cannot
honour are refused naming the field; unknown top-level fields are ignored) and its encoder
(chat.completion objects and chunks) over the one chat path (chat_run.py).
"""
from __future__ import annotations

import json
from typing import Any

from ninfer.engine.chat import Message, ToolCall
from ninfer.engine.request import OutputEvent
from ninfer.errors import RequestError
from ninfer.server.chat_output import ChatResult, Piece
from ninfer.server.chat_request import (ChatRequest, effort_kwargs, merge_template_kwargs, named_effort,
                                       parse_post_thinking, parse_thinking_budget)
from ninfer.server.chat_run import ChatEncoder, render_chat, run_chat
from ninfer.server.generate import logprob_records, prompt_progress, slot_extras, system_fingerprint, usage_dict
from ninfer.server.http import Call
from ninfer.server.params import (bad, check_id_slot, check_logit_bias, check_model, join_text_parts, message_role,
                                  opt_bool, opt_int, opt_object, parse_logprobs, parse_stop, reject_present,
                                  sampling_from, unsupported)
from ninfer.server.sse import DONE, KEEPALIVE, sse_data, sse_error
from ninfer.server.structured import refuse_with_grammar, request_format
from ninfer.server.tools import chat_tool_choice, chat_tools

ROLES = ("system", "developer", "user", "assistant", "tool", "function")
MAX_CHAT_STOPS = 4
# vLLM's constrained-decoding extensions (llama.cpp's grammar and json_schema are served: structured.py)
_CONSTRAINED = ("structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar")


def _chat_part(part: dict[str, Any], p: str) -> str:
    """A non-text content part: a refusal's text, or a refusal of the part."""
    kind = part.get("type")
    if kind == "refusal":
        text = part.get("refusal")
        if not isinstance(text, str):
            raise bad(f"{p}.refusal", f"{p}.refusal must be a string")
        return text
    if kind in ("image_url", "video_url", "input_image", "image"):
        raise RequestError(f"{p}: image and video input needs a vision model; this server "
                           "serves text only", param=p, code="vision_disabled")
    if kind in ("input_audio", "audio"):
        raise RequestError(f"{p}: audio input is not supported", param=p, code="audio_not_supported")
    if kind == "file":
        raise RequestError(f"{p}: file input is not supported", param=p, code="file_not_supported")
    raise bad(f"{p}.type", f"{p}.type {kind!r} is not a known content part type")


def _content_text(content: Any, where: str) -> str:
    """String content, or ordered text/refusal parts (bare strings too) joined without separators."""
    if content is None:
        return ""
    if isinstance(content, list):  # OpenAI-compatible clients also send bare strings as parts
        content = [{"type": "text", "text": c} if isinstance(c, str) else c for c in content]
    return join_text_parts(content, where, _chat_part)


def normalize_messages(value: Any) -> list[Message]:
    """Chat messages as conversation turns (developer turns are system turns)."""
    if not isinstance(value, list):
        raise bad("messages", "messages must be an array", code="invalid_type")
    if not value:
        raise bad("messages", "messages must not be empty")
    out = []
    for i, m in enumerate(value):
        where = f"messages[{i}]"
        role = message_role(m, where, ROLES)
        if "content" not in m and role != "assistant":
            raise bad(f"{where}.content", f"{where}.content is required for role {role}",
                      code="missing_required_parameter")
        if m.get("content") is None and role != "assistant":
            raise bad(f"{where}.content", f"{where}.content must be a string or an array of content parts")
        msg = Message("system" if role == "developer" else role, _content_text(m.get("content"), f"{where}.content"))
        name = m.get("name")
        if name is not None:
            if not isinstance(name, str):
                raise bad(f"{where}.name", f"{where}.name must be a string")
            if name and role not in ("tool", "function"):
                raise RequestError(f"{where}.name: participant names cannot be represented by the "
                                   "chat template", param=f"{where}.name", code="name_not_supported")
            if role == "function":
                msg.name = name
        if role == "assistant":
            msg.tool_calls = history_calls(m.get("tool_calls"), f"{where}.tool_calls")
            legacy = m.get("function_call")
            if legacy is not None:  # legacy function-call history: one call, no id
                msg.tool_calls += legacy_call(legacy, f"{where}.function_call")
            reasoning = m.get("reasoning_content", m.get("reasoning"))
            if isinstance(reasoning, str) and reasoning:
                msg.reasoning = reasoning
        if role in ("tool", "function"):
            msg.role = "tool"
            call_id = m.get("tool_call_id")
            if call_id is not None and not isinstance(call_id, str):
                raise bad(f"{where}.tool_call_id", f"{where}.tool_call_id must be a string")
            if call_id:
                msg.tool_call_id = call_id
        out.append(msg)
    return out


def function_call(fn: Any, where: str) -> ToolCall:
    """A {name, arguments} function call (arguments a JSON string, or an object) as a ToolCall."""
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise bad(f"{where}.name", f"{where}.name must be a non-empty string")
    args = fn.get("arguments", "{}")
    if isinstance(args, dict):
        args = json.dumps(args, ensure_ascii=False)
    if not isinstance(args, str):
        raise bad(f"{where}.arguments", f"{where}.arguments must be a JSON string")
    return ToolCall(id="", name=fn["name"], arguments=args)


def legacy_call(fn: Any, where: str) -> list[ToolCall]:
    """An assistant turn's legacy function_call {name, arguments} as its one tool call."""
    return [function_call(fn, where)]


def history_calls(calls: Any, where: str) -> list[ToolCall]:
    """An assistant turn's tool_calls: [{id, type: function, function: {name, arguments}}]."""
    if calls is None:
        return []
    if not isinstance(calls, list) or not all(isinstance(c, dict) for c in calls):
        raise bad(where, f"{where} must be an array of objects")
    out = []
    for j, c in enumerate(calls):
        if c.get("type") == "custom":  # a free-form call: its input is the function's one string
            spec = c.get("custom")
            if not isinstance(spec, dict) or not isinstance(spec.get("name"), str) or \
                    not isinstance(spec.get("input"), str):
                raise bad(f"{where}[{j}].custom", f"{where}[{j}].custom must have a name and an input string")
            out.append(ToolCall(id=c.get("id") or "", name=spec["name"],
                                arguments=json.dumps({"input": spec["input"]}, ensure_ascii=False)))
            continue
        tc = function_call(c.get("function"), f"{where}[{j}].function")
        call_id = c.get("id")
        if call_id is not None and not isinstance(call_id, str):
            raise bad(f"{where}[{j}].id", f"{where}[{j}].id must be a string")
        tc.id = call_id or ""
        out.append(tc)
    return out


def final_prefill(call: Call, body: dict[str, Any], messages: list[Message]) -> tuple[list[Message], str | None]:
    """A final assistant message continued in place (an assistant prefill, as on /v1/messages):
    with continue_final_message true (vLLM's switch) or the server's --assistant-prefill. Returns
    the turns the template renders and the prefill text (None: a new assistant turn follows)."""
    asked = opt_bool(body, "continue_final_message")
    if asked is False or (asked is None and not call.state.config.assistant_prefill):
        return messages, None
    last = messages[-1]
    if last.role != "assistant":
        if asked:
            raise bad("continue_final_message", "continue_final_message needs a final assistant message")
        return messages, None
    if last.tool_calls or last.reasoning:
        raise RequestError("an assistant prefill is text only: the final assistant message has tool calls or "
                           "reasoning", param=f"messages[{len(messages) - 1}]", code="assistant_prefill_not_supported")
    if len(messages) == 1:
        raise bad("messages", "an assistant prefill needs a turn before it")
    return messages[:-1], last.content


def requested_effort(body: dict[str, Any]) -> str | None:
    kwargs = body.get("chat_template_kwargs")
    return named_effort(body.get("reasoning_effort"), kwargs if isinstance(kwargs, dict) else {})


def template_kwargs(body: dict[str, Any]) -> dict[str, Any]:
    """chat_template_kwargs plus the typed top-level switches the templates read."""
    kwargs = merge_template_kwargs(opt_object(body, "chat_template_kwargs"),
                                   {name: opt_bool(body, name) for name in ("enable_thinking", "preserve_thinking")})
    return effort_kwargs(body.get("reasoning_effort"), "reasoning_effort", kwargs)


def check_capabilities(body: dict[str, Any]) -> None:
    """Refuse what the engine cannot do; accept the neutral spellings of the same fields."""
    n = opt_int(body, "n", lo=1)
    if n is not None and n != 1:
        raise unsupported("n", "n > 1 is not supported: one request produces one choice")
    check_logit_bias(body.get("logit_bias"))
    reject_present(body, ("audio",), "audio output is not available")
    modalities = body.get("modalities")
    if modalities is not None:
        if not isinstance(modalities, list) or not all(isinstance(m, str) for m in modalities):
            raise bad("modalities", "modalities must be an array of strings")
        if any(m != "text" for m in modalities):
            raise unsupported("modalities", "only text output is supported")
    reject_present(body, _CONSTRAINED, "these constrained-decoding extensions are not available; "
                                       "use response_format, json_schema or a GBNF grammar")
    reject_present(body, ("functions",), "legacy function calling is not supported")
    fcall = body.get("function_call")
    if fcall is not None and fcall not in ("none", "auto"):
        raise unsupported("function_call", "function_call is not supported")
    if body.get("store") is True:
        raise unsupported("store", "stored chat completions are not supported")
    reject_present(body, ("web_search_options",), "web search is not available")
    verbosity = body.get("verbosity")
    if verbosity is not None and verbosity != "medium":
        raise unsupported("verbosity", "only verbosity medium is supported")
    rp = body.get("repetition_penalty")
    if rp is not None and rp != 1:
        raise unsupported("repetition_penalty", "repetition_penalty is supported only at its neutral value 1")
    mm = body.get("mm_processor_kwargs")
    if mm is not None and (not isinstance(mm, dict) or any(v is not None for v in mm.values())):
        raise unsupported("mm_processor_kwargs", "mm_processor_kwargs must be empty: no media processor")


def decode_chat(call: Call, body: dict[str, Any]) -> ChatRequest:
    """Validate a Chat Completions body into the internal chat request."""
    state = call.state
    loaded = state.loaded
    assert loaded is not None
    check_model(body, state)
    messages, prefill = final_prefill(call, body, normalize_messages(body.get("messages")))
    check_capabilities(body)
    check_id_slot(body, loaded.engine.snapshot().max_private_continuations)
    max_tokens = opt_int(body, "max_completion_tokens", lo=-1)
    if max_tokens is None:
        max_tokens = opt_int(body, "max_tokens", lo=-1)
    if max_tokens == -1:
        max_tokens = None  # llama.cpp's "no limit": the derived default budget
    stop = parse_stop(body.get("stop"), MAX_CHAT_STOPS)
    ignore_eos = opt_bool(body, "ignore_eos") or False
    fmt = request_format(body)
    if fmt is not None and (state.grammars is not None):
        refuse_with_grammar(stop, ignore_eos, fmt)
    if fmt is not None and prefill is not None:
        raise RequestError(f"an assistant prefill cannot be combined with {fmt.param}: the constrained value "
                           "starts the answer", param="messages", code="assistant_prefill_not_supported")
    stream = opt_bool(body, "stream") or False
    stream_options = opt_object(body, "stream_options") or {}
    include_usage = stream_options.get("include_usage", False)
    if not isinstance(include_usage, bool):
        raise bad("stream_options.include_usage", "stream_options.include_usage must be a boolean")
    logprobs, top_logprobs = parse_logprobs(body)
    sampling = sampling_from(body, state.base_sampling, greedy=state.config.sampler.greedy,
                             logprobs=logprobs, top_logprobs=top_logprobs)
    tools = chat_tools(body)
    parallel = opt_bool(body, "parallel_tool_calls")
    chat = ChatRequest(protocol="chat", messages=messages, prefill=prefill, sampling=sampling,
                       template_kwargs=template_kwargs(body), requested_effort=requested_effort(body),
                       tools=tools, tool_choice=chat_tool_choice(body, tools), parallel_tool_calls=parallel is not False,
                       response_format=fmt, max_tokens=max_tokens, stop=stop, ignore_eos=ignore_eos, stream=stream,
                       return_progress=bool(opt_bool(body, "return_progress")),
                       timings_per_token=bool(opt_bool(body, "timings_per_token")),
                       include_usage=include_usage, logprobs=logprobs, top_logprobs=top_logprobs,
                       thinking_budget=parse_thinking_budget(body), post_thinking=parse_post_thinking(body))
    return chat


async def handle_apply_template(call: Call) -> None:
    """POST /apply-template: the prompt a chat body renders to, assistant opener included."""
    body = call.json()
    messages, prefill = final_prefill(call, body, normalize_messages(body.get("messages")))
    add_generation_prompt = opt_bool(body, "add_generation_prompt")
    tools = chat_tools(body)
    chat = ChatRequest(protocol="chat", messages=messages, prefill=prefill, sampling=call.state.base_sampling,
                       tools=tools, tool_choice=chat_tool_choice(body, tools), template_kwargs=template_kwargs(body))
    # a continued final message ends the prompt inside that turn, whatever add_generation_prompt says
    opener = prefill is not None or add_generation_prompt is not False
    await call.respond(200, {"prompt": render_chat(call.state, chat, add_generation_prompt=opener)[0].text})


async def handle_chat(call: Call) -> None:
    body = call.json()

    def decode(request_id: str) -> tuple[ChatRequest, ChatEncoder]:
        chat = decode_chat(call, body)
        return chat, ChatCompletionEncoder(call, chat)

    await run_chat(call, "chat", decode)


class ChatCompletionEncoder(ChatEncoder):
    """chat.completion objects and chat.completion.chunk SSE (role chunk first, [DONE] last)."""

    def __init__(self, call: Call, chat: ChatRequest) -> None:
        super().__init__(call, chat)
        self.tokenizer = call.state.loaded.tokenizer

    @property
    def _id(self) -> str:
        return f"chatcmpl-{self.req.request_id}"

    def _final_extras(self, result: ChatResult) -> dict[str, Any]:
        final = result.final
        extras: dict[str, Any] = {}
        if final.timings is not None:
            extras["timings"] = final.timings.to_dict()
        extras.update(slot_extras(final, list(self.req.prompt_token_ids) + result.token_ids))
        return extras

    def _custom(self, call: ToolCall) -> bool:
        return any(t.custom and t.name == call.name for t in self.chat.tools)

    def _call(self, call: ToolCall) -> dict[str, Any]:
        if self._custom(call):
            return {"id": call.id, "type": "custom", "custom": {"name": call.name, "input": _custom_input(call)}}
        return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}

    def _logprobs(self, records: Any) -> dict[str, Any] | None:
        if not self.chat.logprobs:
            return None
        return {"content": logprob_records(self.tokenizer, records, self.chat.top_logprobs), "refusal": None}

    async def respond(self, result: ChatResult) -> None:
        final = result.final
        assert final is not None
        message: dict[str, Any] = {"role": "assistant", "content": result.content, "refusal": None}
        if result.reasoning:
            message["reasoning_content"] = result.reasoning
        if result.tool_calls:
            message["content"] = result.content or None
            message["tool_calls"] = [self._call(c) for c in result.tool_calls]
        payload = {
            "id": self._id,
            "object": "chat.completion",
            "created": self.created,
            "model": self.call.state.model_id,
            "system_fingerprint": system_fingerprint(),
            "choices": [{"index": 0,
                         "message": message,
                         "logprobs": self._logprobs(result.logprobs),
                         "finish_reason": result.finish_reason}],
            "usage": usage_dict(final.usage),
            **self._final_extras(result),
        }
        await self.call.respond(200, payload)

    # ---- streaming ----

    def _base(self) -> dict[str, Any]:
        base = {"id": self._id, "object": "chat.completion.chunk", "created": self.created,
                "model": self.call.state.model_id, "system_fingerprint": system_fingerprint()}
        if self.chat.include_usage:
            base["usage"] = None
        return base

    def _chunk(self, delta: dict[str, Any], finish: str | None = None, logprobs: Any = None) -> bytes:
        return sse_data({**self._base(), "choices": [{"index": 0, "delta": delta, "logprobs": logprobs,
                                                      "finish_reason": finish}]})

    async def _open(self) -> None:
        if not self.call.started:
            await self.call.start_stream()
            await self.call.write(self._chunk({"role": "assistant", "content": None}))  # as OpenAI and llama-server

    async def keepalive(self) -> None:
        await self._open()
        await self.call.write(KEEPALIVE)

    async def progress(self, event: OutputEvent) -> None:
        await self._open()
        piece = prompt_progress(event, self.chat.timings_per_token)
        if piece is not None:
            await self.call.write(sse_data({**self._base(), "choices": [], **piece}))

    async def piece(self, piece: Piece) -> None:
        await self._open()
        if piece.kind == "reasoning":
            await self.call.write(self._chunk({"reasoning_content": piece.text}))
        elif piece.kind == "content":
            data = {**self._base(), "choices": [{"index": 0, "delta": {"content": piece.text},
                                                 "logprobs": self._logprobs(piece.logprobs), "finish_reason": None}]}
            if self.chat.timings_per_token and piece.timings is not None:
                data["timings"] = piece.timings.to_dict()
            await self.call.write(sse_data(data))
        elif piece.kind == "tool_start":
            call = piece.call
            if self._custom(call):
                start = {"index": piece.index, "id": call.id, "type": "custom", "custom": {"name": call.name, "input": ""}}
            else:
                start = {"index": piece.index, "id": call.id, "type": "function",
                         "function": {"name": call.name, "arguments": ""}}
            await self.call.write(self._chunk({"tool_calls": [start]}))
        elif piece.kind == "tool_args" and not self._custom(piece.call):
            delta = {"index": piece.index, "function": {"arguments": piece.text}}
            await self.call.write(self._chunk({"tool_calls": [delta]}))
        elif piece.kind == "tool_done" and self._custom(piece.call):  # a custom tool's input: one string, whole
            delta = {"index": piece.index, "custom": {"input": _custom_input(piece.call)}}
            await self.call.write(self._chunk({"tool_calls": [delta]}))

    async def finish(self, result: ChatResult) -> None:
        await self._open()
        final = result.final
        extras = self._final_extras(result)
        finish = {**self._base(), "choices": [{"index": 0, "delta": {}, "logprobs": None,
                                               "finish_reason": result.finish_reason}]}
        if self.chat.include_usage:
            await self.call.write(sse_data(finish))
            choices: list[Any] = []
            if self.call.state.config.usage_chunk_choice:
                choices = [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": None}]
            await self.call.write(sse_data({**self._base(), "choices": choices,
                                            "usage": usage_dict(final.usage), **extras}))
        else:
            await self.call.write(sse_data({**finish, **extras}))
        await self.call.write(DONE)

    async def fail(self, err: RequestError) -> None:
        await self.call.write(sse_error(err))


def _custom_input(call: ToolCall) -> str:
    """A custom tool's free-form input: the one string the model passed."""
    try:
        value = json.loads(call.arguments).get("input", "")
    except (ValueError, AttributeError):
        return call.arguments
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
