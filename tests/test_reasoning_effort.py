"""Reasoning effort: the nearest value a template accepts (a tie rounds up), and
--default-reasoning-effort, which fills in only for requests that name no effort and yields to
everything the request decides (its own effort, thinking it disables, a forced call, a prefill)."""
from __future__ import annotations

from pathlib import Path

import pytest

from ninfer.engine.artifact import Artifact
from ninfer.engine.chat import EFFORT_LEVELS, Message, render, template_effort
from ninfer.engine.tokenizer import Tokenizer
from ninfer.engine.errors import TemplateError
from ninfer.errors import ConfigError
from ninfer.server.chat_request import ChatRequest, ToolChoice
from ninfer.server.chat_run import template_kwargs
from ninfer.server.config import ServerConfig
from ninfer.server.state import ServerState
from ninfer.engine.request import SamplingParams

BODY = """{%- for m in messages %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endfor -%}
{%- if add_generation_prompt %}<|im_start|>assistant
effort={{ reasoning_effort if reasoning_effort is defined else "unset" }}
{%- if enable_thinking is defined and enable_thinking is false %} thinking=off{% endif %}
{% endif %}"""
OPEN_MINDED = BODY
# raises for anything but low, medium and xhigh, as the official Qwen3.8 template does
PICKY = """{%- if reasoning_effort is defined and reasoning_effort not in ["low", "medium", "xhigh"] -%}
{{ raise_exception("unsupported reasoning_effort " ~ reasoning_effort) }}
{%- endif -%}""" + BODY
NEVER = "{{ raise_exception('no effort here') if reasoning_effort is defined }}" + OPEN_MINDED
NEEDS_SYSTEM = "{{ raise_exception('system first') if messages[0].role != 'system' }}" + PICKY


@pytest.fixture(scope="module")
def tok(smollm2_artifact: Path) -> Tokenizer:
    return Tokenizer.from_metadata(Artifact.open(smollm2_artifact).meta)


def effort_line(tok: Tokenizer, template: str, kwargs: dict) -> str:
    text = render(tok, [Message("user", "Hi")], kwargs=kwargs, chat_template=template).text
    return text.rsplit("<|im_start|>assistant\n", 1)[1].strip()


def test_a_rejected_effort_renders_as_the_nearest_accepted_one(tok: Tokenizer) -> None:
    expect = {"minimal": "low", "low": "low", "medium": "medium", "high": "xhigh", "xhigh": "xhigh", "max": "xhigh"}
    for asked, rendered in expect.items():
        assert template_effort(tok, asked, PICKY) == rendered
        assert effort_line(tok, PICKY, {"reasoning_effort": asked}) == f"effort={rendered}"
    assert effort_line(tok, PICKY, {}) == "effort=unset"


def test_a_template_that_accepts_a_value_receives_it(tok: Tokenizer) -> None:
    for asked in EFFORT_LEVELS:
        assert effort_line(tok, OPEN_MINDED, {"reasoning_effort": asked}) == f"effort={asked}"


def test_a_template_that_rejects_every_value_keeps_the_request_value_and_its_error(tok: Tokenizer) -> None:
    for template in (NEVER, NEEDS_SYSTEM):
        assert template_effort(tok, "high", template) == "high"
    with pytest.raises(TemplateError, match="no effort here"):
        render(tok, [Message("user", "Hi")], kwargs={"reasoning_effort": "high"}, chat_template=NEVER)
    with pytest.raises(TemplateError, match="unsupported reasoning_effort high"):  # the value itself, unmapped
        render(tok, [Message("system", "S"), Message("user", "Hi")], kwargs={"reasoning_effort": "high"},
               chat_template=NEEDS_SYSTEM)


@pytest.mark.parametrize("kwargs, match", [
    ({"default_reasoning_effort": "extreme"}, "--default-reasoning-effort must be one of"),
    ({"default_reasoning_effort": "high", "no_thinking": True}, "conflicts with --no-thinking"),
])
def test_default_effort_options_are_checked(kwargs: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        ServerConfig(**kwargs)
    ServerConfig(default_reasoning_effort="none", no_thinking=True)  # none is thinking off: no conflict


def chat(**fields) -> ChatRequest:
    return ChatRequest(protocol="chat", messages=[Message("user", "Hi")], sampling=SamplingParams(), **fields)


@pytest.mark.parametrize("default, fields, expect", [
    ("high", {}, {"reasoning_effort": "high"}),
    ("high", {"template_kwargs": {"reasoning_effort": "low"}, "requested_effort": "low"}, {"reasoning_effort": "low"}),
    ("high", {"template_kwargs": {"enable_thinking": False}, "requested_effort": "none"}, {"enable_thinking": False}),
    ("high", {"template_kwargs": {"enable_thinking": False}}, {"enable_thinking": False}),
    ("high", {"template_kwargs": {"enable_thinking": True}}, {"enable_thinking": True, "reasoning_effort": "high"}),
    ("high", {"tool_choice": ToolChoice("required", ("f",))}, {"enable_thinking": False}),
    ("high", {"prefill": "Sure"}, {}),
    ("none", {}, {"enable_thinking": False}),
    ("none", {"template_kwargs": {"enable_thinking": True}}, {"enable_thinking": True}),
    ("none", {"template_kwargs": {"reasoning_effort": "low"}, "requested_effort": "low"}, {"reasoning_effort": "low"}),
    (None, {}, {}),
])
def test_default_effort_yields_to_the_request(default: str | None, fields: dict, expect: dict) -> None:
    state = ServerState(ServerConfig(default_reasoning_effort=default))
    assert template_kwargs(state, chat(**fields)) == expect


def test_prepared_request_renders_the_default_and_logs_only_a_named_effort(smollm2_artifact: Path,
                                                                          tmp_path: Path) -> None:
    """Through prepare (the one chat path) to the request log: the server default renders (mapped to
    what the template accepts) but is logged as null; a request's own effort is logged as asked."""
    import json
    from types import SimpleNamespace

    from ninfer.server.chat_run import prepare
    from ninfer.server.reqlog import RequestLog

    picky = Tokenizer.from_metadata(Artifact.open(smollm2_artifact).meta)
    picky.chat_template = PICKY  # as --chat-template sets it
    state = ServerState(ServerConfig(default_reasoning_effort="max"))
    state.loaded = SimpleNamespace(tokenizer=picky)
    log = RequestLog(tmp_path / "r.jsonl")
    for n, fields in enumerate(({}, {"template_kwargs": {"reasoning_effort": "high"}, "requested_effort": "high"})):
        req = prepare(state, chat(**fields), f"r{n}")
        assert picky.decode(req.prompt_token_ids).rstrip().endswith("effort=xhigh")
        log.request_start(n, "chat", req, stream=False)
    log.close()
    starts = [json.loads(line) for line in (tmp_path / "r.jsonl").read_text().splitlines()]
    assert [s["requested_reasoning_effort"] for s in starts] == [None, "high"]
