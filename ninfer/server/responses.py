"""The OpenAI Responses API core: POST /v1/responses (aggregate and semantic SSE), the local
response store (GET / DELETE /v1/responses/{id}, .../input_items), previous_response_id
continuation, and POST /v1/responses/input_tokens.

Text conversations: message Items with input_text / output_text / refusal parts, and JSON
text.format with --structured-output. What needs a capability this server lacks (tools, reasoning
Items, images, files, background jobs, compaction) is refused with a field-specific 400; unknown
top-level fields fail with unknown_parameter, as the spec requires.
"""
from __future__ import annotations

import asyncio

import json
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import Any

import orjson

from ninfer.engine.chat import EFFORTS, Message, ToolCall
from ninfer.engine.request import Usage
from ninfer.errors import RequestError
from ninfer.server.chat_output import ChatResult, Piece
from ninfer.server.chat_request import (ChatRequest, effort_kwargs, merge_template_kwargs, named_effort,
                                       parse_post_thinking, parse_thinking_budget)
from ninfer.server.chat_run import ChatEncoder, prepare, run_chat
from ninfer.server.generate import logprob_records
from ninfer.server.http import Call
from ninfer.server.params import (bad, check_model, join_text_parts, opt_bool, opt_int, opt_number, opt_object,
                                  sampling_from, unsupported)
from ninfer.server.sse import KEEPALIVE
from ninfer.server.structured import responses_format
from ninfer.server.tools import order_tool_results, responses_tool_choice, responses_tools

ROLES = ("user", "assistant", "system", "developer")
INCLUDE = ("reasoning.encrypted_content", "message.output_text.logprobs")
# accepted and echoed or ignored: they change nothing in generation
_PASSIVE = ("client_metadata", "prompt_cache_key", "prompt_cache_options", "prompt_cache_retention",
            "safety_identifier", "user", "max_tool_calls", "stream_options")
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
          "background", "include", "thinking_budget", "post_thinking", *_PASSIVE, *_REFUSED}


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
    """Canonical input Items, the client's ids kept (others generated): message Items
    {"type": "message", "id", "role", "content": [one text part]}, reasoning Items with raw
    reasoning_text, function_call and function_call_output Items."""
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
        decode = _ITEM_DECODERS.get(kind) if isinstance(kind, str) else None
        if decode is None:
            raise bad(f"{where}.type", f"{where}.type {kind!r} is not a supported Item type")
        canonical = decode(item, where)
        item_id = item.get("id")
        if item_id is not None and (not isinstance(item_id, str) or not item_id):
            raise bad(f"{where}.id", f"{where}.id must be a non-empty string")
        item_id = item_id or _new_id(_ID_PREFIX[kind])
        if item_id in seen:
            raise bad(f"{where}.id", f"{where}.id {item_id!r} repeats an earlier Item's id")
        seen.add(item_id)
        items.append({"type": kind, "id": item_id, **canonical})
    return items


def _message_item(item: dict[str, Any], where: str) -> dict[str, Any]:
    role = item.get("role")
    if role not in ROLES:
        raise bad(f"{where}.role", f"{where}.role must be one of {', '.join(ROLES)}")
    content = item.get("content")
    if isinstance(content, str):
        content = [{"type": "output_text" if role == "assistant" else "input_text", "text": content}]
    text = join_text_parts(content, f"{where}.content", _message_part)
    part_type = "output_text" if role == "assistant" else "input_text"
    return {"role": role, "status": "completed", "content": [{"type": part_type, "text": text}]}


def _reasoning_item(item: dict[str, Any], where: str) -> dict[str, Any]:
    """Raw replay: reasoning_text content; summary and encrypted_content may accompany it."""
    content = item.get("content")
    texts = []
    for j, part in enumerate(content or []):
        if not isinstance(part, dict) or part.get("type") != "reasoning_text" or not isinstance(part.get("text"), str):
            raise bad(f"{where}.content[{j}]", f"{where}.content[{j}] must be a reasoning_text part with text")
        texts.append(part["text"])
    if not texts:
        raise RequestError(f"{where}: a reasoning Item needs its raw reasoning_text content; summaries and "
                           "encrypted content cannot replace it", param=f"{where}.content",
                           code="reasoning_not_supported")
    return {"summary": item.get("summary") or [], "content": [{"type": "reasoning_text", "text": "".join(texts)}]}


