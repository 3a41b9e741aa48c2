"""Tool calls in model output, in the Qwen forms and the forms agent harnesses write:

    <tool_call>{"name": N, "arguments": {...}}</tool_call>                       (Qwen JSON)
    <tool_call><function=N><parameter=P>value</parameter></function></tool_call>  (Qwen XML)
    <function=N>...</function>, <function name="N">...</function>, <invoke name="N">...</invoke>
    with <parameter=P>, <parameter name="P"> or <param name="P"> values, bare or inside
    <function_calls>...</function_calls>

Every opening tag is closed by its own kind. A value is text up to its closing tag, where a
closing tag followed by ordinary text is value text and one followed (after whitespace) by "<" or
the end of the output ends the value; balanced nested parameter tags stay value text. An explicit
top-level parameter type decides conversion: string-admitting values stay strings, other typed
values are decoded as JSON; untyped values are JSON when they parse, else strings.

Prose may quote markup before the real call: unless the first marker's region opens with a
complete call, markers are tried in order (at most MAX_MARKERS) and the first region that parses
to the end of the output is the structured turn; earlier markup stays content. A region that opens
a function but does not parse is recovered: complete calls before the failure are kept, the failed
one becomes a call of the reserved malformed_tool_call tool (its arguments say what went wrong, so
the model can retry), and the text after it is dropped; prose after complete calls is dropped
without a reserved call. Only declared tools become calls.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

MALFORMED = "malformed_tool_call"
MAX_MARKERS = 16
MARKERS = ("<tool_call>", "<function_calls>", "<function=", "<function name=", "<invoke name=")
_MARKER = re.compile("|".join(re.escape(m) for m in MARKERS))
_NAME_ATTR = re.compile(r"""\s*name\s*=\s*(?:"([^"]*)"|'([^']*)'|([^\s>]+))\s*>""")
_WS = re.compile(r"\s*")
_JSON_HEAD = re.compile(r'\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"(?:arguments|parameters)"\s*:\s*\{')


@dataclass(slots=True, frozen=True)
class ParsedCall:
    name: str
    arguments: str  # a JSON object, members in the order the model wrote them
    # the parameters in the order read, repeats included (XML forms; None for the JSON form)
    params: tuple[tuple[str, Any], ...] | None = None


@dataclass(slots=True, frozen=True)
class OpenCall:
    """The call a region stopped inside: its declared name and the parameters read before."""

    name: str
    params: tuple[tuple[str, Any], ...]


class Incomplete(Exception):
    """The text ends inside a call (more output may complete it)."""


class Malformed(Exception):
    """The region cannot be read as calls. `reason`: the request log's fallback reason
    (malformed_structure, invalid_tool_name, undeclared_tool, trailing_content)."""

    def __init__(self, message: str, reason: str = "malformed_structure") -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(slots=True)
class Region:
    """What a region starting at a marker parsed to: `calls` before `error` (None: the region ran
    to the end of the text), `opened`: its first item opened a declared function."""

    calls: list[ParsedCall]
    error: str | None
    opened: bool
    incomplete: bool = False  # stopped because the text ended inside a call
    open_call: OpenCall | None = None  # the XML-form call it stopped inside, when its name was read
    reason: str = "none"  # why it failed (the request log's fallback reason); "none" when it did not


def string_admitting(schema: Any) -> bool:
    """Does a parameter schema's explicit top-level type admit a string? (None: untyped.)"""
    if not isinstance(schema, dict) or "type" not in schema:
        return None  # type: ignore[return-value]
    kind = schema["type"]
    return kind == "string" or (isinstance(kind, list) and "string" in kind)


