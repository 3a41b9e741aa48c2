"""The OpenAI Responses API core: POST /v1/responses (aggregate and semantic SSE), the local
response store (GET / DELETE /v1/responses/{id}, .../input_items), previous_response_id
continuation, and POST /v1/responses/input_tokens.

Text conversations: message Items with input_text / output_text / refusal parts, and JSON
text.format with --structured-output. What needs a capability this server lacks (tools, reasoning
Items, images, files, background jobs, compaction) is refused with a field-specific 400; unknown
top-level fields fail with unknown_parameter, as the spec requires.
"""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import orjson

from ninfer.engine.request import OutputEvent, PreparedRequest, Usage
from ninfer.errors import RequestError
from ninfer.server.errors import CLIENT_ERRORS, http_error
from ninfer.server.generate import Generation, logprob_records
from ninfer.server.http import Call
from ninfer.server.openai_chat import template_kwargs
from ninfer.server.params import (bad, check_model, join_text_parts, opt_bool, opt_int, opt_number, opt_object,
                                  refuse_tools, sampling_from, unsupported)
from ninfer.server.sse import KEEPALIVE, TIMEOUT
from ninfer.server.structured import constrain, responses_format, with_instruction

ROLES = ("user", "assistant", "system", "developer")
INCLUDE = ("reasoning.encrypted_content", "message.output_text.logprobs")
# accepted and echoed or ignored: they change nothing in generation
_PASSIVE = ("client_metadata", "prompt_cache_key", "prompt_cache_options", "prompt_cache_retention",
            "safety_identifier", "user", "max_tool_calls", "stream_options", "thinking_budget")
# recognized, but they ask for what this server does not do
_REFUSED = {"conversation": "Conversations are not supported", "prompt": "prompt templates are not supported",
            "context_management": "context management is not supported",
            "moderation": "hosted moderation is not supported"}
# what POST /v1/responses/input_tokens takes (the prompt's fields); other Create fields are unknown there
_COUNT_FIELDS = {"model", "input", "instructions", "previous_response_id", "reasoning", "text", "tools", "tool_choice",
                 "parallel_tool_calls", "truncation", "chat_template_kwargs", "preserve_thinking", "graft",
                 "conversation"}
_KNOWN = {"model", "input", "instructions", "previous_response_id", "max_output_tokens", "stream", "store",
          "temperature", "top_p", "metadata", "reasoning", "chat_template_kwargs", "preserve_thinking", "graft",
          "text", "tools", "tool_choice", "parallel_tool_calls", "truncation", "top_logprobs", "service_tier",
          "background", "include", *_PASSIVE, *_REFUSED}


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


# ---- input Items -------------------------------------------------------------------------------

def _message_part(part: dict[str, Any], p: str) -> str:
    kind = part.get("type")
    if kind in ("input_text", "output_text"):
        text = part.get("text")
        if not isinstance(text, str):
            raise bad(f"{p}.text", f"{p}.text must be a string")
        return text
    if kind == "refusal":
        text = part.get("refusal")
        if not isinstance(text, str):
            raise bad(f"{p}.refusal", f"{p}.refusal must be a string")
        return text
    if kind in ("input_image", "input_video"):
        raise RequestError(f"{p}: image and video input needs a vision model; this server serves text only",
                           param=p, code="vision_disabled")
    if kind in ("input_file", "input_audio"):
        raise RequestError(f"{p}: {kind} is not supported", param=p, code=f"{kind}_not_supported")
    raise bad(f"{p}.type", f"{p}.type {kind!r} is not a message content part type")