def _function_call_item(item: dict[str, Any], where: str) -> dict[str, Any]:
    for name in ("call_id", "name", "arguments"):
        if not isinstance(item.get(name), str) or (name != "arguments" and not item[name]):
            raise bad(f"{where}.{name}", f"{where}.{name} must be a non-empty string")
    try:
        args = json.loads(item["arguments"] or "{}")
    except ValueError:
        args = None
    if not isinstance(args, dict):
        raise bad(f"{where}.arguments", f"{where}.arguments must be a JSON object string")
    out = {"call_id": item["call_id"], "name": item["name"], "arguments": item["arguments"], "status": "completed"}
    if item.get("namespace") is not None:
        if not isinstance(item["namespace"], str):
            raise bad(f"{where}.namespace", f"{where}.namespace must be a string")
        out["namespace"] = item["namespace"]
    return out


def _function_output_item(item: dict[str, Any], where: str) -> dict[str, Any]:
    if not isinstance(item.get("call_id"), str) or not item["call_id"]:
        raise bad(f"{where}.call_id", f"{where}.call_id must be a non-empty string")
    output = item.get("output")
    if isinstance(output, list):
        if not output:
            raise bad(f"{where}.output", f"{where}.output must be a string or a non-empty array of parts")
        output = join_text_parts(output, f"{where}.output", _message_part)
    if not isinstance(output, str):
        raise bad(f"{where}.output", f"{where}.output must be a string or an array of input_text parts")
    return {"call_id": item["call_id"], "output": output, "status": "completed"}


_ITEM_DECODERS = {"message": _message_item, "reasoning": _reasoning_item, "function_call": _function_call_item,
                  "function_call_output": _function_output_item}
_ID_PREFIX = {"message": "msg", "reasoning": "rs", "function_call": "fc", "function_call_output": "fco"}
# an assistant turn holds its Items in this order: reasoning -> message content -> function calls
_ASSISTANT_ORDER = {"reasoning": 0, "message": 1, "function_call": 2}


def turns_of(items: list[dict[str, Any]], instructions: str | None) -> list[Message]:
    """Conversation turns: instructions first (as a system turn); contiguous assistant-owned Items
    (reasoning, assistant messages, function calls) form one assistant turn; function call
    outputs become tool results in the order of the calls they answer."""
    turns = [Message("system", instructions)] if instructions is not None else []
    stage = -1  # the assistant turn's last Item kind, by _ASSISTANT_ORDER
    for i, item in enumerate(items):
        kind = item["type"]
        owner = "assistant" if kind in ("reasoning", "function_call") else \
            "tool" if kind == "function_call_output" else item["role"]
        if owner != "assistant":
            stage = -1
            if owner == "tool":
                turns.append(Message("tool", item["output"], tool_call_id=item["call_id"]))
            else:
                text = "".join(part["text"] for part in item["content"])
                turns.append(Message("system" if owner == "developer" else owner, text))
            continue
        order = _ASSISTANT_ORDER[kind]
        if stage < 0 or not turns or turns[-1].role != "assistant":
            turns.append(Message("assistant"))
        elif order < stage:
            raise RequestError(f"input[{i}]: an assistant turn holds reasoning, then message content, then function "
                               "calls; this order would need rearranging", param=f"input[{i}]",
                               code="invalid_assistant_history")
        stage = order
        turn = turns[-1]
        if kind == "reasoning":
            turn.reasoning = (turn.reasoning or "") + item["content"][0]["text"]
        elif kind == "message":
            turn.content += "".join(part["text"] for part in item["content"])
        else:
            turn.tool_calls.append(ToolCall(item["call_id"], item["name"], item["arguments"], item.get("namespace")))
    return order_tool_results(turns, _check_results)


