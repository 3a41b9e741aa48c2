"""Server pieces that need no model: path folding, field validation, config, bind checks."""
from __future__ import annotations

import socket

import pytest

from ninfer.engine.chat import Message
from ninfer.engine.errors import (ContextLengthExceeded, DuplicateRequest, EngineError, EngineNotRunning,
                                  EngineOverloaded, InvalidRequest, SchemaError, TemplateError, TokenOutOfRange)
from ninfer.engine.request import SamplingParams
from ninfer.errors import ConfigError, RequestError
from ninfer.server.app import normalize_path
from ninfer.server.config import SamplerOverrides, ServerConfig
from ninfer.server.generate import session_digest
from ninfer.server.llamacpp import _select
from ninfer.server.openai_chat import check_capabilities, normalize_messages, template_kwargs
from ninfer.server.params import (check_id_slot, check_llamacpp_neutral, check_logit_bias, parse_stop,
                                  sampling_from)
from ninfer.server.runner import api_base, check_bindable


def test_normalize_path_folds_doubled_v1() -> None:
    assert normalize_path("/v1/v1/chat/completions") == "/v1/chat/completions"
    assert normalize_path("/v1/v1") == "/v1"
    assert normalize_path("/v1/models/") == "/v1/models"
    assert normalize_path("/health") == "/health"
    assert normalize_path("/v1/v1x") == "/v1/v1x"


def test_api_base_announces_wildcards_through_loopback() -> None:
    assert api_base("0.0.0.0", 8080) == "http://127.0.0.1:8080/v1"
    assert api_base("::", 9000) == "http://[::1]:9000/v1"
    assert api_base("192.168.1.5", 80) == "http://192.168.1.5:80/v1"


def test_check_bindable_reports_a_taken_port() -> None:
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen(1)
    port = holder.getsockname()[1]
    try:
        with pytest.raises(ConfigError, match=f"--port {port}: .*already in use"):
            check_bindable("127.0.0.1", port)
    finally:
        holder.close()
    check_bindable("127.0.0.1", port)  # free again


@pytest.mark.parametrize("kwargs, option", [
    ({"port": 0}, "--port"), ({"max_request_mib": 0}, "--max-request-mib"),
    ({"log_level": "loud"}, "--log-level"), ({"api_key": " "}, "--api-key"),
    ({"stats_port": 8080}, "--stats-port"), ({"default_max_tokens": 0}, "--default-max-tokens"),
])
def test_server_config_names_the_bad_option(kwargs: dict, option: str) -> None:
    with pytest.raises(ConfigError, match=option):
        ServerConfig(**kwargs)


@pytest.mark.parametrize("kwargs, option", [
    ({"temperature": 3.0}, "--temperature"), ({"top_p": 1.5}, "--top-p"), ({"top_k": 21}, "--top-k"),
    ({"min_p": -0.1}, "--min-p"), ({"presence_penalty": 2.5}, "--presence-penalty"),
])
def test_sampler_overrides_name_the_bad_option(kwargs: dict, option: str) -> None:
    with pytest.raises(ConfigError, match=option):
        SamplerOverrides(**kwargs)


def test_sampling_merge_order() -> None:
    base = SamplingParams(temperature=0.7, top_k=10, top_p=0.9, seed=5)
    s = sampling_from({"temperature": 0.2, "top_k": 40}, base, greedy=False)
    assert (s.temperature, s.top_k, s.top_p, s.seed) == (0.2, 20, 0.9, 5)  # top_k clamped to 20
    s = sampling_from({"temperature": -1, "top_k": 0, "seed": -3}, base, greedy=False)
    assert (s.temperature, s.top_k, s.seed) == (0.0, 20, None)  # negative: greedy, widest, random seed
    assert sampling_from({"temperature": 1.5}, base, greedy=True).temperature == 0.0