def normalize_input(value: Any) -> list[dict[str, Any]]:
    """Canonical message Items: {"type": "message", "id", "role", "content": [parts]}, with the
    client's ids kept (others generated) and each part reduced to its text."""
    if value is None:
        return []
    if isinstance(value, str):
        value = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": value}]}]
    if not isinstance(value, list):
        raise bad("input", "input must be a string or an array of Items")
    items: list[dict[str, Any]] = []
    seen: set[str] = set()
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad(where, f"{where} must be an Item object")
        kind = item.get("type", "message")
        if kind in ("function_call", "function_call_output"):
            raise RequestError(f"{where}: {kind} Items need tool calling, which this server does not support",
                               param=f"{where}.type", code="tools_not_supported")
        if kind == "reasoning":
            raise RequestError(f"{where}: reasoning Items are not supported: this model has no thinking mode",
                               param=f"{where}.type", code="reasoning_not_supported")
        if kind != "message":
            raise bad(f"{where}.type", f"{where}.type {kind!r} is not a supported Item type")
        role = item.get("role")
        if role not in ROLES:
            raise bad(f"{where}.role", f"{where}.role must be one of {', '.join(ROLES)}")
        content = item.get("content")
        if isinstance(content, str):
            content = [{"type": "output_text" if role == "assistant" else "input_text", "text": content}]
        text = join_text_parts(content, f"{where}.content", _message_part)
        item_id = item.get("id")
        if item_id is not None and (not isinstance(item_id, str) or not item_id):
            raise bad(f"{where}.id", f"{where}.id must be a non-empty string")
        item_id = item_id or _new_id("msg")
        if item_id in seen:
            raise bad(f"{where}.id", f"{where}.id {item_id!r} repeats an earlier Item's id")
        seen.add(item_id)
        part_type = "output_text" if role == "assistant" else "input_text"
        items.append({"type": "message", "id": item_id, "role": role, "status": "completed",
                      "content": [{"type": part_type, "text": text}]})
    return items


def turns_of(items: list[dict[str, Any]], instructions: str | None) -> list[dict[str, str]]:
    """Chat-template turns: instructions first (as a system turn), contiguous assistant Items joined."""
    turns = [{"role": "system", "content": instructions}] if instructions is not None else []
    for item in items:
        role = "system" if item["role"] == "developer" else item["role"]
        text = "".join(part["text"] for part in item["content"])
        if role == "assistant" and turns and turns[-1]["role"] == "assistant":
            turns[-1]["content"] += text
        else:
            turns.append({"role": role, "content": text})
    return turns


def _not_found(response_id: str, param: str | None = None) -> RequestError:
    return RequestError(f"No stored response with id {response_id!r} (store: false responses, deleted ones and "
                        "those evicted from the local store cannot be retrieved)", status=404,
                        param=param, code="response_not_found")


# ---- Create ------------------------------------------------------------------------------------

@dataclass(slots=True)
class CreateRequest:
    req: PreparedRequest
    stream: bool
    store: bool
    input_items: list[dict[str, Any]]
    history: list[dict[str, Any]]  # the parent's chain plus this input (the output is added after)
    echo: dict[str, Any] = field(default_factory=dict)  # request fields the Response object reports
    logprobs: bool = False
    top_logprobs: int = 0


def _check_fields(body: dict[str, Any], known: set[str]) -> None:
    for name in body:
        if name not in known:
            raise RequestError(f"Unknown parameter: {name!r}", param=name, code="unknown_parameter")
    for name, why in _REFUSED.items():
        if body.get(name) is not None:
            raise unsupported(name, f"{name}: {why} by this server")
    refuse_tools(body)
    choice = body.get("tool_choice")
    if choice is not None and choice not in ("auto", "none"):
        raise unsupported("tool_choice", "tool_choice can only be auto or none: no tools are available")
    if opt_bool(body, "background"):
        raise unsupported("background", "background execution is not supported: responses run in the request")
    truncation = body.get("truncation")
    if truncation not in (None, "disabled"):
        raise unsupported("truncation", "truncation can only be disabled: overlong input fails instead")
    tier = body.get("service_tier")
    if tier not in (None, "auto", "default"):
        raise unsupported("service_tier", f"service_tier {tier!r} is not available; use auto or default")
    include = body.get("include")
    if include is not None:
        if not isinstance(include, list) or any(v not in INCLUDE for v in include):
            raise bad("include", f"include values must be among {', '.join(INCLUDE)}")
    text = opt_object(body, "text")
    if text is not None:
        verbosity = text.get("verbosity")
        if verbosity not in (None, "medium"):
            raise unsupported("text.verbosity", "text.verbosity: only medium is supported")
    reasoning = opt_object(body, "reasoning")
    if reasoning is not None:
        for name in ("context", "mode"):
            if reasoning.get(name) is not None:
                raise RequestError(f"reasoning.{name} is not supported", param=f"reasoning.{name}",
                                   code="reasoning_option_not_supported")
        if reasoning.get("effort") not in (None, "none", "minimal", "low", "medium", "high", "xhigh"):
            raise bad("reasoning.effort", "reasoning.effort must be one of none, minimal, low, medium, high, xhigh")
        summaries = {reasoning.get("summary"), reasoning.get("generate_summary")} - {None}
        if any(s not in ("auto", "concise", "detailed") for s in summaries) or len(summaries) > 1:
            raise bad("reasoning.summary", "reasoning.summary must be auto, concise or detailed "
                                           "(and agree with reasoning.generate_summary)")
    metadata = body.get("metadata")
    if metadata is not None:
        if not isinstance(metadata, dict) or len(metadata) > 16 or any(
                not isinstance(k, str) or not isinstance(v, str) or len(k) > 64 or len(v) > 512
                for k, v in metadata.items()):
            raise bad("metadata", "metadata must hold at most 16 string pairs (keys up to 64 characters, "
                                  "values up to 512)")
    graft = body.get("graft")
    if graft is not None:
        if not isinstance(graft, str):
            raise bad("graft", "graft must be a string or null")
        raise RequestError(f"graft {graft!r}: this server loaded no prompt grafts", param="graft",
                           code="unknown_graft")
    budget = body.get("thinking_budget")
    if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 1):
        raise bad("thinking_budget", "thinking_budget must be a positive integer or null")
    if body.get("client_metadata") is not None and not isinstance(body["client_metadata"], dict):
        raise bad("client_metadata", "client_metadata must be an object or null")
    for name in ("prompt_cache_key", "safety_identifier", "user"):
        if body.get(name) is not None and not isinstance(body[name], str):
            raise bad(name, f"{name} must be a string")