def _check_results(order: list[str], ids: list[str | None], later: bool) -> None:
    """function_call_output Items answer the calls before them, each at most once."""
    if len(set(ids)) != len(ids) or any(x not in order for x in ids):
        raise RequestError("function_call_output Items must answer the preceding calls, each once, by call_id",
                           param="input", code="invalid_tool_history")


def _not_found(response_id: str, param: str | None = None) -> RequestError:
    return RequestError(f"No stored response with id {response_id!r} (store: false responses, deleted ones and "
                        "those evicted from the local store cannot be retrieved)", status=404,
                        param=param, code="response_not_found")


# ---- Create ------------------------------------------------------------------------------------

@dataclass(slots=True)
class CreateOptions:
    """What a Create decides beyond the chat request: storage and the echoed request fields."""

    store: bool
    input_items: list[dict[str, Any]]
    history: list[dict[str, Any]]  # the parent's chain plus this input (the output is added after)
    echo: dict[str, Any] = field(default_factory=dict)  # request fields the Response object reports
    include: list[str] = field(default_factory=list)
    tools: list[dict[str, Any]] = field(default_factory=list)  # the request's tools, echoed


def _check_fields(body: dict[str, Any], known: set[str]) -> None:
    for name in body:
        if name not in known:
            raise RequestError(f"Unknown parameter: {name!r}", param=name, code="unknown_parameter")
    for name, why in _REFUSED.items():
        if body.get(name) is not None:
            raise unsupported(name, f"{name}: {why} by this server")
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
        if reasoning.get("effort") is not None and reasoning.get("effort") not in EFFORTS:
            raise bad("reasoning.effort", f"reasoning.effort must be one of {', '.join(EFFORTS)}")
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
    if body.get("client_metadata") is not None and not isinstance(body["client_metadata"], dict):
        raise bad("client_metadata", "client_metadata must be an object or null")
    for name in ("prompt_cache_key", "safety_identifier", "user"):
        if body.get(name) is not None and not isinstance(body[name], str):
            raise bad(name, f"{name} must be a string")


