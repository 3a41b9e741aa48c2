"""Tool-call parsing and the reasoning split on scripted model outputs: every form the spec lists,
quoted markup, recovery with malformed_tool_call, the marker limit, value rules, and streaming at
every chunk boundary (the streamed pieces always join to the aggregate result)."""
from __future__ import annotations

import json
import random

import pytest

from ninfer.engine.chat import Tool
from ninfer.engine.reasoning import ReasoningSplitter
from ninfer.engine.request import OutputEvent
from ninfer.server.chat_output import ChatOutput
from ninfer.server.toolcalls import MALFORMED, MAX_MARKERS, Parser

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                             "opts": {"type": "object"}}, "required": ["city"]}
TOOLS = [Tool("get_weather", WEATHER), Tool("noop", {"type": "object", "properties": {}}),
         Tool("search", {"type": "object", "properties": {"q": {"type": ["string", "null"]}, "n": {}}})]
PARSER = Parser({t.engine_name: t.parameters for t in TOOLS})


def calls(text: str) -> tuple[str, list[tuple[str, dict]]]:
    content, parsed = PARSER.parse(text)
    return content, [(c.name, json.loads(c.arguments)) for c in parsed]


@pytest.mark.parametrize("text", [
    'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>',
    'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\", \\"days\\": 2}"}\n</tool_call>',
    'Sure.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n2\n'
    '</parameter>\n</function>\n</tool_call>',
    'Sure.\n<function=get_weather><parameter=city>Paris</parameter><parameter=days>2</parameter></function>',
    'Sure.\n<function name="get_weather"><parameter name="city">Paris</parameter><param name="days">2</param>'
    '</function>',
    "Sure.\n<invoke name='get_weather'>\n<parameter name=\"city\">Paris</parameter>\n<parameter name=\"days\">2"
    "</parameter>\n</invoke>",
    'Sure.\n<function_calls>\n<invoke name="get_weather">\n<parameter name="city">Paris</parameter>\n'
    '<parameter name="days">2</parameter>\n</invoke>\n</function_calls>\n',
])
def test_every_form_parses_to_the_same_call(text: str) -> None:
    assert calls(text) == ("Sure.", [("get_weather", {"city": "Paris", "days": 2})])


def test_member_order_is_the_model_order() -> None:
    _, parsed = PARSER.parse('<tool_call>{"name": "get_weather", "arguments": {"days": 1, "city": "X"}}</tool_call>')
    assert parsed[0].arguments == '{"days": 1, "city": "X"}'


def test_several_calls_and_containers() -> None:
    text = ('<tool_call>{"name": "noop", "arguments": {}}</tool_call>\n<tool_call>\n<function=get_weather>'
            '<parameter=city>Rome</parameter></function>\n</tool_call>\n<function_calls><invoke name="noop">'
            '</invoke><invoke name="search"><param name="q">x</param></invoke></function_calls>')
    assert calls(text) == ("", [("noop", {}), ("get_weather", {"city": "Rome"}), ("noop", {}),
                                ("search", {"q": "x"})])


def test_value_rules() -> None:
    # string-admitting types stay strings; other typed values are JSON; untyped JSON when it parses
    _, got = calls('<function=search><parameter=q>42</parameter><parameter=n>[1, 2]</parameter></function>')
    assert got == [("search", {"q": "42", "n": [1, 2]})]
    _, got = calls('<function=search><parameter=n>plain words</parameter></function>')
    assert got == [("search", {"n": "plain words"})]
    _, got = calls('<function=get_weather><parameter=opts>{"a": [1]}</parameter></function>')
    assert got == [("get_weather", {"opts": {"a": [1]}})]
    # markup and a closing tag followed by ordinary text stay value text; balanced nesting too
    value = 'see <tool_call> and </parameter> here, <parameter=x>inner</parameter> ok'
    _, got = calls(f'<function=get_weather><parameter=city>{value}</parameter></function>')
    assert got == [("get_weather", {"city": value})]


