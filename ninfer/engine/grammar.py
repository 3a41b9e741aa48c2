"""Structured output: JSON grammars compiled by XGrammar over the model's byte vocabulary, and the
matcher the engine advances with each committed token.

The vocabulary is the tokenizer's raw bytes per id; special tokens map to no bytes, so a grammar
never admits them, except the stop tokens, which it admits exactly where the JSON value is
complete. The engine asks `Matcher.next_mask()` before a sampling step and the sampler keeps only
the allowed ids (sampler.apply_mask).
"""
from __future__ import annotations

import json
import re
from typing import Any

import torch
import xgrammar as xg

from ninfer.engine.errors import GrammarError, SchemaError
from ninfer.engine.schema_subset import check_schema


class JsonGrammars:
    """Compiles JSON grammars for one tokenizer and model vocabulary (build once per model)."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        special = tokenizer.special_token_ids
        vocab = [b"" if i in special else tokenizer.token_bytes(i) for i in range(tokenizer.vocab_size)]
        info = xg.TokenizerInfo(vocab, xg.VocabType.RAW, vocab_size=vocab_size,
                                stop_token_ids=sorted(tokenizer.stop_token_ids))
        self.vocab_size = vocab_size
        self._compiler = xg.GrammarCompiler(info, max_threads=2)

    def json_object(self) -> Grammar:
        """Any JSON object."""
        return Grammar(self._compiler.compile_json_schema('{"type": "object"}'), self.vocab_size)

    def json_schema(self, schema: Any, param: str, *, strict: bool) -> Grammar:
        """A value of `schema` (a JSON Schema object); `param` names it in errors. strict: objects
        without additionalProperties admit only their declared properties."""
        if not isinstance(schema, dict):
            raise SchemaError(f"{param} must be a JSON Schema object", field=param)
        check_schema(schema, param)
        try:
            compiled = self._compiler.compile_json_schema(json.dumps(schema), strict_mode=strict)
        except (RuntimeError, ValueError, TypeError) as e:
            raise SchemaError(f"{param} cannot be enforced: {_reason(e)}", field=param) from None
        return Grammar(compiled, self.vocab_size)

    def gbnf(self, text: str, param: str) -> Grammar:
        """A sentence of the GBNF grammar `text` (llama.cpp's grammar field; XGrammar reads GBNF
        as its EBNF, root rule `root`); `param` names it in errors."""
        try:
            compiled = self._compiler.compile_grammar(xg.Grammar.from_ebnf(text))
        except (RuntimeError, ValueError, TypeError) as e:
            raise GrammarError(f"{param} does not compile: {_reason(e)}", field=param) from None
        return Grammar(compiled, self.vocab_size)

    def tool_call(self, tools: list[tuple[str, dict[str, Any]]], opener: str = "<tool_call>\n",
                  closer: str = "\n</tool_call>") -> Grammar:
        """One call in the Qwen form, opener + {"name": N, "arguments": A} + closer, where N is
        one of `tools` (name, parameters schema) and A a value of that tool's parameters."""
        schemas = [{"type": "object", "properties": {"name": {"const": name}, "arguments": params or {"type": "object"}},
                    "required": ["name", "arguments"], "additionalProperties": False} for name, params in tools]
        schema = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
        try:
            body = xg.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False, separators=(", ", ": "))
            grammar = xg.Grammar.concat(xg.Grammar.from_ebnf(f"root ::= {json.dumps(opener)}"), body,
                                        xg.Grammar.from_ebnf(f"root ::= {json.dumps(closer)}"))
            compiled = self._compiler.compile_grammar(grammar)
        except (RuntimeError, ValueError, TypeError) as e:
            reason = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
            reason = re.sub(r"^\[[^\]]*\]\s*\S+:\d+:\s*", "", reason)
            raise SchemaError(f"tools: a parameters schema cannot be enforced: {reason[:300]}", field="tools") from None
        return Grammar(compiled, self.vocab_size)


def _reason(e: Exception) -> str:
    """XGrammar's message without its "[time] file.cc:line: " prefix, one line, bounded."""
    reason = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
    return re.sub(r"^\[[^\]]*\]\s*\S+:\d+:\s*", "", reason)[:300]


class Grammar:
    """A compiled grammar; each request gets its own matcher."""

    def __init__(self, compiled: xg.CompiledGrammar, vocab_size: int) -> None:
        self._compiled = compiled
        self.vocab_size = vocab_size

    def matcher(self) -> Matcher:
        return Matcher(xg.GrammarMatcher(self._compiled), self.vocab_size)


class Matcher:
    """One request's position in its grammar."""

    def __init__(self, matcher: xg.GrammarMatcher, vocab_size: int) -> None:
        self._matcher = matcher
        self._mask = xg.allocate_token_bitmask(1, vocab_size)

    def next_mask(self) -> torch.Tensor:
        """The ids the next token may take, as XGrammar's packed int32 bitmask [1, words] (a copy)."""
        self._matcher.fill_next_token_bitmask(self._mask)
        return self._mask.clone()

    def draft_masks(self, drafts: list[int]) -> list[torch.Tensor]:
        """The mask after each prefix of `drafts` (the mask of verify position i + 1), up to the
        first draft the grammar refuses; the matcher is left where it was."""
        masks: list[torch.Tensor] = []
        for token in drafts:
            if self._matcher.is_terminated() or not self._matcher.accept_token(token):
                break
            masks.append(self.next_mask())
        if masks:
            self._matcher.rollback(len(masks))
        return masks

    def accept(self, token: int) -> bool:
        """Advance past `token`; False when the grammar does not admit it."""
        return self._matcher.accept_token(token)
