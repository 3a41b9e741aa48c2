"""What engine tests share: a one-letter-per-token stand-in tokenizer and a greedy generation
through a running Engine."""
from __future__ import annotations

from ninfer.engine.request import PreparedRequest, SamplingParams


class LetterTokens:
    """Token t is one letter; 0 ends a sequence."""

    stop_token_ids = frozenset({0})
    special_token_ids = frozenset({0})
    vocab_size = 26

    def token_bytes(self, token_id: int) -> bytes:
        return chr(97 + token_id % 26).encode()


def generate(engine, rid: str, prompt: list[int], n: int, cache_prompt: bool = True):
    """Greedy, up to n tokens -> (token ids, final event)."""
    handle = engine.submit(PreparedRequest(request_id=rid, prompt_token_ids=prompt, max_tokens=n,
                                           sampling=SamplingParams(temperature=0.0), cache_prompt=cache_prompt))
    ids, final = [], None
    for ev in handle:
        ids += ev.token_ids
        final = ev
    return ids, final


def two_turns(engine, prompt: list[int], n: int):
    """A conversation's first turn, then the next turn on its output -> (first, second, final event)."""
    first, _ = generate(engine, "a", prompt, n)
    second, final = generate(engine, "b", prompt + first, n)
    return first, second, final


def assert_as_never_suspended(load, prompt: list[int], n: int, first: list[int], second: list[int], final) -> None:
    """The same two turns on an engine from `load()` that never slept sample the same tokens and
    reuse as much of the prompt."""
    ref = load()
    try:
        ref_first, ref_second, ref_final = two_turns(ref.engine, prompt, n)
    finally:
        ref.engine.shutdown()
    assert (first, second) == (ref_first, ref_second)
    assert final.usage.cached_tokens == ref_final.usage.cached_tokens