@pytest.mark.parametrize("body, param", [
    ({"top_p": 1.5}, "top_p"), ({"min_p": "0.1"}, "min_p"), ({"top_k": 2.5}, "top_k"),
    ({"temperature": True}, "temperature"), ({"presence_penalty": 3}, "presence_penalty"),
    ({"seed": "x"}, "seed"), ({"seed": 2**70}, "seed"),
])
def test_sampling_field_errors_name_the_field(body: dict, param: str) -> None:
    with pytest.raises(RequestError) as e:
        sampling_from(body, SamplingParams(), greedy=False)
    assert e.value.param == param and e.value.status == 400


def test_parse_stop() -> None:
    assert parse_stop("a", 4) == ["a"]
    assert parse_stop(["a", "b", "a"], 4) == ["a", "b"]
    for bad in (["1", "2", "3", "4", "5"], [""], [1], {"x": 1}):
        with pytest.raises(RequestError):
            parse_stop(bad, 4)


def test_logit_bias_only_neutral() -> None:
    check_logit_bias({"12": 0, "7": 0.0})
    check_logit_bias([[12, 0]])
    with pytest.raises(RequestError) as e:
        check_logit_bias({"12": 1})
    assert e.value.code == "logit_bias_not_supported"
    with pytest.raises(RequestError):
        check_logit_bias([[12, False]])


@pytest.mark.parametrize("field, neutral, other", [
    ("repeat_penalty", 1, 1.1), ("typical_p", 1, 0.5), ("mirostat", 0, 2), ("top_n_sigma", -1, 1),
    ("n_probs", 0, 3), ("t_max_predict_ms", 0, 100), ("dry_multiplier", 0, 0.8),
])
def test_llamacpp_controls_only_at_neutral(field: str, neutral: float, other: float) -> None:
    check_llamacpp_neutral({field: neutral})
    with pytest.raises(RequestError) as e:
        check_llamacpp_neutral({field: other})
    assert e.value.code == f"{field}_not_supported" and e.value.param == field


def test_id_slot_names_a_context_cache_slot() -> None:
    for body in ({}, {"id_slot": None}, {"id_slot": -1}, {"id_slot": 0}, {"id_slot": 3.0}):
        check_id_slot(body, 4)
    for body, num_slots, code in (({"id_slot": 4}, 4, "invalid_slot"), ({"id_slot": 0}, 0, "invalid_slot"),
                                  ({"id_slot": -2}, 4, "invalid_value"), ({"id_slot": True}, 4, "invalid_value"),
                                  ({"id_slot": "1"}, 4, "invalid_value")):
        with pytest.raises(RequestError) as e:
            check_id_slot(body, num_slots)
        assert (e.value.param, e.value.code) == ("id_slot", code), body


def test_messages_normalized_and_media_refused() -> None:
    msgs = normalize_messages([
        {"role": "developer", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "user", "content": ""},
        {"role": "tool", "content": "r", "name": "fn", "tool_call_id": "c1"},
    ])
    assert msgs == [Message("system", "ab"), Message("user", ""), Message("tool", "r", tool_call_id="c1")]
    with pytest.raises(RequestError) as e:
        normalize_messages([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])
    assert e.value.code == "vision_disabled" and e.value.param == "messages[0].content[0]"
    with pytest.raises(RequestError) as e:
        normalize_messages([{"role": "user", "content": "x", "name": "bob"}])
    assert e.value.param == "messages[0].name"
    with pytest.raises(RequestError):
        normalize_messages([{"role": "robot", "content": "x"}])
    # legacy function-call history: the assistant's function_call and the function's result
    msgs = normalize_messages([{"role": "user", "content": "q"},
                               {"role": "assistant", "content": None, "function_call": {"name": "f", "arguments": "{}"}},
                               {"role": "function", "name": "f", "content": "2"}])
    assert [(c.name, c.arguments) for c in msgs[1].tool_calls] == [("f", "{}")]
    assert (msgs[2].role, msgs[2].name, msgs[2].content) == ("tool", "f", "2")
    with pytest.raises(RequestError) as e:
        normalize_messages([{"role": "assistant", "content": None, "function_call": {"arguments": "{}"}}])
    assert e.value.param == "messages[0].function_call.name"