class Parser:
    """Parses tool-call regions against the declared tools: engine name -> parameters schema."""

    def __init__(self, tools: dict[str, dict[str, Any]]) -> None:
        self.tools = tools
        self._final = True  # the region being parsed ends the output
        self._open: OpenCall | None = None  # the XML-form call being read

    # ---- whole output ----

    def parse(self, text: str) -> tuple[str, list[ParsedCall]]:
        """(content, calls) of a finished output."""
        content, calls, _ = self.parse_region(text)
        return content, calls

    def parse_region(self, text: str) -> tuple[str, list[ParsedCall], Region | None]:
        """(content, calls, the region they came from) of a finished output."""
        starts = [m.start() for m in _MARKER.finditer(text)][:MAX_MARKERS]
        regions = [(p, self.region(text[p:], final=True)) for p in starts]
        first = True  # no region opened a function yet (markup that opens none is quoted text)
        for p, region in regions:
            if region.error is None and region.calls:
                return text[:p].rstrip(), region.calls, region
            if region.opened:
                if first and region.calls:  # the first region opens with a complete call: recover it
                    return text[:p].rstrip(), region.calls + self.reported(region), region
                first = False
        for p, region in regions:
            if region.opened:
                return text[:p].rstrip(), region.calls + self.reported(region), region
        return text, [], None

    def reported(self, region: Region) -> list[ParsedCall]:
        """The reserved call a failed region adds: none when only prose followed its calls (that text
        is dropped)."""
        return [] if region.error is None or region.reason == "trailing_content" else [self.malformed(region.error)]

    @staticmethod
    def malformed(error: str | None) -> ParsedCall:
        reason = error or "the tool call could not be read"
        return ParsedCall(MALFORMED, json.dumps({"error": reason + "; write the call again in the documented "
                                                 "format"}, ensure_ascii=False))

    # ---- one region ----

    def region(self, text: str, final: bool) -> Region:
        """Parse calls from a marker at text[0] to the end of the text."""
        calls: list[ParsedCall] = []
        pos = 0
        opened = False
        self._final = final
        self._open = None
        try:
            while True:
                pos = _skip_ws(text, pos)
                if pos == len(text):
                    return Region(calls, None, opened)
                pos = self._item(text, pos, calls)
                opened = True
        except Incomplete:
            if final:
                return Region(calls, "the output ended inside the tool call", opened or self._opens(text),
                              open_call=self._open, reason="malformed_structure")
            return Region(calls, None, opened or self._opens(text), incomplete=True, open_call=self._open)
        except Malformed as e:
            reason = "trailing_content" if e.reason == "malformed_structure" and calls and self._open is None \
                and not _opens_markup(text, pos) else e.reason
            return Region(calls, str(e), opened or self._opens(text), open_call=self._open, reason=reason)

    def _opens(self, text: str) -> bool:
        """Does the region open a declared function (its first call's name is readable)?"""
        m = re.match(r"\s*(?:<tool_call>\s*|<function_calls>\s*)?(?:<function=([^>\s]+)>|<function"
                     r"""\s+name\s*=\s*["']?([^"'>\s]+)|<invoke\s+name\s*=\s*["']?([^"'>\s]+)|\{\s*"name"\s*:\s*"([^"]+)")""",
                     text)
        return bool(m) and next(g for g in m.groups() if g is not None) in self.tools

    def _item(self, text: str, pos: int, calls: list[ParsedCall]) -> int:
        """One call, or a container of calls, appended to `calls` as each completes; -> its end."""
        if _at(text, pos, "<tool_call>"):
            pos = _skip_ws(text, pos + len("<tool_call>"))
            _need(text, pos, 1)
            call, pos = self._json_call(text, pos) if text[pos] == "{" else self._xml_call(text, pos)
            pos = _expect(text, _skip_ws(text, pos), "</tool_call>")
            calls.append(call)
            return pos
        if _at(text, pos, "<function_calls>"):
            pos += len("<function_calls>")
            while True:
                pos = _skip_ws(text, pos)
                if _at(text, pos, "</function_calls>"):
                    return pos + len("</function_calls>")
                call, pos = self._xml_call(text, pos)
                calls.append(call)
        call, pos = self._xml_call(text, pos)
        calls.append(call)
        return pos

    def _json_call(self, text: str, pos: int) -> tuple[ParsedCall, int]:
        try:
            obj, end = json.JSONDecoder().raw_decode(text, pos)
        except ValueError:
            self._open = self._json_members(text, pos)[0]
            if "</tool_call>" not in text[pos:]:
                raise Incomplete() from None
            raise Malformed("the <tool_call> body is not a JSON object") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            raise Malformed('the <tool_call> JSON needs a "name" string and an "arguments" object', "invalid_tool_name")
        name = obj["name"]
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                raise Malformed(f"the arguments of {name} are not a JSON object") from None
        if not isinstance(args, dict):
            raise Malformed(f"the arguments of {name} are not a JSON object")
        self._check_name(name)
        members, whole = self._json_members(text, pos)
        params = members.params if members is not None and whole else tuple(args.items())
        return ParsedCall(name, json.dumps(args, ensure_ascii=False), params), end

    def _json_members(self, text: str, pos: int) -> tuple[OpenCall | None, bool]:
        """The arguments members of a JSON-form call written {"name": N, "arguments": {...}} (N
        declared) that are complete so far, in the order written; and whether its arguments object
        closed. A member is complete once a comma or the closing brace follows its value."""
        m = _JSON_HEAD.match(text, pos)
        if m is None:
            return None, False
        name = json.loads(m.group(1))
        if name not in self.tools:
            return None, False
        decoder = json.JSONDecoder()
        params: list[tuple[str, Any]] = []
        i = _skip_ws(text, m.end())
        if text.startswith("}", i):
            return OpenCall(name, ()), True
        while True:
            try:
                key, i = decoder.raw_decode(text, i)
                i = _skip_ws(text, i)
                if not (isinstance(key, str) and text.startswith(":", i)):
                    break
                value, i = decoder.raw_decode(text, _skip_ws(text, i + 1))
            except ValueError:
                break
            i = _skip_ws(text, i)
            if not text.startswith((",", "}"), i):
                break
            params.append((key, value))
            if text[i] == "}":
                return OpenCall(name, tuple(params)), True
            i = _skip_ws(text, i + 1)
        return OpenCall(name, tuple(params)), False

    def _xml_call(self, text: str, pos: int) -> tuple[ParsedCall, int]:
        if _at(text, pos, "<function="):
            end = _find(text, ">", pos)
            name, close, pos = text[pos + len("<function="):end].strip(), "</function>", end + 1
        elif _at(text, pos, "<function") or _at(text, pos, "<invoke"):
            tag = "function" if _at(text, pos, "<function") else "invoke"
            name, pos = _name_attr(text, pos + 1 + len(tag))
            close = f"</{tag}>"
        else:
            _need(text, pos, len("<function"))
            raise Malformed(f"expected a function call at {text[pos:pos + 40]!r}")
        self._check_name(name)
        schema = self.tools[name]
        values: dict[str, Any] = {}
        params: list[tuple[str, Any]] = []
        while True:
            self._open = OpenCall(name, tuple(params))
            pos = _skip_ws(text, pos)
            if _at(text, pos, close):
                self._open = None
                return ParsedCall(name, json.dumps(values, ensure_ascii=False), tuple(params)), pos + len(close)
            pname, value, pos = _parameter(text, pos, name, self._final)
            values[pname] = _convert(value, (schema.get("properties") or {}).get(pname), name, pname)
            params.append((pname, values[pname]))

    def _check_name(self, name: str) -> None:
        if name not in self.tools:
            raise Malformed(f"{name!r} is not one of the offered tools ({', '.join(self.tools) or 'none'})",
                            "undeclared_tool")