def decode_create(call: Call, body: dict[str, Any], known: set[str] = _KNOWN,
                  generate: bool = True) -> tuple[ChatRequest, CreateOptions]:
    """Validate a Create body (or, generate=False, an input_tokens body: the format's instruction
    counts, its grammar is not built) into the internal chat request and the Create's options."""
    state = call.state
    check_model(body, state, required=True)
    _check_fields(body, known)
    fmt = responses_format(opt_object(body, "text"))
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise bad("instructions", "instructions must be a string")
    items = normalize_input(body.get("input"))
    parent_id = body.get("previous_response_id")
    history: list[dict[str, Any]] = []
    if parent_id is not None:
        if not isinstance(parent_id, str) or not parent_id:
            raise bad("previous_response_id", "previous_response_id must be a non-empty string")
        parent = state.responses.get(parent_id)
        if parent is None:
            raise _not_found(parent_id, "previous_response_id")
        history = list(parent.history)
    history += items
    if not any(item.get("role") == "user" for item in history):
        raise bad("input", "input must contain a user message (or continue a response that has one)")
    kwargs = merge_template_kwargs(body.get("chat_template_kwargs"),
                                   {"preserve_thinking": opt_bool(body, "preserve_thinking")})
    effort = (body.get("reasoning") or {}).get("effort")
    named = named_effort(effort, kwargs)
    kwargs = effort_kwargs(effort, "reasoning.effort", kwargs)
    max_tokens = opt_int(body, "max_output_tokens", lo=0)
    opt_number(body, "temperature", 0.0, 2.0)  # the Responses range; sampling_from reads the value
    top_logprobs = opt_int(body, "top_logprobs", lo=0, hi=20) or 0
    logprobs = top_logprobs > 0 or "message.output_text.logprobs" in (body.get("include") or [])
    sampling = sampling_from({k: body[k] for k in ("temperature", "top_p") if k in body}, state.base_sampling,
                             greedy=state.config.sampler.greedy, logprobs=logprobs, top_logprobs=top_logprobs,
                             negative_temperature_greedy=False)
    tools = responses_tools(body)
    chat = ChatRequest(protocol="responses", messages=turns_of(history, instructions), sampling=sampling,
                       tools=tools, tool_choice=responses_tool_choice(body, tools),
                       parallel_tool_calls=opt_bool(body, "parallel_tool_calls") is not False,
                       template_kwargs=kwargs, requested_effort=named, response_format=fmt, max_tokens=max_tokens,
                       stream=opt_bool(body, "stream") or False, logprobs=logprobs, top_logprobs=top_logprobs,
                       thinking_budget=parse_thinking_budget(body) if generate else None,
                       post_thinking=parse_post_thinking(body) if generate else None)
    store = opt_bool(body, "store")
    parallel = opt_bool(body, "parallel_tool_calls")
    reasoning = body.get("reasoning") or {}
    echo = {"instructions": instructions, "max_output_tokens": max_tokens,
            "previous_response_id": parent_id, "metadata": body.get("metadata") or {},
            "temperature": sampling.temperature, "top_p": sampling.top_p, "top_logprobs": top_logprobs,
            "user": body.get("user"),
            "parallel_tool_calls": True if parallel is None else parallel,
            "tool_choice": body.get("tool_choice") or "auto",
            "reasoning": {"effort": reasoning.get("effort"), "summary": reasoning.get("summary")},
            "text": {"format": (body.get("text") or {}).get("format") or {"type": "text"}, "verbosity": "medium"}}
    return chat, CreateOptions(store=True if store is None else store, input_items=items, history=history, echo=echo,
                               include=list(body.get("include") or []), tools=list(body.get("tools") or []))


def _usage(usage: Usage | None) -> dict[str, Any]:
    u = usage or Usage(0, 0, 0)
    return {"input_tokens": u.prompt_tokens, "input_tokens_details": {"cached_tokens": u.cached_tokens},
            "output_tokens": u.completion_tokens, "output_tokens_details": {"reasoning_tokens": u.reasoning_tokens},
            "total_tokens": u.prompt_tokens + u.completion_tokens}


async def handle_create(call: Call) -> None:
    body = call.json()

    def decode(request_id: str) -> tuple[ChatRequest, ChatEncoder]:
        chat, options = decode_create(call, body)
        return chat, ResponseEncoder(call, chat, options)

    await run_chat(call, "responses", decode)


def _sse(name: str, seq: int, data: dict[str, Any]) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + orjson.dumps({"type": name, "sequence_number": seq, **data}) \
        + b"\n\n"


SUMMARY_PLACEHOLDER = "Reasoning summaries are not generated by this server; the raw reasoning is in content."


