"""The JSON Schema subset structured output enforces (spec: Structured output), checked before a
schema reaches XGrammar, which would otherwise read keywords outside it loosely (oneOf as anyOf,
allOf or multipleOf ignored) and enforce something other than what the client asked for.

Supported: type, properties, required, additionalProperties, items, prefixItems, minItems,
maxItems, minLength, maxLength, enum, const, anyOf, pattern, format (date, date-time, time),
minimum, maximum, exclusiveMinimum, exclusiveMaximum, maxProperties, uniqueItems, $defs,
definitions, a local $ref and a reference-free $id; the annotations $schema, title, description,
default, examples and $comment. Everything else (oneOf, allOf, not, if/then/else, multipleOf,
other formats, patternProperties, ...) is refused with a SchemaError naming the keyword's path.
"""
from __future__ import annotations

from typing import Any

from ninfer.engine.errors import SchemaError

ASSERTIONS = frozenset({
    "type", "properties", "required", "additionalProperties", "items", "prefixItems", "minItems", "maxItems",
    "minLength", "maxLength", "enum", "const", "anyOf", "pattern", "format", "minimum", "maximum",
    "exclusiveMinimum", "exclusiveMaximum", "maxProperties", "uniqueItems", "$defs", "definitions", "$ref", "$id",
})
ANNOTATIONS = frozenset({"$schema", "title", "description", "default", "examples", "$comment"})
FORMATS = frozenset({"date", "date-time", "time"})
TYPES = frozenset({"object", "array", "string", "number", "integer", "boolean", "null"})
SCHEMA_DIALECTS = ("https://json-schema.org/draft/2020-12/schema", "http://json-schema.org/draft-07/schema")
INT32_MAX = 2**31 - 1


def check_schema(schema: Any, param: str) -> None:
    """Raise SchemaError (field `param`, message naming the keyword's path) for a schema outside
    the enforced subset."""
    _check(schema, param)


def _fail(path: str, what: str, param: str) -> SchemaError:
    return SchemaError(f"{param} cannot be enforced: {what} (at {path})", field=param)


def _check(node: Any, path: str, *, param: str | None = None) -> None:
    param = param or path
    if isinstance(node, bool):
        return  # true / false schemas
    if not isinstance(node, dict):
        raise _fail(path, "a schema must be an object or a boolean", param)
    for key, value in node.items():
        where = f"{path}.{key}"
        if key not in ASSERTIONS and key not in ANNOTATIONS:
            raise _fail(where, f"the keyword {key!r} is not supported by structured output (supported: "
                               "type, properties, required, additionalProperties, items, prefixItems, "
                               "min/maxItems, min/maxLength, enum, const, anyOf, pattern, format, "
                               "minimum/maximum, $defs, $ref)", param)
        if key == "$schema" and not (isinstance(value, str)
                                     and value.rstrip("#/").startswith(SCHEMA_DIALECTS)):
            raise _fail(where, "$schema must be JSON Schema 2020-12 or draft-07", param)
        elif key == "type":
            kinds = value if isinstance(value, list) else [value]
            if not kinds or not all(isinstance(k, str) and k in TYPES for k in kinds):
                raise _fail(where, f"unsupported type {value!r}: type must be one of {', '.join(sorted(TYPES))} "
                                   "(or an array of them)", param)
        elif key == "format" and value not in FORMATS:
            raise _fail(where, f"format {value!r} is not enforced (supported: date, date-time, time)", param)
        elif key == "$ref" and not (isinstance(value, str) and (value == "#" or value.startswith("#/"))):
            raise _fail(where, "only local references (# or #/...) are supported", param)
        elif key in ("properties", "$defs", "definitions"):
            if not isinstance(value, dict):
                raise _fail(where, f"{key} must be an object of schemas", param)
            for name, sub in value.items():
                _check(sub, f"{where}.{name}", param=param)
        elif key in ("items", "additionalProperties"):
            _check(value, where, param=param)
        elif key in ("prefixItems", "anyOf"):
            if not isinstance(value, list) or not value:
                raise _fail(where, f"{key} must be a non-empty array of schemas", param)
            for i, sub in enumerate(value):
                _check(sub, f"{where}[{i}]", param=param)
        elif key == "required":
            if (not isinstance(value, list) or not all(isinstance(n, str) for n in value)
                    or len(set(value)) != len(value)):
                raise _fail(where, "required must be an array of unique property names", param)
        elif key in ("minItems", "maxItems", "minLength", "maxLength", "maxProperties"):
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= INT32_MAX:
                raise _fail(where, f"{key} must be a non-negative integer that fits 32 bits", param)
        elif key in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise _fail(where, f"{key} must be a number", param)
        elif key == "enum" and (not isinstance(value, list) or not value):
            raise _fail(where, "enum must be a non-empty array", param)
        elif key == "pattern" and not isinstance(value, str):
            raise _fail(where, "pattern must be a string", param)
        elif key == "uniqueItems" and not isinstance(value, bool):
            raise _fail(where, "uniqueItems must be a boolean", param)
    if "$ref" in node and any(k not in ANNOTATIONS and k not in ("$ref", "$defs", "definitions") for k in node):
        raise _fail(path, "$ref cannot have sibling constraints; move them into the referenced schema", param)