@pytest.mark.parametrize("body, code", [
    ({"n": 2}, "n_not_supported"), ({"logit_bias": {"5": 2}}, "logit_bias_not_supported"),
    ({"guided_json": {"type": "object"}}, "guided_json_not_supported"),
    ({"guided_grammar": "root ::= x"}, "guided_grammar_not_supported"),
    ({"audio": {"voice": "x"}}, "audio_not_supported"), ({"store": True}, "store_not_supported"),
    ({"modalities": ["text", "audio"]}, "modalities_not_supported"),
])
def test_chat_capabilities_refused_by_field(body: dict, code: str) -> None:
    with pytest.raises(RequestError) as e:
        check_capabilities(body)
    assert e.value.code == code


def test_chat_neutral_values_accepted() -> None:
    check_capabilities({"n": 1, "logit_bias": {"3": 0}, "response_format": {"type": "text"}, "tools": [],
                        "tool_choice": "none", "verbosity": "medium", "repetition_penalty": 1,
                        "modalities": ["text"], "store": False, "whatever_unknown": {"x": 1}})


def test_template_kwargs() -> None:
    assert template_kwargs({"reasoning_effort": "none"}) == {"enable_thinking": False}
    assert template_kwargs({"chat_template_kwargs": {"a": 1}, "enable_thinking": True}) == {"a": 1, "enable_thinking": True}
    with pytest.raises(RequestError):
        template_kwargs({"chat_template_kwargs": {"messages": []}})
    with pytest.raises(RequestError):
        template_kwargs({"chat_template_kwargs": {"enable_thinking": False}, "enable_thinking": True})


def test_response_fields_select_nested_paths() -> None:
    obj = {"content": "x", "generation_settings": {"n_predict": 5, "seed": 1}, "stop": True}
    assert _select(obj, ["content", "generation_settings/n_predict", "missing"]) == \
        {"content": "x", "generation_settings/n_predict": 5}


def test_session_digest_is_fnv1a64() -> None:
    assert session_digest([]) == "cbf29ce484222325"
    assert session_digest([1, 2, 3]) != session_digest([1, 2, 4])
    assert len(session_digest([42] * 10)) == 16


def test_anthropic_conversation_joins_turns_and_splits_the_prefill() -> None:
    from ninfer.server.anthropic import conversation

    body = {"system": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}],
            "messages": [{"role": "user", "content": "a"}, {"role": "user", "content": [{"type": "text", "text": "b"}]},
                         {"role": "system", "content": "mid"}, {"role": "user", "content": "c"},
                         {"role": "assistant", "content": "Sure:"}]}
    turns, prefill = conversation(body)
    assert turns == [Message("system", "Be brief."), Message("user", "ab"), Message("system", "mid"),
                     Message("user", "c")]
    assert prefill == "Sure:"
    turns, prefill = conversation({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"},
                                                {"role": "user", "content": "r"}]})
    assert [t.role for t in turns] == ["user", "assistant", "user"] and prefill is None
    with pytest.raises(RequestError, match="needs a user turn"):
        conversation({"messages": [{"role": "assistant", "content": "x"}]})


def test_anthropic_status_mapping() -> None:
    from ninfer.server.anthropic import _for_anthropic
    from ninfer.server.http import anthropic_error_type

    over = _for_anthropic(RequestError("full", status=429, code="server_overloaded"))
    assert (over.status, anthropic_error_type(over)) == (529, "overloaded_error")
    late = _for_anthropic(RequestError("late", status=503, code="request_queue_timeout"))
    assert (late.status, anthropic_error_type(late)) == (504, "timeout_error")
    named = _for_anthropic(RequestError("must be an integer", param="max_tokens"))
    assert named.message == "max_tokens: must be an integer" and named.status == 400