def test_typed_value_that_is_not_json_is_malformed() -> None:
    content, got = calls('<function=get_weather><parameter=city>A</parameter><parameter=days>two</parameter></function>')
    assert content == "" and got[0][0] == MALFORMED and "days" in got[0][1]["error"]


def test_quoted_markup_before_the_real_call_stays_content() -> None:
    text = ('Write <tool_call> tags or <function=get_weather> like this.\n'
            '<tool_call>{"name": "noop", "arguments": {}}</tool_call>')
    content, got = calls(text)
    assert content == "Write <tool_call> tags or <function=get_weather> like this." and got == [("noop", {})]


def test_markup_that_opens_no_function_is_text() -> None:
    text = "A <tool_call> is how calls look, and <invoke name=\"unknown\"> too."
    assert calls(text) == (text, [])


def test_recovery_keeps_complete_calls_and_drops_the_rest() -> None:
    text = ('<tool_call>{"name": "noop", "arguments": {}}</tool_call>\n<tool_call>{"name": "get_weather", '
            '"arguments": {"city": }}</tool_call> trailing words')
    content, got = calls(text)
    assert content == "" and [n for n, _ in got] == ["noop", MALFORMED]
    assert "JSON" in got[1][1]["error"]
    # prose after complete calls is dropped without a reserved call
    assert calls('Sure.\n<tool_call>{"name": "noop", "arguments": {}}</tool_call>\nI will wait for it.') == \
        ("Sure.", [("noop", {})])
    # an opened call that never closes
    content, got = calls("Let me check.\n<function=get_weather><parameter=city>Paris")
    assert content == "Let me check." and got[0][0] == MALFORMED and "ended" in got[0][1]["error"]


def test_marker_limit() -> None:
    quoted = "<tool_call> " * (MAX_MARKERS - 1)
    real = '<tool_call>{"name": "noop", "arguments": {}}</tool_call>'
    assert calls(quoted + real)[1] == [("noop", {})]
    assert calls(quoted + "<tool_call> " + real)[1] == []  # the 17th marker is never tried


SCRIPTS = [
    'Plain answer with <b>tags</b> and no calls.',
    'Checking.\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
    'Quote: <tool_call> is a tag.\n<function=noop></function>\n<function=get_weather><parameter=city>Oslo'
    '</parameter></function>',
    '<function_calls><invoke name="search"><parameter name="q">a</parameter></invoke></function_calls>',
    '<tool_call>{"name": "noop", "arguments": {}}</tool_call><tool_call>{"name": "bad"}</tool_call> more',
    'Text then a stray <invo and <tool_ca',
    'Go.\n<function=get_weather><parameter=city>Oslo</parameter></function>\nDone, waiting for the result.',
]


def _events(text: str, cuts: list[int]) -> list[OutputEvent]:
    bounds = [0, *cuts, len(text)]
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    events = [OutputEvent("r", text=p) for p in pieces[:-1]]
    return events + [OutputEvent("r", text=pieces[-1], finish_reason="stop")]


def _run(events: list[OutputEvent], parallel: bool = True) -> tuple[ChatOutput, list]:
    out = ChatOutput(TOOLS, parallel)
    pieces = []
    for e in events:
        pieces += out.feed(e)
    return out, pieces


@pytest.mark.parametrize("script", SCRIPTS)
def test_streaming_at_every_boundary_matches_the_aggregate(script: str) -> None:
    whole, _ = _run(_events(script, []))
    content, parsed = PARSER.parse(script)
    assert whole.result.content == content and [c.name for c in whole.result.tool_calls] == [c.name for c in parsed]
    rng = random.Random(0)
    splits = [[i] for i in range(1, len(script))] + [sorted(rng.sample(range(1, len(script)), 5)) for _ in range(20)] \
        + [list(range(1, len(script)))]  # one character at a time
    for cuts in splits:
        out, pieces = _run(_events(script, cuts))
        r = out.result
        assert "".join(p.text for p in pieces if p.kind == "content") == r.content == content, cuts
        assert [(c.name, c.arguments) for c in r.tool_calls] == [(c.name, c.arguments) for c in parsed], cuts
        for i, call in enumerate(r.tool_calls):  # argument deltas join to the final arguments
            assert "".join(p.text for p in pieces if p.kind == "tool_args" and p.index == i) == call.arguments
            kinds = [p.kind for p in pieces if p.index == i and p.kind.startswith("tool")]
            assert kinds[0] == "tool_start" and kinds[-1] == "tool_done"