def _parameter(text: str, pos: int, fn: str, final: bool) -> tuple[str, str, int]:
    """One <parameter=P>, <parameter name="P"> or <param name="P"> value -> (name, text, end).
    Before the end of the output (final false) a closing tag that only whitespace follows may still
    turn out to be value text: Incomplete."""
    if _at(text, pos, "<parameter="):
        end = _find(text, ">", pos)
        name, pos, tag = text[pos + len("<parameter="):end].strip(), end + 1, "parameter"
    elif _at(text, pos, "<parameter") or _at(text, pos, "<param"):
        tag = "parameter" if _at(text, pos, "<parameter") else "param"
        name, pos = _name_attr(text, pos + 1 + len(tag))
    else:
        _need(text, pos, len("<parameter"))
        raise Malformed(f"{fn}: expected a parameter or the end of the call at {text[pos:pos + 40]!r}")
    close = f"</{tag}>"
    opener = re.compile(rf"<{tag}(?:=|\s+name\s*=)")
    start, depth, i = pos, 0, pos
    while True:
        c = text.find(close, i)
        o = opener.search(text, i)
        if c < 0:
            raise Incomplete()
        if o is not None and o.start() < c:
            depth += 1
            i = o.end()
            continue
        after = _skip_ws(text, c + len(close))
        if depth:
            depth -= 1
            i = c + len(close)
            continue
        if after == len(text) and not final:
            raise Incomplete()
        if after == len(text) or text[after] == "<":
            value = text[start:c]
            if value.startswith("\n"):
                value = value[1:]
            if value.endswith("\n"):
                value = value[:-1]
            return name, value, c + len(close)
        i = c + len(close)  # a closing tag followed by ordinary text is value text


