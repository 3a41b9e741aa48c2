"""The one internal chat request. Chat Completions, Responses and Anthropic Messages each decode
their body into a `ChatRequest` (as llama-server converts Anthropic and Responses bodies to a chat
request); chat_run.py renders it once, runs it through one generation loop and hands the output
to the protocol's encoder. The decoding pieces the protocols share live here, so protocol modules
never import each other.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ninfer.engine.chat import EFFORTS, Message, Tool
from ninfer.engine.request import SamplingParams
from ninfer.errors import RequestError
from ninfer.server.params import bad, opt_int, opt_number, sampling_from
from ninfer.server.structured import JsonFormat

# template kwargs a request may not override: the template's inputs and the tokenizer's tokens
RESERVED_KWARGS = ("messages", "tools", "documents", "add_generation_prompt", "bos_token", "eos_token")


@dataclass(slots=True, frozen=True)
class ToolChoice:
    """auto: the model may call any offered tool; none: no structured calls; required: a call of
    one of `names` is enforced by a grammar (one name: a named call)."""

    mode: str = "auto"
    names: tuple[str, ...] = ()  # required: the engine names the call may take


@dataclass(slots=True)
class ChatRequest:
    """A chat conversation with everything a generation needs, whatever protocol sent it."""

    protocol: str  # "chat" | "responses" | "anthropic": logs and request hints
    messages: list[Message]
    sampling: SamplingParams
    prefill: str | None = None  # a final assistant text continued in place
    tools: list[Tool] = field(default_factory=list)  # what the template renders
    tool_choice: ToolChoice = field(default_factory=ToolChoice)
    parallel_tool_calls: bool = True  # False keeps the first call
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    response_format: JsonFormat | None = None
    max_tokens: int | None = None  # None: the default output limit
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    stream: bool = False
    include_usage: bool = False  # Chat: a final usage chunk
    return_progress: bool = False  # prompt-progress events (Anthropic's message_start needs admission)
    timings_per_token: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    thinking_budget: int | None = None  # the request's cap (None: the server default)
    post_thinking: dict[str, Any] | None = None  # the request's post_thinking fields (None: the server's choice)
    omit_reasoning: bool = False  # Anthropic thinking.display "omitted": reasoning travels in the signature only
    requested_effort: str | None = None  # the reasoning effort the request named itself (logs; None: none named)

    @property
    def callable_tools(self) -> list[Tool]:
        """The tools whose calls become structured output (none under tool_choice none; the named
        ones under allowed_tools or a forced call)."""
        if self.tool_choice.mode == "none":
            return []
        names = self.tool_choice.names
        return [t for t in self.tools if t.engine_name in names] if names else self.tools


def merge_template_kwargs(kwargs: dict[str, Any] | None, typed: dict[str, Any],
                          param: str = "chat_template_kwargs") -> dict[str, Any]:
    """chat_template_kwargs merged with the typed fields that duplicate them (values must agree;
    null means unspecified)."""
    if kwargs is not None and not isinstance(kwargs, dict):
        raise bad(param, f"{param} must be an object")
    merged = dict(kwargs or {})
    for key in merged:
        if key in RESERVED_KWARGS:
            raise bad(f"{param}.{key}", f"{param} cannot override {key}")
    for name, value in typed.items():
        if value is None:
            continue
        if merged.get(name) is not None and merged[name] != value:
            raise bad(name, f"{name} disagrees with {param}.{name}")
        merged[name] = value
    return {k: v for k, v in merged.items() if v is not None}


def effort_kwargs(effort: Any, param: str, kwargs: dict[str, Any]) -> dict[str, Any]:
    """A reasoning effort into template kwargs: none disables thinking, the others reach the
    template unchanged; default/auto (Chat's aliases) leave the server's level."""
    if effort is None or effort in ("default", "auto"):
        return kwargs
    if effort not in EFFORTS:
        raise bad(param, f"{param} must be one of {', '.join(EFFORTS)}")
    if effort == "none":
        if kwargs.get("enable_thinking") is True:
            raise bad(param, f"{param} none disagrees with enable_thinking true")
        return {**kwargs, "enable_thinking": False}
    return {**kwargs, "reasoning_effort": effort}


def named_effort(effort: Any, kwargs: dict[str, Any]) -> str | None:
    """The effort a request named itself: its typed field, else chat_template_kwargs.reasoning_effort
    (default/auto name none: they ask for the server's level)."""
    if isinstance(effort, str) and effort not in ("default", "auto"):
        return effort
    value = kwargs.get("reasoning_effort")
    return value if isinstance(value, str) else None


POST_THINKING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty", "seed")


def parse_thinking_budget(body: dict[str, Any], name: str = "thinking_budget") -> int | None:
    """The NInfer thinking_budget extension: a positive integer or null."""
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise bad(name, f"{name} must be a positive integer or null")
    return value


def parse_post_thinking(body: dict[str, Any], max_temperature: float = 2.0) -> dict[str, Any] | None:
    """The post_thinking extension object: the sampler after the reasoning closes ({} = the preset)."""
    value = body.get("post_thinking")
    if value is None:
        return None
    if not isinstance(value, dict):
        raise bad("post_thinking", "post_thinking must be an object")
    for key in value:
        if key not in POST_THINKING_FIELDS:
            raise bad(f"post_thinking.{key}", f"post_thinking.{key} is not a sampler field "
                                              f"({', '.join(POST_THINKING_FIELDS)})")
    fields = {k: v for k, v in value.items() if v is not None}
    try:
        opt_number(fields, "temperature", 0.0, max_temperature)
        opt_int(fields, "seed")
        sampling_from(fields, SamplingParams(), greedy=False)
    except RequestError as e:
        e.param = f"post_thinking.{e.param}"
        e.message = f"post_thinking.{e.message}"
        raise
    return fields
