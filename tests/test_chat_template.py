"""Chat rendering vs transformers' apply_chat_template(..., tokenize=False)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from ninfer.engine.artifact import Artifact, SpecialTokens
from ninfer.engine.convert.gguf_tokenizer import bytes_to_unicode
from ninfer.engine.tokenizer import Tokenizer
from ninfer.engine.errors import TemplateError

transformers = pytest.importorskip("transformers")

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather for a city — in °C",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "description": "City name, e.g. Zürich or 東京"},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "noop", "description": "Does nothing", "parameters": {"type": "object", "properties": {}}}},
]

CONVERSATIONS = [
    [{"role": "user", "content": "Hi!"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "2+2?"},
     {"role": "assistant", "content": "4"}, {"role": "user", "content": "and 3+3?"}],
    [{"role": "user", "content": "Ünïcode 日本語 🤖 and \"quotes\" <b>tags</b>\n\nnew paragraph"}],
    [{"role": "system", "content": "Use tools when needed."},
     {"role": "user", "content": "Weather in Zürich and Tokyo?"},
     {"role": "assistant", "content": None, "tool_calls": [
         {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Zürich"}}},
         {"type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"東京\"}"}}]},
     {"role": "tool", "content": "{\"temp\": 21}"},
     {"role": "tool", "content": "{\"temp\": 25}"},
     {"role": "assistant", "content": "Zürich 21°C, Tokyo 25°C.", "reasoning_content": "Both calls returned.\n"},
     {"role": "user", "content": "Thanks"}],
    [{"role": "user", "content": "think first"},
     {"role": "assistant", "content": "done", "reasoning": "step one\nstep two"}],
]


@pytest.fixture(scope="module")
def tok(smollm2_artifact: Path) -> Tokenizer:
    return Tokenizer.from_metadata(Artifact.open(smollm2_artifact).meta)


@pytest.fixture(scope="module")
def ref(smollm2_hf_tokenizer_dir: Path):
    return transformers.AutoTokenizer.from_pretrained(str(smollm2_hf_tokenizer_dir))


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("conv", range(len(CONVERSATIONS)))
def test_smollm2_template_matches_transformers(tok: Tokenizer, ref, conv: int, add_generation_prompt: bool) -> None:
    messages = [{k: v for k, v in m.items() if k in ("role", "content")} for m in CONVERSATIONS[conv]]
    messages = [m for m in messages if m["content"] is not None]
    want = ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt) == want


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("tools", [None, TOOLS])
@pytest.mark.parametrize("conv", range(len(CONVERSATIONS)))
def test_qwen_style_template_matches_transformers(tok: Tokenizer, ref, qwen_style_template: str, conv: int,
                                                  tools: list | None, add_generation_prompt: bool) -> None:
    messages = CONVERSATIONS[conv]
    want = ref.apply_chat_template(messages, tools=tools, tokenize=False, chat_template=qwen_style_template,
                                   add_generation_prompt=add_generation_prompt, enable_thinking=False)
    got = tok.apply_chat_template(messages, tools=tools, chat_template=qwen_style_template,
                                  add_generation_prompt=add_generation_prompt, enable_thinking=False)
    assert got == want
    if tools:
        assert "<tools>" in got and "e.g. Zürich or 東京" in got  # tojson keeps non-ASCII
    if conv == 3:
        assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n</tool_call>' in got


def _tok(template: str | None) -> Tokenizer:
    """A throwaway byte-level tokenizer carrying `template`."""
    vocab = {c: i for i, c in enumerate(bytes_to_unicode().values())}
    data = {"version": "1.0", "added_tokens": [], "normalizer": None,
            "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
            "post_processor": None, "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
            "model": {"type": "BPE", "vocab": vocab, "merges": []}}
    return Tokenizer(json.dumps(data), SpecialTokens(bos_token="<s>", eos_token="</s>"), template)


def test_globals_and_filters() -> None:
    t = _tok("{{ bos_token }}{{ messages[0].content | tojson(indent=2) }}|{{ {'a': 'é'} | tojson }}|"
             "{{ strftime_now('%Y') | length }}|{% generation %}{{ eos_token }}{% endgeneration %}|{{ extra_flag }}")
    out = t.apply_chat_template([{"role": "user", "content": ["x"]}], extra_flag="on")
    assert out == '<s>[\n  "x"\n]|{"a": "é"}|4|</s>|on'


def test_template_errors_are_typed_and_name_the_field() -> None:
    t = _tok("{% if messages[0].role != 'user' %}{{ raise_exception('first message must be user') }}{% endif %}ok")
    assert t.apply_chat_template([{"role": "user", "content": "x"}]) == "ok"
    with pytest.raises(TemplateError, match="first message must be user") as e:
        t.apply_chat_template([{"role": "assistant", "content": "x"}])
    assert e.value.field == "messages"
    with pytest.raises(TemplateError) as e:  # the sandbox refuses internals
        _tok("{{ messages.__class__.__mro__ }}").apply_chat_template([{"role": "user", "content": "x"}])
    assert e.value.field == "messages"
    with pytest.raises(TemplateError, match="no chat template"):
        _tok(None).apply_chat_template([{"role": "user", "content": "x"}])
    with pytest.raises(TemplateError) as e:
        _tok(None).apply_chat_template([], chat_template="{% if %}")
    assert e.value.field == "chat_template"