def _convert(value: str, schema: Any, fn: str, pname: str) -> Any:
    admits = string_admitting(schema)
    if admits:
        return value
    try:
        return json.loads(value)
    except ValueError:
        if admits is None:
            return value  # untyped: text
        raise Malformed(f"{fn}: parameter {pname} must be JSON of type {schema['type']}, got {value[:60]!r}") from None


def _name_attr(text: str, pos: int) -> tuple[str, int]:
    m = _NAME_ATTR.match(text, pos)
    if m is None:
        if ">" not in text[pos:]:
            raise Incomplete()
        raise Malformed(f"expected name=\"...\" at {text[pos:pos + 40]!r}", "invalid_tool_name")
    return next(g for g in m.groups() if g is not None), m.end()


def _opens_markup(text: str, pos: int) -> bool:
    """Does the text at pos (after whitespace) start tool-call markup (as opposed to prose)?"""
    return text.startswith("<", _skip_ws(text, pos))


def _at(text: str, pos: int, s: str) -> bool:
    if text.startswith(s, pos):
        return True
    if len(text) - pos < len(s) and s.startswith(text[pos:]):
        raise Incomplete()
    return False


def _need(text: str, pos: int, n: int) -> None:
    if len(text) - pos < n:
        raise Incomplete()


def _find(text: str, s: str, pos: int) -> int:
    i = text.find(s, pos)
    if i < 0:
        raise Incomplete()
    return i


def _expect(text: str, pos: int, s: str) -> int:
    if not _at(text, pos, s):
        raise Malformed(f"expected {s} at {text[pos:pos + 40]!r}")
    return pos + len(s)


def _skip_ws(text: str, pos: int) -> int:
    return _WS.match(text, pos).end()


def partial_marker(text: str) -> int:
    """Length of the longest suffix of `text` that could still grow into a marker."""
    best = 0
    for m in MARKERS:
        for k in range(min(len(m) - 1, len(text)), best, -1):
            if text.endswith(m[:k]):
                best = k
                break
    return best


def first_marker(text: str, start: int = 0) -> int:
    m = _MARKER.search(text, start)
    return -1 if m is None else m.start()


def parse_report(text: str, calls: list[ParsedCall], region: Region | None) -> dict[str, Any]:
    """The request log's tool_call_parse of a finished output: whether a complete marker was seen,
    the structured calls, repeated parameters (the last value kept), and when the region failed,
    what recovery kept and why (fallback_reason none, malformed_structure, invalid_tool_name,
    undeclared_tool or trailing_content)."""
    failed = region is not None and region.error is not None
    reported = failed and region.reason != "trailing_content"
    kept = [c for c in calls if c.name != MALFORMED]
    return {"marker_seen": first_marker(text) >= 0,
            "call_count": len(kept) + (1 if reported else 0),
            "duplicate_parameters_repaired": sum(len(c.params) - len({n for n, _ in c.params})
                                                 for c in kept if c.params),
            "recovered": failed and bool(region.calls),
            "recovered_call_count": len(region.calls) if failed else 0,
            "malformed_call_reported": reported,
            "trailing_content_dropped": failed and region.error != "the output ended inside the tool call",
            "fallback_reason": region.reason if failed else "none"}


@dataclass(slots=True, frozen=True)
class CallDelta:
    """A step of call `index` in the output: the first names it, `text` extends its arguments,
    `done` ends it (the arguments are then the JSON object the deltas joined to)."""

    index: int
    name: str
    text: str = ""
    done: bool = False


def _member(i: int, name: str, value: Any) -> str:
    """Parameter i of a call as arguments text: joined, the members make json.dumps of the call's
    arguments ("{" before the first, ", " between, "}" after the last)."""
    return ("{" if i == 0 else ", ") + json.dumps(name, ensure_ascii=False) + ": " + json.dumps(value, ensure_ascii=False)