def test_content_streams_before_the_call_and_only_a_marker_prefix_is_held() -> None:
    out = ChatOutput(TOOLS)
    assert [p.text for p in out.feed(OutputEvent("r", text="Hello there <tool"))] == ["Hello there"]
    assert [p.text for p in out.feed(OutputEvent("r", text="kit is a word"))] == [" <toolkit is a word"]


def test_first_complete_call_is_released_before_the_end() -> None:
    out = ChatOutput(TOOLS)
    pieces = out.feed(OutputEvent("r", text='<tool_call>{"name": "noop", "arguments": {}}</tool_call>\n<tool'))
    assert [p.kind for p in pieces] == ["tool_start", "tool_args", "tool_done"]


def test_parallel_false_keeps_the_first_call() -> None:
    out, _ = _run(_events(SCRIPTS[4], []), parallel=False)
    assert [c.name for c in out.result.tool_calls] == ["noop"] and out.result.finish_reason == "tool_calls"


# ---- the reasoning split ---------------------------------------------------------------------

REASONING = [
    ("<think>\nplan it\n</think>\n\nThe answer.", False, "plan it\n", "The answer."),
    ("  <think>a</think>\nb", False, "a", "b"),
    ("step </think>, quoted</think>\n\nfinal", True, "step </think>, quoted", "final"),
    ("no reasoning at all", False, "", "no reasoning at all"),
    ("<thinking is a word", False, "", "<thinking is a word"),
    ("still thinking when cut", True, "still thinking when cut", ""),
    ("x</think>", True, "x", ""),
]


@pytest.mark.parametrize("text, opens, reasoning, content", REASONING)
def test_reasoning_split_at_every_boundary(text: str, opens: bool, reasoning: str, content: str) -> None:
    for cut in range(len(text) + 1):
        for step in (1, 3):
            s = ReasoningSplitter(opens)
            chunks = [text[:cut]] + [text[i:i + step] for i in range(cut, len(text), step)]
            got_r, got_c = "", ""
            for i, chunk in enumerate(chunks):
                r, c = s.feed(chunk, final=i == len(chunks) - 1)
                got_r, got_c = got_r + r, got_c + c
            assert (got_r, got_c) == (reasoning, content), (cut, step)


# ---- tool definitions and tool_choice per protocol ---------------------------------------------

