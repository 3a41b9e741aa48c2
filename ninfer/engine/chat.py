"""A conversation as every chat protocol ends up: messages with text, reasoning, tool calls and
tool results, plus declared tools; and the one rendering of it to token ids (the server's three
chat protocols, /apply-template and `ninfer run` all render here).

Rendering keeps control tokens the template's own: a special-token spelling inside message
content, tool data or template kwargs is encoded as plain text, never as the control token
(the content is escaped before the template sees it, and the rendered text is encoded in pieces
between the template's special tokens).
"""
from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the server imports this module before the model (and torch) loads
    from ninfer.engine.tokenizer import Tokenizer

# A quoted special token becomes ESC_OPEN + its index + ESC_CLOSE while the template renders
# (private-use characters a template passes through unchanged), and its spelling again after.
ESC_OPEN, ESC_CLOSE = "\U000F0000", "\U000F0001"
_ESCAPED = re.compile(f"{ESC_OPEN}(\\d+){ESC_CLOSE}")

# The reasoning efforts clients send, lowest first ("none" disables thinking and never reaches the
# template as an effort).
EFFORT_LEVELS = ("minimal", "low", "medium", "high", "xhigh", "max")
EFFORTS = ("none", *EFFORT_LEVELS)


@dataclass(slots=True)
class ToolCall:
    """One call of a function. `arguments` is the JSON object text as the model or client wrote it
    (member order kept)."""

    id: str
    name: str
    arguments: str
    namespace: str | None = None  # Responses namespaces; the engine identity is namespace.name


@dataclass(slots=True)
class Message:
    """One turn. role: system, user, assistant or tool (a tool result)."""

    role: str
    content: str = ""
    reasoning: str | None = None  # an assistant turn's reasoning, when it is replayed
    tool_calls: list[ToolCall] = field(default_factory=list)
    tool_call_id: str | None = None  # a tool result: the call it answers
    name: str | None = None  # a tool result: the function's name, when the protocol says it
    is_error: bool = False  # a tool result that reports a failure (Anthropic's is_error)


@dataclass(slots=True)
class Tool:
    """A function the model may call; parameters is its JSON Schema (an object schema)."""

    name: str
    parameters: dict[str, Any]
    description: str | None = None
    namespace: str | None = None
    custom: bool = False  # a free-form (Chat custom) tool: one string parameter, "input"

    @property
    def engine_name(self) -> str:
        """The name the model sees and writes: namespace.name inside a namespace."""
        return f"{self.namespace}.{self.name}" if self.namespace else self.name


@dataclass(slots=True, frozen=True)
class Rendered:
    """A rendered conversation: the prompt text and its token ids."""

    text: str
    ids: list[int]

    @property
    def opens_reasoning(self) -> bool:
        """The generation prompt ends inside an open <think> block: output starts as reasoning."""
        tail = self.text.rstrip()
        return tail.endswith("<think>")


def template_messages(messages: list[Message]) -> list[dict[str, Any]]:
    """The messages as Hugging Face chat templates read them (OpenAI shape, arguments as objects)."""
    out = []
    for m in messages:
        d: dict[str, Any] = {"role": m.role, "content": m.content}
        if m.reasoning:
            d["reasoning_content"] = m.reasoning
        if m.tool_calls:
            d["tool_calls"] = [{"id": c.id, "type": "function",
                                "function": {"name": _call_name(c), "arguments": _arguments(c.arguments)}}
                               for c in m.tool_calls]
        if m.tool_call_id is not None:
            d["tool_call_id"] = m.tool_call_id
        if m.name is not None:
            d["name"] = m.name
        if m.is_error and m.role == "tool":
            d["content"] = "Error: " + m.content  # templates have no error flag; the model reads it
        out.append(d)
    return out


def template_tools(tools: list[Tool]) -> list[dict[str, Any]] | None:
    if not tools:
        return None
    out = []
    for t in tools:
        fn: dict[str, Any] = {"name": t.engine_name}
        if t.description is not None:
            fn["description"] = t.description
        fn["parameters"] = t.parameters
        out.append({"type": "function", "function": fn})
    return out