@pytest.mark.parametrize("err, status, kind, code, param, message", [
    (ContextLengthExceeded(9000, 8192), 400, "exceed_context_size_error", "context_length_exceeded", "prompt",
     "the prompt has 9000 tokens, but the context holds 8192 (prompt plus at least one output token)"),
    (EngineOverloaded(12), 429, "server_error", "server_overloaded", None, "the server is at capacity; retry shortly"),
    (DuplicateRequest("abc"), 400, "invalid_request_error", None, "request_id", "request id 'abc' is already in flight"),
    (TemplateError("chat template error: boom", field="messages"), 400, "invalid_request_error", None, "messages",
     "chat template error: boom"),
    (TokenOutOfRange(70000, 49152), 400, "invalid_request_error", None, "token",
     "token id 70000 is out of range (vocabulary size 49152)"),
    (SchemaError("text.format.schema cannot be enforced: x", field="text.format.schema"), 400,
     "invalid_request_error", "invalid_json_schema", "text.format.schema", "text.format.schema cannot be enforced: x"),
    (InvalidRequest("top_p must be in [0, 1]", field="top_p"), 400, "invalid_request_error", None, "top_p",
     "top_p must be in [0, 1]"),
    (EngineNotRunning("RuntimeError: gone"), 500, "server_error", "internal_error", None, "internal server error"),
])
def test_engine_errors_map_to_http_at_the_edge(err: EngineError, status: int, kind: str, code: str | None,
                                               param: str | None, message: str) -> None:
    import orjson

    from ninfer.server.errors import http_error
    from ninfer.server.http import openai_error_body

    assert not hasattr(err, "status") and not hasattr(err, "code")  # the engine error carries no HTTP facts
    mapped = http_error(err)
    assert (mapped.status, mapped.type, mapped.code, mapped.param, mapped.message) == (status, kind, code, param, message)
    extra = {"n_prompt_tokens": 9000, "n_ctx": 8192} if isinstance(err, ContextLengthExceeded) else {}  # llama-server's
    assert orjson.loads(openai_error_body(mapped)) == {"error": {"message": message, "type": kind, "param": param,
                                                                 "code": code, **extra}}
    own = RequestError("suffix must be a string", param="suffix", code="invalid_value")
    assert http_error(own) is own  # the server's own errors pass through


def test_model_meta_encodes_the_engine_facts() -> None:
    from ninfer.engine.loader import ModelFacts
    from ninfer.server.ops import model_meta

    facts = ModelFacts(path="/m.ninfer", vocab_size=49152, logits_size=49152, max_context=4096, trained_context=8192,
                       hidden_size=576, num_parameters=134515008, stored_bytes=96576768,
                       weight_formats=("f32", "int4ag32"), sampler_presets={})
    meta = model_meta(facts)
    assert list(meta) == ["n_vocab", "n_ctx", "n_ctx_train", "n_embd", "n_params", "size", "ftype"]
    assert meta == {"n_vocab": 49152, "n_ctx": 4096, "n_ctx_train": 8192, "n_embd": 576, "n_params": 134515008,
                    "size": 96576768, "ftype": "f32+int4ag32"}