def test_tool_decoders_and_choices() -> None:
    from ninfer.errors import RequestError
    from ninfer.server.tools import (CUSTOM_PARAMETERS, anthropic_tool_choice, anthropic_tools, chat_tool_choice,
                                     chat_tools, responses_tool_choice, responses_tools)

    body = {"tools": [{"type": "function", "function": {"name": "f", "parameters": WEATHER}},
                      {"type": "custom", "custom": {"name": "patch", "description": "apply a patch"}}]}
    tools = chat_tools(body)
    assert [(t.name, t.custom) for t in tools] == [("f", False), ("patch", True)]
    assert tools[1].parameters == CUSTOM_PARAMETERS
    assert chat_tool_choice({"tool_choice": "required"}, tools).names == ("f", "patch")
    assert chat_tool_choice({"tool_choice": {"type": "function", "function": {"name": "f"}}}, tools).names == ("f",)
    allowed = {"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": [{"type": "function",
                                                                                      "function": {"name": "f"}}]}}
    assert chat_tool_choice({"tool_choice": allowed}, tools).names == ("f",)
    for bad_choice in ({"type": "function", "function": {"name": "g"}}, "sometimes"):
        with pytest.raises(RequestError):
            chat_tool_choice({"tool_choice": bad_choice}, tools)
    with pytest.raises(RequestError) as e:
        chat_tool_choice({"tool_choice": "required"}, [])
    assert e.value.param == "tool_choice"
    ns = responses_tools({"tools": [{"type": "namespace", "name": "mcp__w", "tools": [
        {"type": "function", "name": "get"}]}, {"type": "function", "name": "get", "strict": True}]})
    assert [t.engine_name for t in ns] == ["mcp__w.get", "get"]
    assert responses_tool_choice({"tool_choice": {"type": "function", "name": "get", "namespace": "mcp__w"}},
                                 ns).names == ("mcp__w.get",)
    with pytest.raises(RequestError) as e:
        responses_tools({"tools": [{"type": "file_search"}]})
    assert e.value.code == "tools_not_supported"
    a = anthropic_tools({"tools": [{"name": "f", "input_schema": WEATHER, "input_examples": [{"city": "Oslo"}]}]})
    assert "Example inputs" in a[0].description
    choice, parallel = anthropic_tool_choice({"tool_choice": {"type": "any", "disable_parallel_tool_use": True}}, a)
    assert choice.names == ("f",) and not parallel


def test_namespaced_calls_restore_the_namespace() -> None:
    tools = [Tool("get", {"type": "object", "properties": {}}, namespace="mcp__w")]
    out = ChatOutput(tools)
    out.feed(OutputEvent("r", text='<tool_call>{"name": "mcp__w.get", "arguments": {}}</tool_call>',
                         finish_reason="stop"))
    call = out.result.tool_calls[0]
    assert (call.namespace, call.name, call.arguments) == ("mcp__w", "get", "{}")


# ---- per-parameter argument deltas -----------------------------------------------------------

XML_CALLS = [  # one call of get_weather in each XML form, then the same call again
    '<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n2\n</parameter>\n'
    '</function>\n</tool_call>',
    '<function=get_weather><parameter=city>Paris</parameter><parameter=days>2</parameter></function>',
    '<function name="get_weather"><parameter name="city">Paris</parameter><param name="days">2</param></function>',
    '<function_calls>\n<invoke name="get_weather">\n<parameter name="city">Paris</parameter>\n'
    '<parameter name="days">2</parameter>\n</invoke>\n</function_calls>',
]
TWO_INVOKES = ('<function_calls>\n<invoke name="get_weather">\n<parameter name="city">Paris</parameter>\n'
               '<parameter name="days">2</parameter>\n</invoke>\n<invoke name="search"><parameter name="q">x'
               '</parameter><parameter name="n">[1]</parameter></invoke></function_calls>')


def _replay(text: str, stream: bool = True, step: int = 1) -> tuple[ChatOutput, list[tuple[int, object]]]:
    """Feed `text` `step` characters at a time; -> the output and (characters fed, piece) pairs."""
    out = ChatOutput(TOOLS, stream=stream)
    got = []
    for at in range(0, len(text), step):
        chunk = text[at:at + step]
        final = at + step >= len(text)
        for p in out.feed(OutputEvent("r", text=chunk, finish_reason="stop" if final else None)):
            got.append((min(at + step, len(text)), p))
    return out, got


@pytest.mark.parametrize("form", XML_CALLS)
def test_xml_calls_stream_a_parameter_at_a_time(form: str) -> None:
    script = "Let me check.\n" + form + "\n" + form
    out, got = _replay(script)
    r = out.result
    assert r.content == "Let me check." and len(r.tool_calls) == 2
    assert [c.arguments for c in r.tool_calls] == ['{"city": "Paris", "days": 2}'] * 2
    for index, start in ((0, script.index(form)), (1, script.rindex(form))):
        end = start + len(form)
        args = [(at, p.text) for at, p in got if p.kind == "tool_args" and p.index == index]
        assert [t for _, t in args] == ['{"city": "Paris"', ', "days": 2', '}']
        # each parameter is sent as soon as what follows its closing tag shows the value ended
        city_close = script.index("</param", start) + len("</parameter>" if "</parameter>" in form else "</param>")
        assert start < args[0][0] <= script.index("<", city_close) + 1
        assert args[1][0] < end  # the second before the call's closing tag
        starts = [at for at, p in got if p.kind == "tool_start" and p.index == index]
        assert starts == [args[0][0]]
    # the stream's result is the whole-output parse
    assert [(c.name, c.arguments) for c in r.tool_calls] == [(c.name, c.arguments) for c in PARSER.parse(script)[1]]