@dataclass(slots=True)
class Prompt:
    ids: list[int]
    items: list[dict[str, Any]]  # this input's Items
    history: list[dict[str, Any]]  # the chain's Items with them
    grammar: Any  # text.format's grammar, or None


def _conversation(call: Call, body: dict[str, Any], known: set[str], generate: bool = True) -> Prompt:
    """The prompt of a Create (or, generate=False, of an input_tokens count: the format's
    instruction counts, its grammar is not built) and what goes with it."""
    check_model(body, call.state, required=True)
    _check_fields(body, known)
    fmt = responses_format(opt_object(body, "text"))
    grammar = constrain(call.state, fmt) if generate else None
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise bad("instructions", "instructions must be a string")
    items = normalize_input(body.get("input"))
    parent_id = body.get("previous_response_id")
    history: list[dict[str, Any]] = []
    if parent_id is not None:
        if not isinstance(parent_id, str) or not parent_id:
            raise bad("previous_response_id", "previous_response_id must be a non-empty string")
        parent = call.state.responses.get(parent_id)
        if parent is None:
            raise _not_found(parent_id, "previous_response_id")
        history = list(parent.history)
    history += items
    if not any(item["role"] == "user" for item in history):
        raise bad("input", "input must contain a user message (or continue a response that has one)")
    kwargs = dict(template_kwargs({k: body[k] for k in ("chat_template_kwargs", "preserve_thinking") if k in body}))
    effort = (body.get("reasoning") or {}).get("effort")
    if effort == "none":
        kwargs.setdefault("enable_thinking", False)
    elif effort is not None:
        kwargs["reasoning_effort"] = effort
    tok = call.state.loaded.tokenizer
    turns = with_instruction(turns_of(history, instructions), fmt)
    prompt = tok.apply_chat_template(turns, add_generation_prompt=True, **kwargs)
    return Prompt(tok.encode(prompt, add_special_tokens=False), items, history, grammar)


