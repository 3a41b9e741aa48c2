"""Structured output at the HTTP edge: the JSON formats each protocol spells, turned into an engine
grammar (--structured-output), generated unconstrained (--unconstrained-response-format), or
refused with response_format_not_supported. A chat-like request also shows the format to the model
as a leading instruction; the grammar enforces validity independently."""
from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Any

from ninfer.engine.chat import Message
from ninfer.errors import RequestError
from ninfer.server.params import bad
from ninfer.server.state import ServerState


@dataclass(slots=True, frozen=True)
class JsonFormat:
    """A constrained output: a JSON Schema value, any JSON object, or (llama.cpp's `grammar`) the
    language of a GBNF grammar."""

    schema: dict[str, Any] | None  # None: any JSON object (when grammar is None too)
    strict: bool
    param: str  # where the request spelled it, for errors
    grammar: str | None = None  # GBNF text: the output is a sentence of it


def request_format(body: dict[str, Any]) -> JsonFormat | None:
    """The one constraint a Chat or raw-prompt body asks for: response_format (json_object with
    llama.cpp's optional schema, or json_schema), llama.cpp's top-level json_schema, or its GBNF
    grammar. Two of them in one request is a 400 naming the second."""
    found = [(name, fmt) for name, fmt in (("response_format", chat_format(body)),
                                           ("json_schema", llamacpp_schema(body)),
                                           ("grammar", gbnf_format(body))) if fmt is not None]
    if len(found) > 1:
        raise bad(found[1][0], f"{found[1][0]} cannot be combined with {found[0][0]}: send one constraint")
    return found[0][1] if found else None


def gbnf_format(body: dict[str, Any]) -> JsonFormat | None:
    """llama.cpp's grammar: GBNF text (root rule `root`); empty is none."""
    grammar = body.get("grammar")
    if grammar is None or grammar == "":
        return None
    if not isinstance(grammar, str):
        raise bad("grammar", "grammar must be a string of GBNF rules")
    return JsonFormat(None, False, "grammar", grammar=grammar)


def chat_format(body: dict[str, Any], name: str = "response_format") -> JsonFormat | None:
    """Chat Completions' response_format: text, json_object or json_schema {name, schema, strict}."""
    fmt = body.get(name)
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or not isinstance(fmt.get("type"), str):
        raise bad(name, f"{name} must be an object with a type")
    kind = fmt["type"]
    if kind == "text":
        return None
    if kind == "json_object":  # llama.cpp: an optional schema beside the type
        schema = fmt.get("schema")
        if schema is not None and not isinstance(schema, dict):
            raise bad(f"{name}.schema", f"{name}.schema must be a JSON Schema object")
        return JsonFormat(schema or None, False, name)
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict):
            raise bad(f"{name}.json_schema", f"{name}.json_schema must be an object with name and schema")
        return _schema_format(spec, f"{name}.json_schema")
    raise bad(f"{name}.type", f"{name}.type must be text, json_object or json_schema")


def responses_format(text: dict[str, Any] | None) -> JsonFormat | None:
    """Responses' flat text.format: text, json_object or json_schema {name, schema, strict}."""
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
        raise bad("text.format", "text.format must be an object with type text, json_object or json_schema")
    if fmt["type"] == "text":
        return None
    if fmt["type"] == "json_object":
        return JsonFormat(None, False, "text.format")
    return _schema_format(fmt, "text.format")


def anthropic_format(output_config: dict[str, Any] | None) -> JsonFormat | None:
    """Anthropic's output_config.format {type: json_schema, schema}: always strict."""
    fmt = (output_config or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema":
        raise bad("output_config.format", "output_config.format must be {\"type\": \"json_schema\", \"schema\": {...}}")
    schema = fmt.get("schema")
    if not isinstance(schema, dict):
        raise bad("output_config.format.schema", "output_config.format.schema must be a JSON Schema object")
    return JsonFormat(schema, True, "output_config.format")


def llamacpp_schema(body: dict[str, Any]) -> JsonFormat | None:
    """llama.cpp's bare json_schema ({} admits any JSON object)."""
    schema = body.get("json_schema")
    if schema is None:
        return None
    if not isinstance(schema, dict):
        raise bad("json_schema", "json_schema must be a JSON Schema object")
    return JsonFormat(schema or None, False, "json_schema")


def _schema_format(spec: dict[str, Any], where: str) -> JsonFormat:
    name = spec.get("name")
    if name is not None and not isinstance(name, str):
        raise bad(f"{where}.name", f"{where}.name must be a string")
    schema = spec.get("schema")
    if not isinstance(schema, dict):
        raise bad(f"{where}.schema", f"{where}.schema must be a JSON Schema object")
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise bad(f"{where}.strict", f"{where}.strict must be a boolean")
    return JsonFormat(schema, bool(strict), where)


def constrain(state: ServerState, fmt: JsonFormat | None) -> Any:
    """The engine grammar for `fmt` (None: unconstrained)."""
    if fmt is None:
        return None
    if state.grammars is None:
        if state.config.unconstrained_response_format:
            return None
        raise RequestError(f"{fmt.param}: constrained output is enforced only on a server started with "
                           "--structured-output (or --unconstrained-response-format to generate it "
                           "unconstrained)", param=fmt.param, code="response_format_not_supported")
    if fmt.grammar is not None:
        return state.grammars.gbnf(fmt.grammar, fmt.param)
    if fmt.schema is None:
        return state.grammars.json_object()
    return state.grammars.json_schema(fmt.schema, f"{fmt.param}.schema", strict=fmt.strict)


def refuse_with_grammar(stop: list[str], ignore_eos: bool, fmt: JsonFormat) -> None:
    """Stop strings could cut the JSON value short, and ignore_eos would run past its end."""
    if stop:
        raise RequestError(f"stop strings cannot be combined with {fmt.param}: the grammar ends the output",
                           param="stop", code="stop_not_supported")
    if ignore_eos:
        raise RequestError(f"ignore_eos cannot be combined with {fmt.param}: the grammar ends the output",
                           param="ignore_eos", code="ignore_eos_not_supported")


def with_instruction(messages: list[Message], fmt: JsonFormat | None) -> list[Message]:
    """The conversation with the format shown to the model first (merged into a leading system turn)."""
    if fmt is None or fmt.grammar is not None:  # a grammar is no JSON to describe
        return messages
    text = "Respond with raw JSON only, without Markdown code fences: " + (
        "one JSON object." if fmt.schema is None else f"a value of this JSON Schema: {json.dumps(fmt.schema)}")
    if messages and messages[0].role == "system":
        return [replace(messages[0], content=f"{text}\n\n{messages[0].content}"), *messages[1:]]
    return [Message("system", text), *messages]