@pytest.mark.parametrize("script", [*SCRIPTS, *("Sure.\n" + f for f in XML_CALLS), TWO_INVOKES,
                                    TWO_INVOKES.replace("</function_calls>", "")])
def test_argument_deltas_join_at_every_chunk_size(script: str) -> None:
    content, parsed = PARSER.parse(script)
    for step in range(1, 9):
        out, got = _replay(script, step=step)
        r = out.result
        assert r.content == content and [(c.name, c.arguments) for c in r.tool_calls] == \
            [(c.name, c.arguments) for c in parsed], step
        for i, call in enumerate(r.tool_calls):
            assert "".join(p.text for _, p in got if p.kind == "tool_args" and p.index == i) == call.arguments
            kinds = [p.kind for _, p in got if p.index == i and p.kind.startswith("tool")]
            assert kinds.count("tool_start") == kinds.count("tool_done") == 1
            assert kinds[0] == "tool_start" and kinds[-1] == "tool_done"


def test_a_value_closing_tag_followed_by_text_is_not_the_end_while_streaming() -> None:
    out = ChatOutput(TOOLS)
    pieces = out.feed(OutputEvent("r", text="<function=get_weather><parameter=city>A</parameter>"))
    assert pieces == []  # what follows decides: nothing is sent yet
    pieces = out.feed(OutputEvent("r", text=" and B</parameter>\n<parameter=days>3</parameter>"))
    assert [(p.kind, p.text) for p in pieces] == [("tool_start", ""), ("tool_args", '{"city": "A</parameter> and B"')]
    pieces = out.feed(OutputEvent("r", text="</function>", finish_reason="stop"))
    assert [(p.kind, p.text) for p in pieces] == [("tool_args", ', "days": 3}'), ("tool_done", "")]


def test_a_streamed_call_that_fails_is_ended_and_followed_by_malformed_tool_call() -> None:
    script = "<function=get_weather><parameter=city>Paris</parameter><parameter=days>two</parameter></function>"
    # the whole-output parse (non-streaming requests): only the reserved call, as the spec says
    whole, _ = _replay(script, stream=False)
    assert [c.name for c in whole.result.tool_calls] == [MALFORMED]
    # a stream already sent get_weather and its city: it is ended with what was read, then the error
    out, got = _replay(script)
    calls = out.result.tool_calls
    assert [(c.name, c.arguments) for c in calls[:1]] == [("get_weather", '{"city": "Paris"}')]
    assert calls[1].name == MALFORMED and "days" in json.loads(calls[1].arguments)["error"]
    # the output ending inside a streamed call
    out, _ = _replay("<function=get_weather><parameter=city>Paris</parameter><parameter=days>2")
    assert [(c.name, c.arguments) for c in out.result.tool_calls][:1] == [("get_weather", '{"city": "Paris"}')]
    assert out.result.tool_calls[1].name == MALFORMED


def test_a_repeated_parameter_streams_again_and_parses_to_its_last_value() -> None:
    script = "<function=get_weather><parameter=city>A</parameter><parameter=city>B</parameter></function>"
    out, _ = _replay(script)
    assert out.result.tool_calls[0].arguments == '{"city": "A", "city": "B"}'
    assert json.loads(out.result.tool_calls[0].arguments) == json.loads(PARSER.parse(script)[1][0].arguments)