def prepare_create(call: Call, body: dict[str, Any]) -> CreateRequest:
    state = call.state
    p = _conversation(call, body, _KNOWN)
    max_tokens = opt_int(body, "max_output_tokens", lo=0)
    opt_number(body, "temperature", 0.0, 2.0)  # the Responses range; sampling_from reads the value
    top_logprobs = opt_int(body, "top_logprobs", lo=0, hi=20) or 0
    logprobs = top_logprobs > 0 or "message.output_text.logprobs" in (body.get("include") or [])
    sampling = sampling_from({k: body[k] for k in ("temperature", "top_p") if k in body}, state.base_sampling,
                             greedy=state.config.sampler.greedy, logprobs=logprobs, top_logprobs=top_logprobs,
                             negative_temperature_greedy=False)
    stream = opt_bool(body, "stream") or False
    store = opt_bool(body, "store")
    parallel = opt_bool(body, "parallel_tool_calls")
    echo = {"instructions": body.get("instructions"), "max_output_tokens": max_tokens,
            "previous_response_id": body.get("previous_response_id"), "metadata": body.get("metadata") or {},
            "temperature": sampling.temperature, "top_p": sampling.top_p, "top_logprobs": top_logprobs,
            "user": body.get("user"),
            "parallel_tool_calls": True if parallel is None else parallel,
            "tool_choice": body.get("tool_choice") or "auto",
            "reasoning": {"effort": (body.get("reasoning") or {}).get("effort"),
                          "summary": (body.get("reasoning") or {}).get("summary")},
            "text": {"format": (body.get("text") or {}).get("format") or {"type": "text"}, "verbosity": "medium"}}
    req = PreparedRequest(request_id=uuid.uuid4().hex, prompt_token_ids=p.ids, sampling=sampling,
                          max_tokens=max_tokens, grammar=p.grammar, hints={"protocol": "responses"})
    return CreateRequest(req=req, stream=stream, store=True if store is None else store, input_items=p.items,
                         history=p.history, echo=echo, logprobs=logprobs, top_logprobs=top_logprobs)