def _call_name(call: ToolCall) -> str:
    return f"{call.namespace}.{call.name}" if call.namespace else call.name


def _arguments(text: str) -> Any:
    """Arguments as an object for templates that tojson them (member order kept); text that is
    not a JSON object stays text."""
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value if isinstance(value, dict) else text


def template_effort(tokenizer: Tokenizer, effort: str, chat_template: str | None = None) -> str:
    """The effort a template renders for a requested one: the value itself when the template
    accepts it, else the nearest value it accepts (a tie rounds up: on a template that takes low,
    medium and xhigh, high and max render as xhigh, minimal as low). A template that accepts no
    value, or whose acceptance cannot be tried, gets the value as requested."""
    if effort not in EFFORT_LEVELS:
        return effort
    accepted = tokenizer.accepted_efforts(EFFORT_LEVELS, chat_template)
    if not accepted or effort in accepted:
        return effort
    rank = EFFORT_LEVELS.index(effort)
    return min(accepted, key=lambda v: (abs(EFFORT_LEVELS.index(v) - rank), -EFFORT_LEVELS.index(v)))


def render(tokenizer: Tokenizer, messages: list[Message], *, tools: list[Tool] | None = None,
           kwargs: Mapping[str, Any] | None = None, prefill: str | None = None,
           add_generation_prompt: bool = True, chat_template: str | None = None) -> Rendered:
    """Render a conversation with the model's chat template and encode it. `prefill`: a final
    assistant text continued in place (appended after the generation prompt). Raises
    TemplateError when the template fails."""
    specials = tokenizer.special_token_strings
    esc = _Escaper(specials)
    if kwargs and isinstance(kwargs.get("reasoning_effort"), str):
        kwargs = {**kwargs, "reasoning_effort": template_effort(tokenizer, kwargs["reasoning_effort"], chat_template)}
    text = tokenizer.apply_chat_template(esc(template_messages(messages)), tools=esc(template_tools(tools or [])),
                                         add_generation_prompt=add_generation_prompt,
                                         chat_template=chat_template, **esc(dict(kwargs or {})))
    if prefill:
        text += esc(prefill)
    return Rendered(text=esc.restore(text), ids=_encode(tokenizer, text, specials, esc))


def _encode(tokenizer: Tokenizer, text: str, specials: tuple[str, ...], esc: _Escaper) -> list[int]:
    """Special tokens the template wrote -> their ids; the text between them (with quoted
    special spellings restored) -> ordinary tokens, as the tokenizer splits around added tokens."""
    if not specials:
        return tokenizer.encode(esc.restore(text), parse_special=False)
    ids: list[int] = []
    pattern = re.compile("|".join(re.escape(s) for s in sorted(specials, key=len, reverse=True)))
    pos = 0
    for m in pattern.finditer(text):
        if m.start() > pos:
            ids += tokenizer.encode(esc.restore(text[pos:m.start()]), parse_special=False)
        ids += tokenizer.encode(m.group(0), parse_special=True)
        pos = m.end()
    if pos < len(text):
        ids += tokenizer.encode(esc.restore(text[pos:]), parse_special=False)
    return ids


class _Escaper:
    """Replaces special-token spellings in every string of a value with private-use markers."""

    def __init__(self, specials: tuple[str, ...]) -> None:
        self._specials = specials
        self._pattern = re.compile("|".join(re.escape(s) for s in sorted(specials, key=len, reverse=True))) \
            if specials else None
        self._index = {s: i for i, s in enumerate(specials)}

    def __call__(self, value: Any) -> Any:
        if self._pattern is None or value is None:
            return value
        if isinstance(value, str):
            return self._pattern.sub(lambda m: f"{ESC_OPEN}{self._index[m.group(0)]}{ESC_CLOSE}", value)
        if isinstance(value, Mapping):
            return {k: self(v) for k, v in value.items()}
        if isinstance(value, list):
            return [self(v) for v in value]
        return value

    def restore(self, text: str) -> str:
        if self._pattern is None:
            return text
        return _ESCAPED.sub(lambda m: self._specials[int(m.group(1))], text)