def test_responses_input_items_and_turns() -> None:
    from ninfer.server.responses import normalize_input, turns_of

    items = normalize_input([{"role": "developer", "content": "be brief"},
                             {"type": "message", "role": "user", "id": "u1",
                              "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]},
                             {"role": "assistant", "content": [{"type": "output_text", "text": "x"}]},
                             {"role": "assistant", "content": [{"type": "refusal", "refusal": "y"}]}])
    assert [i["id"] for i in items][1] == "u1" and all(i["id"] for i in items)
    assert items[1]["content"] == [{"type": "input_text", "text": "ab"}]
    assert turns_of(items, "rules") == [Message("system", "rules"), Message("system", "be brief"),
                                        Message("user", "ab"), Message("assistant", "xy")]
    assert normalize_input("hi")[0]["content"] == [{"type": "input_text", "text": "hi"}]
    with pytest.raises(RequestError, match="repeats"):
        normalize_input([{"role": "user", "content": "a", "id": "m"}, {"role": "user", "content": "b", "id": "m"}])


@pytest.mark.parametrize("kind", [{}, [], 5, None])
def test_responses_item_type_that_is_not_a_string_is_a_field_error(kind: object) -> None:
    """Found by schemathesis: an Item whose type was an object raised TypeError (unhashable) in the
    decoder lookup, answered 500 on /v1/responses and /v1/responses/input_tokens."""
    from ninfer.server.responses import normalize_input

    with pytest.raises(RequestError) as e:
        normalize_input([{"type": kind, "role": "user", "content": ""}])
    assert e.value.status == 400 and e.value.param == "input[0].type"


def test_response_store_evicts_least_recently_used() -> None:
    from ninfer.server.response_store import ResponseStore

    def response(i: int) -> dict:
        return {"id": f"resp_{i}", "text": "x" * 100}

    one = len(__import__("orjson").dumps([response(0), [], []]))
    store = ResponseStore(budget=3 * one)
    for i in range(3):
        store.put(response(i), [], [])
    assert store.get("resp_0") is not None  # now the most recently used
    store.put(response(3), [], [])
    assert store.get("resp_1") is None and store.get("resp_0") is not None and store.used <= store.budget
    assert store.delete("resp_0") and not store.delete("resp_0")
    with pytest.raises(RequestError, match="exceeds the response store") as e:
        store.put({"id": "big", "text": "x" * (4 * one)}, [], [])
    assert e.value.code == "response_store_capacity_exceeded"


def test_json_formats_need_structured_output() -> None:
    from ninfer.server.state import ServerState
    from ninfer.server.structured import chat_format, constrain, with_instruction

    fmt = chat_format({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}})
    assert fmt is not None and fmt.schema == {"type": "object"} and not fmt.strict
    assert chat_format({"response_format": {"type": "text"}}) is None
    with pytest.raises(RequestError) as e:
        constrain(ServerState(config=ServerConfig()), fmt)
    assert e.value.code == "response_format_not_supported" and e.value.param == "response_format.json_schema"
    assert constrain(ServerState(config=ServerConfig(unconstrained_response_format=True)), fmt) is None
    turns = with_instruction([Message("system", "Be kind."), Message("user", "hi")], fmt)
    assert turns[0].content.startswith("Respond with raw JSON only") and turns[0].content.endswith("Be kind.")
    assert len(turns) == 2


def test_session_stats_panel_weighs_requests_by_size() -> None:
    from rich.console import Console

    from ninfer.engine.request import OutputEvent, Timings, Usage
    from ninfer.server.panel import SessionStats, render

    stats = SessionStats()

    def done(prompt: int, cached: int, out: int, prompt_ms: float, predicted_ms: float, reason: str = "stop") -> None:
        stats.done(OutputEvent(request_id="r", finish_reason=reason, usage=Usage(prompt, out, cached),
                               timings=Timings(cache_n=cached, prompt_n=prompt - cached, prompt_ms=prompt_ms,
                                               predicted_n=out, predicted_ms=predicted_ms)))

    done(100, 0, 11, 100.0, 100.0)  # 1000 tok/s prefill, 10 intervals in 0.1 s
    done(100, 100, 31, 10.0, 1000.0)  # an exact cache hit; 30 intervals in 1 s
    done(10, 0, 1, 5.0, 0.0, reason="cancelled")
    stats.error(cancelled=False)
    stats.reject()
    assert (stats.completed, stats.failed, stats.cancelled, stats.rejected) == (2, 1, 1, 1)
    console = Console(record=True, width=120)
    console.print(render(stats, running=1, waiting=2))
    text = console.export_text()
    assert "2 completed, 1 failed, 1 cancelled, 1 rejected | 1 running, 2 waiting" in text
    row = next(line for line in text.splitlines() if " all " in line)
    # TTFT mean 55 ms; cached 100/200; prefill 100 tokens / 0.11 s; decode 40 tokens / 1.1 s
    assert "55 ms" in row and "50 %" in row and "909.1" in row and "36.4" in row
    assert "last 10" not in text
    for _ in range(10):
        done(10, 0, 2, 10.0, 10.0)
    console = Console(record=True, width=120)
    console.print(render(stats))
    assert "last 10" in console.export_text()