def test_non_streaming_output_sends_each_call_whole() -> None:
    out, got = _replay("x\n" + XML_CALLS[0], stream=False)
    assert [p.kind for _, p in got if p.kind.startswith("tool")] == ["tool_start", "tool_args", "tool_done"]


JSON_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2, "opts": {"a": [1, "}"]}}}\n</tool_call>'


def test_json_calls_stream_a_member_at_a_time() -> None:
    script = "Checking.\n" + JSON_CALL
    out, got = _replay(script)
    assert out.result.content == "Checking."
    args = [(at, p.text) for at, p in got if p.kind == "tool_args"]
    assert [t for _, t in args] == ['{"city": "Paris"', ', "days": 2', ', "opts": {"a": [1, "}"]}', '}']
    assert args[0][0] == script.index('"Paris"') + len('"Paris",')  # once the comma shows the value ended
    assert args[1][0] == script.index("2,") + 2
    assert out.result.tool_calls[0].arguments == PARSER.parse(script)[1][0].arguments
    for step in range(1, 9):
        out, got = _replay(script + "\n" + JSON_CALL.replace("Paris", "Oslo"), step=step)
        calls = out.result.tool_calls
        assert [json.loads(c.arguments)["city"] for c in calls] == ["Paris", "Oslo"], step
        for i, call in enumerate(calls):
            assert "".join(p.text for _, p in got if p.kind == "tool_args" and p.index == i) == call.arguments


@pytest.mark.parametrize("script", [
    '<tool_call>{"arguments": {"city": "Paris"}, "name": "get_weather"}</tool_call>',  # name last: whole
    '<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}</tool_call>',  # a string
    '<tool_call>{"name": "unknown", "arguments": {"city": "Paris"}}</tool_call>',
    '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "days": 2 oops}}</tool_call>',
])
def test_other_json_spellings_at_every_boundary(script: str) -> None:
    content, parsed = PARSER.parse(script)
    for step in (1, 2, 5):
        out, got = _replay(script, step=step)
        r = out.result
        if parsed and parsed[0].name == MALFORMED:  # a started call that fails stays, the error follows
            assert [c.name for c in r.tool_calls][-1] == MALFORMED
            continue
        assert r.content == content and [(c.name, c.arguments) for c in r.tool_calls] == \
            [(c.name, c.arguments) for c in parsed]


# ---- the request log's tool_call_parse -------------------------------------------------------

@pytest.mark.parametrize("script, stream, expect", [
    ("Plain text.", True, {"marker_seen": False, "call_count": 0, "fallback_reason": "none"}),
    (XML_CALLS[1], True, {"marker_seen": True, "call_count": 1, "malformed_call_reported": False}),
    ('<function=get_weather><parameter=city>A</parameter><parameter=city>B</parameter></function>', False,
     {"call_count": 1, "duplicate_parameters_repaired": 1}),
    ('<tool_call>{"name": "noop", "arguments": {}}</tool_call> and then some prose', False,
     {"call_count": 1, "recovered": True, "recovered_call_count": 1, "malformed_call_reported": False,
      "trailing_content_dropped": True, "fallback_reason": "trailing_content"}),
    ('<tool_call>{"name": "noop", "arguments": {}}</tool_call><tool_call>{"name": "nope", "arguments": {}}'
     '</tool_call>', True, {"recovered": True, "call_count": 2, "fallback_reason": "undeclared_tool"}),
    ('<function=get_weather><parameter=city>Paris', True,
     {"recovered": False, "malformed_call_reported": True, "trailing_content_dropped": False,
      "fallback_reason": "malformed_structure"}),
])
def test_tool_call_parse_report(script: str, stream: bool, expect: dict) -> None:
    for step in (1, len(script)):
        out, _ = _replay(script, stream=stream, step=step)
        report = out.log_fields()["tool_call_parse"]
        assert {k: report[k] for k in expect} == expect, step
    assert ChatOutput().log_fields() == {"tool_call_parse": None}
