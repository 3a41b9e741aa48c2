"""Tool calling and reasoning end to end: `ninfer serve` on the default model with a Qwen3-style tool
template (--chat-template; its generation prompt opens <think> unless thinking is disabled), driven
with the official openai (Chat and Responses) and anthropic clients. Forced calls come back as
structured calls whose arguments validate against the tool's schema, tool results are accepted in
each protocol's form, and a thinking budget closes reasoning early."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.conftest import QWEN_STYLE_TEMPLATE
from tests.test_server_http import free_port, wait_for_health

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")
jsonschema = pytest.importorskip("jsonschema")

KEY = "agents-secret"
MODEL = "smol-agent"
ROOT = Path(__file__).resolve().parent.parent
# the shipped Qwen3-style tool template: the tests' Qwen-style template whose generation prompt opens
# <think> unless thinking is disabled (Qwen3.5-style)
TEMPLATE = ROOT / "presets" / "templates" / "qwen3-tools.jinja"
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                             "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
CHAT_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                              "parameters": WEATHER}}
OTHER_TOOL = {"type": "function", "function": {"name": "get_time", "description": "Local time in a city",
                                               "parameters": {"type": "object", "properties": {
                                                   "city": {"type": "string", "maxLength": 12}},
                                                   "required": ["city"]}}}
ASK = "What is the weather in Paris?"


REQUEST_LOG: list[Path] = []  # the agent server's --request-log-jsonl


@pytest.fixture(scope="module")
def agent_server(smollm2_artifact: Path, tmp_path_factory: pytest.TempPathFactory):
    assert TEMPLATE.read_text().startswith(QWEN_STYLE_TEMPLATE.split("{%- if add_generation_prompt %}")[0])
    root = tmp_path_factory.mktemp("agents")
    template = TEMPLATE
    port = free_port()
    log = root / "serve.log"
    cmd = [sys.executable, "-m", "ninfer.cli.main", "serve", str(smollm2_artifact), "--port", str(port),
           "--api-key", KEY, "--model-id", MODEL, "--chat-template", str(template), "--max-context", "2048",
           "--greedy", "--request-log-jsonl", str(root / "requests.jsonl")]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    REQUEST_LOG.append(root / "requests.jsonl")
    try:
        wait_for_health(proc, url, log, 600)  # a loaded shared machine can take minutes to load the model
    except BaseException:
        proc.kill()  # never leave a server behind
        raise
    yield url
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0, log.read_text()


def oai(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=300)


def valid(arguments: str | dict, schema: dict = WEATHER) -> dict:
    args = json.loads(arguments) if isinstance(arguments, str) else arguments
    jsonschema.validate(args, schema)
    return args


def test_chat_named_and_required_calls_then_the_result_turn(agent_server: str) -> None:
    c = oai(agent_server)
    messages = [{"role": "user", "content": ASK}]
    for choice in ({"type": "function", "function": {"name": "get_weather"}}, "required"):
        r = c.chat.completions.create(model=MODEL, messages=messages, tools=[CHAT_TOOL, OTHER_TOOL] if choice ==
                                      "required" else [CHAT_TOOL], tool_choice=choice, max_tokens=80)
        msg = r.choices[0].message
        assert r.choices[0].finish_reason == "tool_calls", r
        assert len(msg.tool_calls) == 1 and msg.tool_calls[0].id.startswith("call_")
        call = msg.tool_calls[0]
        valid(call.function.arguments, WEATHER if call.function.name == "get_weather" else
              OTHER_TOOL["function"]["parameters"])
        assert not msg.reasoning_content if hasattr(msg, "reasoning_content") else True
    # the tool result turn: text comes back
    call = msg.tool_calls[0]
    follow = messages + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                         {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'}]
    r = c.chat.completions.create(model=MODEL, messages=follow, tools=[CHAT_TOOL], tool_choice="none",
                                  max_tokens=12, extra_body={"enable_thinking": False})
    assert r.choices[0].message.content and not r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason in ("stop", "length")


def test_chat_stream_sends_argument_deltas(agent_server: str) -> None:
    c = oai(agent_server)
    stream = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": ASK}], tools=[CHAT_TOOL],
                                       tool_choice="required", max_tokens=80, stream=True)
    name, args, finish, ids, deltas = "", "", None, set(), 0
    for chunk in stream:
        for ch in chunk.choices:
            for tc in ch.delta.tool_calls or []:
                assert tc.index == 0
                ids.add(tc.id) if tc.id else None
                name += tc.function.name or ""
                args += tc.function.arguments or ""
                deltas += bool(tc.function.arguments)
            finish = ch.finish_reason or finish
    assert name == "get_weather" and finish == "tool_calls" and len(ids) == 1
    valid(args)
    assert deltas >= 2  # a member at a time (city, unit), not the whole arguments at the end


def test_responses_forced_call_stream_and_function_output_turn(agent_server: str) -> None:
    c = oai(agent_server)
    tool = {"type": "function", "name": "get_weather", "description": "Current weather", "parameters": WEATHER,
            "strict": True}
    r = c.responses.create(model=MODEL, input=ASK, tools=[tool], tool_choice={"type": "function", "name": "get_weather"},
                           max_output_tokens=80)
    calls = [o for o in r.output if o.type == "function_call"]
    assert r.status == "completed" and len(calls) == 1 and calls[0].name == "get_weather"
    assert calls[0].id.startswith("fc_") and calls[0].call_id.startswith("call_")
    valid(calls[0].arguments)
    # streaming: argument deltas join to the terminal Item
    deltas, done = [], None
    with c.responses.stream(model=MODEL, input=ASK, tools=[tool], tool_choice="required",
                            max_output_tokens=80) as stream:
        for event in stream:
            if event.type == "response.function_call_arguments.delta":
                deltas.append(event.delta)
            elif event.type == "response.output_item.done" and event.item.type == "function_call":
                done = event.item
        final = stream.get_final_response()
    assert done is not None and "".join(deltas) == done.arguments and len(deltas) >= 2
    valid(done.arguments)
    assert [o.type for o in final.output] == ["function_call"]
    # the result turn continues the stored response
    follow = c.responses.create(model=MODEL, previous_response_id=r.id, tools=[tool], max_output_tokens=12,
                                reasoning={"effort": "none"},
                                input=[{"type": "function_call_output", "call_id": calls[0].call_id,
                                        "output": '{"temperature": 21}'}])
    assert follow.output_text and not [o for o in follow.output if o.type == "function_call"]


def test_anthropic_forced_tool_use_stream_and_tool_result(agent_server: str) -> None:
    c = anthropic.Anthropic(base_url=agent_server, api_key=KEY, max_retries=0, timeout=300)
    tool = {"name": "get_weather", "description": "Current weather", "input_schema": WEATHER}
    ask = [{"role": "user", "content": ASK}]
    msg = c.messages.create(model="local", max_tokens=80, messages=ask, tools=[tool],
                            tool_choice={"type": "tool", "name": "get_weather"})
    uses = [b for b in msg.content if b.type == "tool_use"]
    assert msg.stop_reason == "tool_use" and len(uses) == 1 and uses[0].name == "get_weather"
    valid(uses[0].input)
    with c.messages.stream(model="local", max_tokens=80, messages=ask, tools=[tool],
                           tool_choice={"type": "any"}) as stream:
        parts = [e.partial_json for e in stream if e.type == "input_json"]
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use" and json.loads("".join(parts)) == final.content[-1].input
    assert len(parts) >= 2  # input_json_delta a member at a time
    valid(final.content[-1].input)
    follow = c.messages.create(model="local", max_tokens=12, tools=[tool], thinking={"type": "disabled"},
                               messages=ask + [{"role": "assistant", "content": [u.model_dump() for u in uses]},
                                               {"role": "user", "content": [{"type": "tool_result",
                                                                             "tool_use_id": uses[0].id,
                                                                             "content": "21 degrees"}]}])
    assert follow.content[0].type == "text" and follow.content[0].text


def test_forced_call_with_requested_thinking_is_refused(agent_server: str) -> None:
    r = httpx.post(agent_server + "/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"}, json={
        "model": MODEL, "messages": [{"role": "user", "content": ASK}], "tools": [CHAT_TOOL],
        "tool_choice": "required", "enable_thinking": True}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["code"] == "tool_choice_not_supported"


def test_thinking_budget_closes_reasoning_in_every_protocol(agent_server: str) -> None:
    c = oai(agent_server)
    r = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Think about 2+2."}],
                                  max_tokens=40, extra_body={"thinking_budget": 6})
    msg = r.choices[0].message
    assert "Considering the limited time" in msg.reasoning_content
    assert "<think>" not in (msg.content or "") and "</think>" not in (msg.content or "")
    assert r.usage.completion_tokens_details.reasoning_tokens >= 6
    # streamed reasoning deltas join to the same reasoning; the answer follows
    stream = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Think about 2+2."}],
                                       max_tokens=40, stream=True, extra_body={"thinking_budget": 6})
    reasoning = content = ""
    for chunk in stream:
        for ch in chunk.choices:
            reasoning += getattr(ch.delta, "reasoning_content", None) or ""
            content += ch.delta.content or ""
    assert reasoning == msg.reasoning_content and content == (msg.content or "")
    # Responses: a reasoning Item before the message; Anthropic: a thinking block with its signature
    resp = c.responses.create(model=MODEL, input="Think about 2+2.", max_output_tokens=40,
                              extra_body={"thinking_budget": 6})
    assert [o.type for o in resp.output][:1] == ["reasoning"]
    assert resp.output[0].content[0].text == msg.reasoning_content
    a = anthropic.Anthropic(base_url=agent_server, api_key=KEY, max_retries=0, timeout=300)
    # budget_tokens >= 1024 with a smaller max_tokens is accepted (the output limit ends thinking first)
    # (4 tokens: greedy SmolLM2 closes its short answer with <|im_end|> by the 8th, which is end_turn)
    m = a.messages.create(model="local", max_tokens=4, messages=[{"role": "user", "content": "Think about 2+2."}],
                          thinking={"type": "enabled", "budget_tokens": 1024, "display": "omitted"})
    block = m.content[0]
    assert m.stop_reason == "max_tokens" and [b.type for b in m.content] == ["thinking"]
    assert block.thinking == "" and block.signature.startswith("ninfer-reasoning.v1:")
    replay = [{"role": "user", "content": "Think about 2+2."},
              {"role": "assistant", "content": [block.model_dump(), {"type": "text", "text": "4"}]},
              {"role": "user", "content": "Thanks"}]
    shown = [{"role": "user", "content": "Think about 2+2."},
             {"role": "assistant", "content": [{"type": "thinking", "thinking": __import__("base64").b64decode(
                 block.signature.split(":", 1)[1]).decode(), "signature": "x"}, {"type": "text", "text": "4"}]},
             {"role": "user", "content": "Thanks"}]
    count = a.messages.count_tokens(model="local", messages=replay, thinking={"type": "disabled"})
    assert count.input_tokens == a.messages.count_tokens(model="local", messages=shown,
                                                          thinking={"type": "disabled"}).input_tokens


def test_openai_agents_sdk_runs_a_function_tool(agent_server: str) -> None:
    """An unchanged Agents SDK app (scripts/agents_sdk_demo.py): a forced get_weather call, the SDK runs
    the tool and sends its output back, and the model answers in text."""
    pytest.importorskip("agents")
    import asyncio
    import importlib.util

    spec = importlib.util.spec_from_file_location("agents_sdk_demo", ROOT / "scripts" / "agents_sdk_demo.py")
    demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demo)
    result = asyncio.run(demo.run(agent_server + "/v1", KEY, MODEL, ASK))
    kinds = [item.type for item in result.new_items]
    assert kinds[:2] == ["tool_call_item", "tool_call_output_item"] and kinds[-1] == "message_output_item", kinds
    assert len(demo.CALLS) == 1 and isinstance(demo.CALLS[0]["city"], str)
    assert isinstance(result.final_output, str) and result.final_output


def test_request_log_records_the_tool_call_parse(agent_server: str) -> None:
    c = oai(agent_server)
    c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": ASK}], tools=[CHAT_TOOL],
                              tool_choice="required", max_tokens=80)
    done = [json.loads(line) for line in REQUEST_LOG[-1].read_text().splitlines()]
    done = [r for r in done if r["event"] == "request_done" and r["protocol"] == "chat"]
    report = done[-1]["result"]["tool_call_parse"]
    assert report["marker_seen"] and report["call_count"] == 1 and report["fallback_reason"] == "none"
    assert not report["malformed_call_reported"]
