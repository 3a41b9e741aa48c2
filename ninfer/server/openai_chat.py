"""POST /v1/chat/completions (and the rendering /apply-template shares).

Validation turns a body into a PreparedRequest with field-specific 400s; options the engine
cannot honour are refused naming the field; unknown top-level fields are ignored.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ninfer.engine.request import OutputEvent, PreparedRequest
from ninfer.errors import RequestError
from ninfer.server.errors import CLIENT_ERRORS, http_error
from ninfer.server.generate import (Generation, logprob_records, new_request_id, prompt_progress,
                                    slot_extras, usage_dict)
from ninfer.server.http import Call
from ninfer.server.params import (bad, check_id_slot, check_logit_bias, check_model, join_text_parts, message_role,
                                  opt_bool, opt_int, opt_object, parse_logprobs, parse_stop, refuse_tools,
                                  reject_present, sampling_from, unsupported)
from ninfer.server.sse import DONE, KEEPALIVE, TIMEOUT, sse_data, sse_error
from ninfer.server.structured import chat_format, constrain, refuse_with_grammar, with_instruction

ROLES = ("system", "developer", "user", "assistant", "tool", "function")
MAX_CHAT_STOPS = 4
_CONSTRAINED = ("grammar", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
                "guided_grammar")
# template kwargs a request may not override: the template's inputs and the tokenizer's tokens
_RESERVED_KWARGS = ("messages", "tools", "documents", "add_generation_prompt", "bos_token", "eos_token")


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


def normalize_messages(value: Any) -> list[dict[str, Any]]:
    """Messages as the chat template expects them: role and string content (+ tool-call history)."""
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
        msg: dict[str, Any] = {"role": "system" if role == "developer" else role,
                               "content": _content_text(m.get("content"), f"{where}.content")}
        name = m.get("name")
        if name is not None:
            if not isinstance(name, str):
                raise bad(f"{where}.name", f"{where}.name must be a string")
            if name and role not in ("tool", "function"):
                raise RequestError(f"{where}.name: participant names cannot be represented by the "
                                   "chat template", param=f"{where}.name", code="name_not_supported")
            if role == "function":
                msg["name"] = name
        if role == "assistant":
            calls = m.get("tool_calls")
            if calls is not None:
                if not isinstance(calls, list) or not all(isinstance(c, dict) for c in calls):
                    raise bad(f"{where}.tool_calls", f"{where}.tool_calls must be an array of objects")
                if calls:
                    msg["tool_calls"] = calls
            reasoning = m.get("reasoning_content", m.get("reasoning"))
            if isinstance(reasoning, str) and reasoning:
                msg["reasoning_content"] = reasoning
        if role == "tool":
            call_id = m.get("tool_call_id")
            if call_id is not None and not isinstance(call_id, str):
                raise bad(f"{where}.tool_call_id", f"{where}.tool_call_id must be a string")
            if call_id:
                msg["tool_call_id"] = call_id
        out.append(msg)
    return out


def template_kwargs(body: dict[str, Any]) -> dict[str, Any]:
    """chat_template_kwargs plus the typed top-level switches the templates read."""
    kwargs = dict(opt_object(body, "chat_template_kwargs") or {})
    for key in kwargs:
        if key in _RESERVED_KWARGS:
            raise bad(f"chat_template_kwargs.{key}", f"chat_template_kwargs cannot override {key}")
    for name in ("enable_thinking", "preserve_thinking"):
        value = opt_bool(body, name)
        if value is not None:
            if name in kwargs and kwargs[name] is not None and kwargs[name] != value:
                raise bad(name, f"{name} disagrees with chat_template_kwargs.{name}")
            kwargs[name] = value
    effort = body.get("reasoning_effort")
    if effort is not None:
        if effort not in ("none", "minimal", "low", "medium", "high", "xhigh", "max", "default", "auto"):
            raise bad("reasoning_effort", "reasoning_effort must be one of none, minimal, low, medium, "
                                          "high, xhigh, max")
        if effort == "none":
            kwargs.setdefault("enable_thinking", False)
        elif effort not in ("default", "auto"):
            kwargs["reasoning_effort"] = effort
    return {k: v for k, v in kwargs.items() if v is not None}


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
                                       "structured JSON is requested through response_format")
    refuse_tools(body)
    choice = body.get("tool_choice")
    if choice is not None and choice not in ("none", "auto"):
        raise unsupported("tool_choice", "tool_choice can only be none or auto: no tools are available")
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


@dataclass(slots=True)
class ChatOptions:
    stream: bool
    include_usage: bool
    timings_per_token: bool
    return_progress: bool
    logprobs: bool
    top_logprobs: int


def prepare_chat(call: Call, body: dict[str, Any], request_id: str) -> tuple[PreparedRequest, ChatOptions]:
    """Validate a Chat Completions body and render its prompt."""
    state = call.state
    loaded = state.loaded
    assert loaded is not None
    check_model(body, state)
    messages = normalize_messages(body.get("messages"))
    check_capabilities(body)
    check_id_slot(body, loaded.engine.snapshot().max_private_continuations)
    max_tokens = opt_int(body, "max_completion_tokens", lo=-1)
    if max_tokens is None:
        max_tokens = opt_int(body, "max_tokens", lo=-1)
    if max_tokens == -1:
        max_tokens = None  # llama.cpp's "no limit": the derived default budget
    stop = parse_stop(body.get("stop"), MAX_CHAT_STOPS)
    ignore_eos = opt_bool(body, "ignore_eos") or False
    fmt = chat_format(body)
    grammar = constrain(state, fmt)
    if grammar is not None:
        refuse_with_grammar(stop, ignore_eos, fmt)
    stream = opt_bool(body, "stream") or False
    stream_options = opt_object(body, "stream_options") or {}
    include_usage = stream_options.get("include_usage", False)
    if not isinstance(include_usage, bool):
        raise bad("stream_options.include_usage", "stream_options.include_usage must be a boolean")
    logprobs, top_logprobs = parse_logprobs(body)
    sampling = sampling_from(body, state.base_sampling, greedy=state.config.sampler.greedy,
                             logprobs=logprobs, top_logprobs=top_logprobs)
    options = ChatOptions(stream=stream, include_usage=include_usage,
                          timings_per_token=bool(opt_bool(body, "timings_per_token")),
                          return_progress=bool(opt_bool(body, "return_progress")),
                          logprobs=logprobs, top_logprobs=top_logprobs)
    prompt = loaded.tokenizer.apply_chat_template(with_instruction(messages, fmt), add_generation_prompt=True,
                                                  **template_kwargs(body))
    ids = loaded.tokenizer.encode(prompt, add_special_tokens=False)
    if not ids:
        raise RequestError("the rendered prompt is empty", param="messages", code="invalid_prompt")
    req = PreparedRequest(request_id=request_id, prompt_token_ids=ids, sampling=sampling,
                          max_tokens=max_tokens, stop=stop, ignore_eos=ignore_eos, grammar=grammar,
                          # both options shape a stream only; the engine does the work only then
                          hints={"protocol": "chat", "timings_per_token": stream and options.timings_per_token,
                                 "return_progress": stream and options.return_progress})
    return req, options


async def handle_apply_template(call: Call) -> None:
    """POST /apply-template: the prompt a chat body renders to, assistant opener included."""
    body = call.json()
    loaded = call.state.loaded
    assert loaded is not None
    messages = normalize_messages(body.get("messages"))
    prompt = loaded.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                  **template_kwargs(body))
    await call.respond(200, {"prompt": prompt})


async def handle_chat(call: Call) -> None:
    body = call.json()
    rid = new_request_id()
    try:
        req, opts = prepare_chat(call, body, rid)
    except CLIENT_ERRORS as e:
        err = http_error(e)
        call.state.reject("chat", err)
        raise err
    async with Generation(call, req, opts.stream) as gen:
        if opts.stream:
            await _stream(call, gen, opts)
        else:
            await _aggregate(call, gen, opts)


def _final_extras(req: PreparedRequest, final: OutputEvent, token_ids: list[int]) -> dict[str, Any]:
    extras: dict[str, Any] = {}
    if final.timings is not None:
        extras["timings"] = final.timings.to_dict()
    extras.update(slot_extras(final, list(req.prompt_token_ids) + token_ids))
    return extras


async def _aggregate(call: Call, gen: Generation, opts: ChatOptions) -> None:
    state = call.state
    out = await gen.collect()
    final = out.final
    assert final is not None
    lp = None
    if opts.logprobs:
        lp = {"content": logprob_records(state.loaded.tokenizer, out.logprobs, opts.top_logprobs),
              "refusal": None}
    payload = {
        "id": f"chatcmpl-{gen.req.request_id}",
        "object": "chat.completion",
        "created": gen.created,
        "model": state.model_id,
        "choices": [{"index": 0,
                     "message": {"role": "assistant", "content": out.text, "refusal": None},
                     "logprobs": lp,
                     "finish_reason": final.finish_reason}],
        "usage": usage_dict(final.usage),
        **_final_extras(gen.req, final, out.token_ids),
    }
    await call.respond(200, payload)


async def _stream(call: Call, gen: Generation, opts: ChatOptions) -> None:
    state = call.state
    tok = state.loaded.tokenizer
    base = {"id": f"chatcmpl-{gen.req.request_id}", "object": "chat.completion.chunk",
            "created": gen.created, "model": state.model_id}
    if opts.include_usage:
        base["usage"] = None

    def chunk(delta: dict[str, Any], finish: str | None = None, logprobs: Any = None) -> bytes:
        return sse_data({**base, "choices": [{"index": 0, "delta": delta, "logprobs": logprobs,
                                              "finish_reason": finish}]})

    async def open_stream() -> None:
        await call.start_stream()
        await call.write(chunk({"role": "assistant", "content": ""}))

    token_ids: list[int] = []
    try:
        async for event in gen.events(state.config.keepalive_seconds):
            if event is TIMEOUT:
                if not call.started:
                    await open_stream()
                await call.write(KEEPALIVE)
                continue
            if not call.started:
                await open_stream()
            piece = prompt_progress(event, opts.timings_per_token)
            if piece is not None:  # the engine sends these only when return_progress asked
                await call.write(sse_data({**base, "choices": [], **piece}))
                continue
            token_ids.extend(event.token_ids)
            if event.text or event.logprobs and opts.logprobs:
                lp = None
                if opts.logprobs:
                    lp = {"content": logprob_records(tok, event.logprobs, opts.top_logprobs), "refusal": None}
                data = {**base, "choices": [{"index": 0, "delta": {"content": event.text}, "logprobs": lp,
                                             "finish_reason": None}]}
                if opts.timings_per_token and event.timings is not None:
                    data["timings"] = event.timings.to_dict()
                await call.write(sse_data(data))
            if event.finish_reason is not None:
                extras = _final_extras(gen.req, event, token_ids)
                finish = {**base, "choices": [{"index": 0, "delta": {}, "logprobs": None,
                                               "finish_reason": event.finish_reason}]}
                if opts.include_usage:
                    await call.write(sse_data(finish))
                    choices: list[Any] = []
                    if state.config.usage_chunk_choice:
                        choices = [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": None}]
                    await call.write(sse_data({**base, "choices": choices,
                                               "usage": usage_dict(event.usage), **extras}))
                else:
                    await call.write(sse_data({**finish, **extras}))
                await call.write(DONE)
    except CLIENT_ERRORS as e:
        if not call.started:
            raise
        await call.write(sse_error(http_error(e)))
    await call.end()