class ResponseEncoder(ChatEncoder):
    """The Response object and its semantic SSE: output Items (a reasoning Item, an assistant
    message, function_call Items) added, filled and done in output order."""

    def __init__(self, call: Call, chat: ChatRequest, options: CreateOptions) -> None:
        super().__init__(call, chat)
        self.o = options
        self.created_at = int(time.time())
        self.tokenizer = call.state.loaded.tokenizer
        self.output: list[dict[str, Any]] = []  # Items so far (the last one may be open)
        self.open: dict[str, Any] | None = None  # the Item being streamed
        self.calls: dict[int, dict[str, Any]] = {}  # tool call index -> its function_call Item
        self.seq = 0
        reasoning = self.o.echo.get("reasoning") or {}
        self.summary = reasoning.get("summary") is not None
        self.mirror = "reasoning.encrypted_content" in self.o.include

    @property
    def id(self) -> str:
        return f"resp_{self.req.request_id}"

    def _records(self, logprobs: Any) -> list[dict[str, Any]]:
        if not self.chat.logprobs or not logprobs:
            return []
        return logprob_records(self.tokenizer, logprobs, self.chat.top_logprobs)

    def _response(self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None) -> dict[str, Any]:
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {"id": self.id, "object": "response", "created_at": self.created_at, "status": status,
                "completed_at": int(time.time()) if status == "completed" else None, "error": None,
                "incomplete_details": incomplete, "model": self.call.state.model_id, "output": output,
                "usage": usage, "store": self.o.store, "background": False, "service_tier": "default",
                "tools": self.o.tools, "truncation": "disabled", **self.o.echo}

    def _status(self, result: ChatResult) -> str:
        return "completed" if result.final.finish_reason == "stop" else "incomplete"

    def _final(self, result: ChatResult, output: list[dict[str, Any]]) -> dict[str, Any]:
        """The terminal Response, stored when asked (its Items join the chain for continuations)."""
        status = self._status(result)
        for item in output:
            item["status"] = "completed" if status == "completed" or item["type"] == "function_call" else status
        response = self._response(status, output, _usage(result.final.usage))
        if self.o.store:
            self.call.state.responses.put(response, self.o.input_items, self.o.history + response["output"])
        return response

    # ---- Items ----

    @staticmethod
    def _message_item(text: str, logprobs: list[dict[str, Any]], status: str = "completed") -> dict[str, Any]:
        content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}]
        return {"type": "message", "id": _new_id("msg"), "status": status, "role": "assistant", "content": content}

    def _reasoning_item(self, text: str, status: str = "completed") -> dict[str, Any]:
        summary = [{"type": "summary_text", "text": SUMMARY_PLACEHOLDER}] if self.summary else []
        item = {"type": "reasoning", "id": _new_id("rs"), "status": status, "summary": summary,
                "content": [{"type": "reasoning_text", "text": text}]}
        if self.mirror and status != "in_progress":
            item["encrypted_content"] = text
        return item

    @staticmethod
    def _call_item(call: ToolCall, status: str = "completed") -> dict[str, Any]:
        item = {"type": "function_call", "id": _new_id("fc"), "call_id": call.id, "name": call.name,
                "arguments": call.arguments, "status": status}
        if call.namespace is not None:
            item["namespace"] = call.namespace
        return item

    async def respond(self, result: ChatResult) -> None:
        output = []
        if result.reasoning:
            output.append(self._reasoning_item(result.reasoning))
        if result.content or not (result.reasoning or result.tool_calls):
            output.append(self._message_item(result.content, self._records(result.logprobs)))
        output += [self._call_item(c) for c in result.tool_calls]
        await self.call.respond(200, self._final(result, output))

    # ---- streaming ----

    async def _emit(self, name: str, **data: Any) -> None:
        await self.call.write(_sse(name, self.seq, data))
        self.seq += 1

    async def _open_stream(self) -> None:  # once submitted: a refused submission stays an HTTP error
        if not self.call.started:
            await self.call.start_stream()
            await self._emit("response.created", response=self._response("in_progress", [], None))
            await self._emit("response.in_progress", response=self._response("in_progress", [], None))

    def _where(self, item: dict[str, Any]) -> dict[str, Any]:
        return {"item_id": item["id"], "output_index": self.output.index(item), "content_index": 0}

    async def _add(self, item: dict[str, Any]) -> None:
        await self._close_item()
        self.open = item
        self.output.append(item)
        shown = {**item, "content": []} if "content" in item else item
        await self._emit("response.output_item.added", output_index=len(self.output) - 1, item=shown)

    async def _open_kind(self, kind: str) -> dict[str, Any]:
        """The open message or reasoning Item, added (with its content part) when another is open."""
        if self.open is not None and self.open["type"] == kind:
            return self.open
        if kind == "message":
            item = self._message_item("", [], "in_progress")
            await self._add(item)
        else:
            item = self._reasoning_item("", "in_progress")
            await self._add(item)
            if self.summary:
                where = {"item_id": item["id"], "output_index": self.output.index(item), "summary_index": 0}
                part = item["summary"][0]
                await self._emit("response.reasoning_summary_part.added", **where, part={**part, "text": ""})
                await self._emit("response.reasoning_summary_text.delta", **where, delta=part["text"])
                await self._emit("response.reasoning_summary_text.done", **where, text=part["text"])
                await self._emit("response.reasoning_summary_part.done", **where, part=part)
        await self._emit("response.content_part.added", **self._where(item), part=item["content"][0])
        return item

    async def _close_item(self, status: str = "completed") -> None:
        item, self.open = self.open, None
        if item is None:
            return
        item["status"] = status
        if item["type"] == "message":
            part = item["content"][0]
            where = self._where(item)
            await self._emit("response.output_text.done", **where, text=part["text"], logprobs=part["logprobs"])
            await self._emit("response.content_part.done", **where, part=part)
        elif item["type"] == "reasoning":
            part = item["content"][0]
            where = self._where(item)
            if self.mirror:
                item["encrypted_content"] = part["text"]
            await self._emit("response.reasoning_text.done", **where, text=part["text"])
            await self._emit("response.content_part.done", **where, part=part)
        elif item["type"] == "function_call":
            item["status"] = "completed"
            await self._emit("response.function_call_arguments.done", item_id=item["id"],
                             output_index=self.output.index(item), arguments=item["arguments"])
        await self._emit("response.output_item.done", output_index=self.output.index(item), item=item)

    async def keepalive(self) -> None:
        await self._open_stream()
        await self.call.write(KEEPALIVE)

    async def piece(self, piece: Piece) -> None:
        await self._open_stream()
        if piece.kind == "reasoning":
            item = await self._open_kind("reasoning")
            item["content"][0]["text"] += piece.text
            await self._emit("response.reasoning_text.delta", **self._where(item), delta=piece.text)
        elif piece.kind == "content":
            records = self._records(piece.logprobs)
            if not piece.text and not records:
                return
            item = await self._open_kind("message")
            part = item["content"][0]
            part["text"] += piece.text
            part["logprobs"].extend(records)
            await self._emit("response.output_text.delta", **self._where(item), delta=piece.text, logprobs=records)
        elif piece.kind == "tool_start":
            item = self._call_item(replace(piece.call, arguments=""), "in_progress")
            self.calls[piece.index] = item
            await self._add(item)
        elif piece.kind == "tool_args":
            item = self.calls[piece.index]
            item["arguments"] += piece.text
            await self._emit("response.function_call_arguments.delta", item_id=item["id"],
                             output_index=self.output.index(item), delta=piece.text)
        elif piece.kind == "tool_done":
            item = self.calls[piece.index]
            item["arguments"] = piece.call.arguments
            if self.open is item:
                await self._close_item()

    async def finish(self, result: ChatResult) -> None:
        await self._open_stream()
        if not self.output:
            await self._open_kind("message")
        await self._close_item(self._status(result))
        response = self._final(result, self.output)
        await self._emit(f"response.{response['status']}", response=response)

    async def fail(self, err: RequestError) -> None:
        failed = {**self._response("failed", self.output, None),
                  "error": {"code": err.code or "server_error", "message": err.message}}
        await self._emit("response.failed", response=failed)


# ---- the other endpoints -----------------------------------------------------------------------

async def handle_input_tokens(call: Call) -> None:
    """The prompt a Create with this body would run, counted; nothing is generated or stored."""
    chat, _ = decode_create(call, call.json(), _COUNT_FIELDS, generate=False)
    with call.state.counting_tokens():  # rendering runs off the loop, so several run at once
        n = len((await asyncio.to_thread(prepare, call.state, chat, "count", False)).prompt_token_ids)
    await call.respond(200, {"object": "response.input_tokens", "input_tokens": n})


async def handle_resource(call: Call) -> None:
    """GET / DELETE /v1/responses/{id}, GET .../input_items, POST .../cancel."""
    response_id, action = call.extra["response_id"], call.extra["action"]
    store = call.pool.responses  # the server's, whichever model answered
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
