"""Tool definitions and tool_choice in each protocol's spelling, decoded into the internal
`Tool` list and `ToolChoice`. A forced choice (a named function, or required/any) is enforced
by a grammar over the call (chat_run.py), so the call always parses and its arguments are a
value of the tool's parameters schema.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ninfer.engine.chat import Message, Tool
from ninfer.errors import RequestError
from ninfer.server.chat_request import ToolChoice
from ninfer.server.params import bad, unsupported
from ninfer.server.toolcalls import MALFORMED

EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}
# a free-form custom tool as the model sees it: a function of one string
CUSTOM_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {"input": {"type": "string"}},
                                     "required": ["input"]}


def _name(value: Any, param: str) -> str:
    if not isinstance(value, str) or not value:
        raise bad(param, f"{param} must be a non-empty string")
    if value == MALFORMED:
        raise bad(param, f"{param}: {MALFORMED} is reserved for unreadable calls")
    return value


def _schema(value: Any, param: str) -> dict[str, Any]:
    if value is None:
        return dict(EMPTY_PARAMETERS)
    if not isinstance(value, dict):
        raise bad(param, f"{param} must be a JSON Schema object")
    if value.get("type", "object") != "object":
        raise bad(param, f"{param} must describe an object (type \"object\")")
    return value


def _description(value: Any, param: str) -> str | None:
    if value is not None and not isinstance(value, str):
        raise bad(param, f"{param} must be a string")
    return value


def _unique(tools: list[Tool], param: str) -> list[Tool]:
    seen: set[str] = set()
    for i, t in enumerate(tools):
        if t.engine_name in seen:
            raise bad(f"{param}[{i}]", f"{param}[{i}]: the tool name {t.engine_name!r} is declared twice")
        seen.add(t.engine_name)
    return tools


def _list(value: Any, param: str) -> list[Any]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise bad(param, f"{param} must be an array")
    return value


# ---- OpenAI Chat Completions ----------------------------------------------------------------

def chat_tools(body: dict[str, Any]) -> list[Tool]:
    """tools: [{"type": "function", "function": {name, description, parameters, strict}}]; strict
    is advisory (unforced calls are not constrained)."""
    tools = []
    for i, t in enumerate(_list(body.get("tools"), "tools")):
        p = f"tools[{i}]"
        if not isinstance(t, dict):
            raise bad(p, f"{p} must be an object")
        if t.get("type") == "custom":
            tools.append(_custom_tool(t, p))
            continue
        if t.get("type") != "function":
            raise unsupported("tools", f"{p}.type {t.get('type')!r}: only function and custom tools are supported")
        fn = t.get("function")
        if not isinstance(fn, dict):
            raise bad(f"{p}.function", f"{p}.function must be an object")
        tools.append(Tool(_name(fn.get("name"), f"{p}.function.name"),
                          _schema(fn.get("parameters"), f"{p}.function.parameters"),
                          _description(fn.get("description"), f"{p}.function.description")))
    return _unique(tools, "tools")


def _custom_tool(t: dict[str, Any], p: str) -> Tool:
    """A free-form custom tool, served as a single-string-input function under its own name."""
    spec = t.get("custom")
    if not isinstance(spec, dict):
        raise bad(f"{p}.custom", f"{p}.custom must be an object")
    fmt = spec.get("format")
    if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") != "text"):
        raise unsupported("tools", f"{p}.custom.format: only text input can be provided (grammar formats "
                                   "are not enforced)")
    return Tool(_name(spec.get("name"), f"{p}.custom.name"), dict(CUSTOM_PARAMETERS),
                _description(spec.get("description"), f"{p}.custom.description"), custom=True)


def chat_tool_choice(body: dict[str, Any], tools: list[Tool]) -> ToolChoice:
    """none | auto | required | {"type": "function", "function": {"name"}} | allowed_tools."""
    choice = body.get("tool_choice")
    if choice is None or choice == "auto":
        return ToolChoice("auto")
    if choice == "none":
        return ToolChoice("none")
    if choice == "required":
        return resolve_required(tools, [t.engine_name for t in tools], "tool_choice")
    if isinstance(choice, dict) and choice.get("type") == "function":
        fn = choice.get("function")
        name = _name(fn.get("name") if isinstance(fn, dict) else None, "tool_choice.function.name")
        return resolve_required(tools, [name], "tool_choice.function.name")
    if isinstance(choice, dict) and choice.get("type") == "allowed_tools":
        allowed = choice.get("allowed_tools")
        if not isinstance(allowed, dict):
            raise bad("tool_choice.allowed_tools", "tool_choice.allowed_tools must be an object")
        names = []
        for j, t in enumerate(_list(allowed.get("tools"), "tool_choice.allowed_tools.tools")):
            fn = t.get("function") if isinstance(t, dict) else None
            names.append(_name(fn.get("name") if isinstance(fn, dict) else None,
                               f"tool_choice.allowed_tools.tools[{j}].function.name"))
        return allowed_choice(tools, names, allowed.get("mode"), "tool_choice.allowed_tools")
    if isinstance(choice, dict) and choice.get("type") == "custom":
        spec = choice.get("custom")
        name = _name(spec.get("name") if isinstance(spec, dict) else None, "tool_choice.custom.name")
        if name not in {t.engine_name for t in tools}:
            raise bad("tool_choice.custom.name", f"tool_choice.custom.name: {name!r} is not a declared tool")
        return ToolChoice("auto", (name,))  # advisory narrowing: only that tool becomes a call
    raise bad("tool_choice", "tool_choice must be none, auto, required, a named function or allowed_tools")


# ---- OpenAI Responses -----------------------------------------------------------------------

def responses_tools(body: dict[str, Any]) -> list[Tool]:
    """Direct function definitions and namespace groups of them; strict is advisory."""
    tools: list[Tool] = []
    for i, t in enumerate(_list(body.get("tools"), "tools")):
        p = f"tools[{i}]"
        if not isinstance(t, dict):
            raise bad(p, f"{p} must be an object")
        kind = t.get("type")
        if kind == "function":
            tools.append(_responses_function(t, p, None))
        elif kind == "namespace":
            ns = _name(t.get("name"), f"{p}.name")
            for j, member in enumerate(_list(t.get("tools"), f"{p}.tools")):
                if not isinstance(member, dict) or member.get("type", "function") != "function":
                    raise unsupported("tools", f"{p}.tools[{j}]: a namespace holds function tools only")
                tools.append(_responses_function(member, f"{p}.tools[{j}]", ns))
        else:
            raise unsupported("tools", f"{p}.type {kind!r}: only function tools (and namespaces of them) are "
                                       "supported; hosted, MCP and custom tools need an executor this server lacks")
    return _unique(tools, "tools")


def _responses_function(t: dict[str, Any], p: str, namespace: str | None) -> Tool:
    for name in ("defer_loading", "output_schema"):
        if t.get(name):
            raise unsupported("tools", f"{p}.{name} is not supported")
    return Tool(_name(t.get("name"), f"{p}.name"), _schema(t.get("parameters"), f"{p}.parameters"),
                _description(t.get("description"), f"{p}.description"), namespace)


def responses_tool_choice(body: dict[str, Any], tools: list[Tool]) -> ToolChoice:
    choice = body.get("tool_choice")
    if choice is None or choice == "auto":
        return ToolChoice("auto")
    if choice == "none":
        return ToolChoice("none")
    if choice == "required":
        return resolve_required(tools, [t.engine_name for t in tools], "tool_choice")
    if isinstance(choice, dict) and choice.get("type") == "function":
        name = _name(choice.get("name"), "tool_choice.name")
        ns = choice.get("namespace")
        return resolve_required(tools, [f"{ns}.{name}" if ns else name], "tool_choice.name")
    if isinstance(choice, dict) and choice.get("type") == "allowed_tools":
        names = []
        for j, t in enumerate(_list(choice.get("tools"), "tool_choice.tools")):
            if not isinstance(t, dict) or t.get("type") != "function":
                raise unsupported("tool_choice", f"tool_choice.tools[{j}]: only function tools can be allowed")
            name = _name(t.get("name"), f"tool_choice.tools[{j}].name")
            names.append(f"{t['namespace']}.{name}" if t.get("namespace") else name)
        return allowed_choice(tools, names, choice.get("mode"), "tool_choice")
    raise unsupported("tool_choice", "tool_choice must be auto, none, required, a function or function-only "
                                     "allowed_tools")


# ---- Anthropic Messages ---------------------------------------------------------------------

def anthropic_tools(body: dict[str, Any]) -> list[Tool]:
    """User-defined, non-strict tools: name, description, object input_schema, input_examples."""
    tools = []
    for i, t in enumerate(_list(body.get("tools"), "tools")):
        p = f"tools[{i}]"
        if not isinstance(t, dict):
            raise bad(p, f"{p} must be an object")
        if t.get("type") not in (None, "custom"):
            raise unsupported("tools", f"{p}: Anthropic-provided tool {t.get('type')!r} needs an executor this "
                                       "server lacks")
        for name in ("strict", "defer_loading"):
            if t.get(name):
                raise unsupported("tools", f"{p}.{name} is not supported: its constraint is not available")
        if t.get("allowed_callers") not in (None, ["direct"]):
            raise unsupported("tools", f"{p}.allowed_callers must allow direct model calls")
        schema = _schema(t.get("input_schema"), f"{p}.input_schema")
        description = _description(t.get("description"), f"{p}.description")
        examples = t.get("input_examples")
        if examples:
            if not isinstance(examples, list) or not all(isinstance(e, dict) for e in examples):
                raise bad(f"{p}.input_examples", f"{p}.input_examples must be an array of objects")
            import json
            shown = "\n".join(json.dumps(e, ensure_ascii=False) for e in examples)
            description = f"{description or ''}\n\nExample inputs:\n{shown}".lstrip()
        tools.append(Tool(_name(t.get("name"), f"{p}.name"), schema, description))
    return _unique(tools, "tools")


def anthropic_tool_choice(body: dict[str, Any], tools: list[Tool]) -> tuple[ToolChoice, bool]:
    """tool_choice -> (choice, parallel: not disable_parallel_tool_use)."""
    choice = body.get("tool_choice")
    if choice is None:
        return ToolChoice("auto"), True
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind not in ("auto", "none", "any", "tool"):
        raise bad("tool_choice", "tool_choice must be an object with type auto, none, any or tool")
    disable = choice.get("disable_parallel_tool_use")
    if disable is not None and not isinstance(disable, bool):
        raise bad("tool_choice.disable_parallel_tool_use", "tool_choice.disable_parallel_tool_use must be a boolean")
    parallel = not disable
    if kind in ("auto", "none"):
        return ToolChoice(kind), parallel
    if not tools:
        raise bad("tool_choice", f"tool_choice {kind} needs tools, and none are declared")
    if kind == "any":
        return resolve_required(tools, [t.engine_name for t in tools], "tool_choice"), parallel
    return resolve_required(tools, [_name(choice.get("name"), "tool_choice.name")], "tool_choice.name"), parallel


# ---- shared ---------------------------------------------------------------------------------

def resolve_required(tools: list[Tool], names: list[str], param: str) -> ToolChoice:
    """A forced call of one of `names`, each a declared tool."""
    declared = {t.engine_name for t in tools}
    if not tools:
        raise bad(param, f"{param}: a required tool call needs tools, and none are declared")
    for name in names:
        if name not in declared:
            raise bad(param, f"{param}: {name!r} is not a declared tool ({', '.join(sorted(declared))})")
    return ToolChoice("required", tuple(names))


def allowed_choice(tools: list[Tool], names: list[str], mode: Any, param: str) -> ToolChoice:
    """allowed_tools: auto narrows nothing the parser cannot handle (the template still shows every
    tool; only allowed names become calls), required forces a call of one of them."""
    if mode not in ("auto", "required"):
        raise bad(f"{param}.mode", f"{param}.mode must be auto or required")
    if mode == "required":
        return resolve_required(tools, names, f"{param}.tools")
    declared = {t.engine_name for t in tools}
    for name in names:
        if name not in declared:
            raise bad(f"{param}.tools", f"{param}.tools: {name!r} is not a declared tool")
    return ToolChoice("auto", tuple(names))


def forced_grammar(state: Any, tools: list[Tool], choice: ToolChoice) -> Any:
    """The grammar of a forced call: the Qwen form over the allowed tools' parameter schemas."""
    allowed = [(t.engine_name, t.parameters) for t in tools if t.engine_name in choice.names]
    try:
        return state.tool_grammars().tool_call(allowed)
    except ImportError:
        raise RequestError("tool_choice: forcing a call needs xgrammar, which is not installed", param="tool_choice",
                           code="tool_choice_not_supported") from None


def order_tool_results(turns: list[Message],
                       check: Callable[[list[str], list[str | None], bool], None]) -> list[Message]:
    """The tool results after each assistant turn with calls, matched to the calls by id (their
    names filled in) and put in call order. check(call ids, result ids, a later turn follows) raises
    the protocol's error for results that do not answer the calls."""
    out: list[Message] = []
    i = 0
    while i < len(turns):
        turn = turns[i]
        out.append(turn)
        i += 1
        if turn.role != "assistant" or not turn.tool_calls:
            continue
        j = i
        while j < len(turns) and turns[j].role == "tool":
            j += 1
        results = turns[i:j]
        order = [c.id for c in turn.tool_calls]
        check(order, [r.tool_call_id for r in results], i < len(turns))
        for r in results:
            r.name = turn.tool_calls[order.index(r.tool_call_id)].name if r.tool_call_id in order else None
        out += sorted(results, key=lambda r: order.index(r.tool_call_id) if r.tool_call_id in order else 0)
        i = j
    return out