class ToolCallStream:
    """Content text in, (content delta, call deltas) out, as the output grows. Holds only a possible
    marker prefix (and the whitespace before it) and the tool region. A region is committed once its
    first call is complete, or, with `early`, once it has read the first parameter of a call; from
    then on each call streams a parameter at a time (a JSON-form call written {"name": N,
    "arguments": {...}} a member at a time; other JSON spellings come whole). A streamed call that then fails to parse is ended with the parameters read, and the
    reserved malformed_tool_call follows it (the whole-output parse would return only the latter:
    `early` is for streams, where the call cannot be taken back)."""

    def __init__(self, parser: Parser, early: bool = True) -> None:
        self.parser = parser
        self.early = early
        self.text = ""
        self.sent = 0  # content characters released
        self.scan = 0  # markers before this were quoted markup (they opened no function)
        self.region_at: int | None = None  # the committed structured region
        self.calls_sent = 0  # calls ended
        self.params_sent: int | None = None  # the open (started) call's parameters sent; None: none open
        self.done = False
        self.report: dict[str, Any] | None = None  # the request log's tool_call_parse, once final

    def feed(self, text: str, final: bool = False) -> tuple[str, list[CallDelta]]:
        assert not self.done
        self.text += text
        if final:
            self.done = True
        if self.region_at is None:
            hold = self._find_region(final)
            if self.region_at is None:
                if final:
                    content, calls, region = self.parser.parse_region(self.text)
                    self.report = parse_report(self.text, calls, region)
                    return self._release(len(content), content), [d for c in calls for d in self._whole(c)]
                return self._release(hold), []
            content = self._release(len(self.text[:self.region_at].rstrip()))
        else:
            content = ""
        region = self.parser.region(self.text[self.region_at:], final)
        if final:
            self.report = parse_report(self.text, region.calls, region)
        deltas: list[CallDelta] = []
        for call in region.calls[self.calls_sent:]:
            deltas += self._finish(call.name, call.params) if self.params_sent is not None else self._whole(call)
        if region.open_call is not None and (region.incomplete or self.params_sent is not None):
            deltas += self._stream(region.open_call, close=region.error is not None)
        if final:
            deltas += [d for c in self.parser.reported(region) for d in self._whole(c)]
        return content, deltas

    def _whole(self, call: ParsedCall) -> list[CallDelta]:
        """A call not streamed before: named, its arguments, ended."""
        index = self.calls_sent
        self.calls_sent += 1
        return [CallDelta(index, call.name), CallDelta(index, call.name, call.arguments, done=True)]

    def _stream(self, call: OpenCall, close: bool) -> list[CallDelta]:
        """The open call's parameters read since the last feed (`close`: it failed, end it)."""
        if not self.early or (self.params_sent is None and not call.params):
            return []
        deltas = []
        if self.params_sent is None:
            deltas.append(CallDelta(self.calls_sent, call.name))
            self.params_sent = 0
        if close:
            return deltas + self._finish(call.name, call.params)
        text = "".join(_member(i, *call.params[i]) for i in range(self.params_sent, len(call.params)))
        self.params_sent = len(call.params)
        return deltas + ([CallDelta(self.calls_sent, call.name, text)] if text else [])

    def _finish(self, name: str, params: tuple[tuple[str, Any], ...] | None) -> list[CallDelta]:
        """End the streamed call with the parameters not sent yet."""
        params = params or ()
        rest = "".join(_member(i, *params[i]) for i in range(self.params_sent, len(params)))
        index = self.calls_sent
        self.calls_sent += 1
        self.params_sent = None
        return [CallDelta(index, name, rest + ("}" if params else "{}"), done=True)]

    def _find_region(self, final: bool) -> int:
        """Commit the first region that opens with a complete call (or, early, a call with a parameter
        read); -> where content must stop."""
        while True:
            p = first_marker(self.text, self.scan)
            if p < 0:
                return len(self.text) - partial_marker(self.text)
            region = self.parser.region(self.text[p:], final)
            started = self.early and region.incomplete and region.open_call is not None and region.open_call.params
            if (region.calls or started) and not final:
                self.region_at = p
                return p
            if region.error is not None and not region.opened and not region.incomplete:
                self.scan = p + 1  # quoted markup: ordinary text
                continue
            return p

    def _release(self, upto: int, text: str | None = None) -> str:
        text = self.text if text is None else text
        if not self.done:
            upto = len(text[:upto].rstrip())  # whitespace waits: a call may follow it
        if upto <= self.sent:
            return ""
        out = text[self.sent:upto]
        self.sent = upto
        return out