def _usage(usage: Usage | None) -> dict[str, Any]:
    u = usage or Usage(0, 0, 0)
    return {"input_tokens": u.prompt_tokens, "input_tokens_details": {"cached_tokens": u.cached_tokens},
            "output_tokens": u.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": u.prompt_tokens + u.completion_tokens}


class _Builder:
    """The Response object of one Create as it progresses."""

    def __init__(self, call: Call, c: CreateRequest) -> None:
        self.call, self.c = call, c
        self.id = f"resp_{c.req.request_id}"
        self.item_id = _new_id("msg")
        self.created_at = int(time.time())
        self.text = ""
        self.logprobs: list[dict[str, Any]] = []

    def part(self) -> dict[str, Any]:
        return {"type": "output_text", "text": self.text, "annotations": [], "logprobs": self.logprobs}

    def item(self, status: str) -> dict[str, Any]:
        content = [self.part()] if status != "in_progress" else []
        return {"type": "message", "id": self.item_id, "status": status, "role": "assistant", "content": content}

    def response(self, final: OutputEvent | None) -> dict[str, Any]:
        status, incomplete, output, usage = "in_progress", None, [], None
        if final is not None:
            status = "completed" if final.finish_reason == "stop" else "incomplete"
            if status == "incomplete":
                incomplete = {"reason": "max_output_tokens"}
            output = [self.item(status)]
            usage = _usage(final.usage)
        return {"id": self.id, "object": "response", "created_at": self.created_at, "status": status,
                "completed_at": int(time.time()) if status == "completed" else None, "error": None,
                "incomplete_details": incomplete, "model": self.call.state.model_id, "output": output,
                "usage": usage, "store": self.c.store, "background": False, "service_tier": "default",
                "tools": [], "truncation": "disabled", **self.c.echo}

    def add(self, event: OutputEvent) -> tuple[str, list[dict[str, Any]]]:
        """Take an event's text and logprob records; -> (the new text, its records)."""
        self.text += event.text
        records = []
        if self.c.logprobs and event.logprobs:
            records = logprob_records(self.call.state.loaded.tokenizer, event.logprobs, self.c.top_logprobs)
            self.logprobs.extend(records)
        return event.text, records

    def finish(self, final: OutputEvent) -> dict[str, Any]:
        """The terminal Response, stored when asked (its Items join the chain for continuations)."""
        response = self.response(final)
        if self.c.store:
            self.call.state.responses.put(response, self.c.input_items, self.c.history + response["output"])
        return response


async def handle_create(call: Call) -> None:
    body = call.json()
    try:
        c = prepare_create(call, body)
    except CLIENT_ERRORS as e:
        err = http_error(e)
        call.state.reject("responses", err)
        raise err
    async with Generation(call, c.req, c.stream) as gen:
        if c.stream:
            await _stream(call, gen, c)
        else:
            b = _Builder(call, c)
            async for event in gen.events(None):
                b.add(event)
                if event.finish_reason is not None:
                    await call.respond(200, b.finish(event))


def _sse(name: str, seq: int, data: dict[str, Any]) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + orjson.dumps({"type": name, "sequence_number": seq, **data}) \
        + b"\n\n"


async def _stream(call: Call, gen: Generation, c: CreateRequest) -> None:
    b = _Builder(call, c)
    seq = 0
    where = {"item_id": b.item_id, "output_index": 0, "content_index": 0}

    async def emit(name: str, **data: Any) -> None:
        nonlocal seq
        await call.write(_sse(name, seq, data))
        seq += 1

    async def open_stream() -> None:  # once submitted: a refused submission stays an HTTP error
        await call.start_stream()
        await emit("response.created", response=b.response(None))
        await emit("response.in_progress", response=b.response(None))
        await emit("response.output_item.added", output_index=0, item=b.item("in_progress"))
        await emit("response.content_part.added", **where, part=b.part())

    try:
        async for event in gen.events(call.state.config.keepalive_seconds):
            if not call.started:
                await open_stream()
            if event is TIMEOUT:
                await call.write(KEEPALIVE)
                continue
            delta, records = b.add(event)
            if delta or records:
                await emit("response.output_text.delta", **where, delta=delta, logprobs=records)
            if event.finish_reason is not None:
                response = b.finish(event)
                item = response["output"][0]
                await emit("response.output_text.done", **where, text=b.text, logprobs=b.logprobs)
                await emit("response.content_part.done", **where, part=item["content"][0])
                await emit("response.output_item.done", output_index=0, item=item)
                await emit(f"response.{response['status']}", response=response)
    except CLIENT_ERRORS as e:
        if not call.started:
            raise
        e = http_error(e)
        failed = {**b.response(None), "status": "failed",
                  "error": {"code": e.code or "server_error", "message": e.message}}
        await emit("response.failed", response=failed)
    await call.end()


# ---- the other endpoints -----------------------------------------------------------------------

async def handle_input_tokens(call: Call) -> None:
    """The prompt a Create with this body would run, counted; nothing is generated or stored."""
    with call.state.counting_tokens():
        p = _conversation(call, call.json(), _COUNT_FIELDS, generate=False)
    await call.respond(200, {"object": "response.input_tokens", "input_tokens": len(p.ids)})


async def handle_resource(call: Call) -> None:
    """GET / DELETE /v1/responses/{id}, GET .../input_items, POST .../cancel."""
    response_id, action = call.extra["response_id"], call.extra["action"]
    store = call.state.responses
    if action == "cancel":
        raise RequestError("background execution is not supported, so there is no running response to cancel",
                           param="response_id", code="background_not_supported")
    if call.method == "DELETE":
        if not store.delete(response_id):
            raise _not_found(response_id)
        await call.respond(200, {"id": response_id, "object": "response.deleted", "deleted": True})
        return
    entry = store.get(response_id)
    if entry is None:
        raise _not_found(response_id)
    if action == "input_items":
        await call.respond(200, _input_items_page(call, entry.input_items))
        return
    if call.query.get("stream") not in (None, "false"):
        raise unsupported("stream", "stream recovery is not supported: a stored response is returned whole")
    if call.query.get("include") or call.query.get("include[]"):
        raise unsupported("include", "include is not supported when retrieving a stored response")
    await call.respond(200, entry.response)


def _input_items_page(call: Call, items: list[dict[str, Any]]) -> dict[str, Any]:
    q = call.query
    limit_text = q.get("limit", "20")
    if not limit_text.isdigit() or not 1 <= int(limit_text) <= 100:
        raise bad("limit", "limit must be an integer in 1..100")
    order = q.get("order", "desc")
    if order not in ("asc", "desc"):
        raise bad("order", "order must be asc or desc")
    ordered = items if order == "asc" else items[::-1]
    after = q.get("after")
    if after is not None:
        ids = [item["id"] for item in ordered]
        if after not in ids:
            raise bad("after", f"after {after!r} is not an input Item of this response")
        ordered = ordered[ids.index(after) + 1:]
    page = ordered[:int(limit_text)]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": len(ordered) > len(page)}


async def handle_compact(call: Call) -> None:
    raise RequestError("response compaction is not supported by this server", param="input",
                       code="compaction_not_supported")
