from __future__ import annotations

import random
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from ninfer.engine.output import OutputProcessor, StepText

if TYPE_CHECKING:
    from ninfer.engine.tokenizer import Tokenizer

EMOJI = "😀".encode()  # f0 9f 98 80


class FakeTokenizer:
    """Token id -> bytes table; ids are positions in `vocab`."""

    def __init__(self, vocab: list[bytes], special: frozenset[int] = frozenset(),
                 stops: frozenset[int] = frozenset()) -> None:
        self.vocab = vocab
        self.special_token_ids = special
        self.stop_token_ids = stops

    def token_bytes(self, token_id: int) -> bytes:
        return self.vocab[token_id]

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return b"".join(self.vocab[i] for i in ids
                        if not (skip_special_tokens and i in self.special_token_ids)).decode("utf-8", "replace")


def _tok(*pieces: str | bytes, special: frozenset[int] = frozenset(), stops: frozenset[int] = frozenset()) -> FakeTokenizer:
    return FakeTokenizer([p.encode() if isinstance(p, str) else p for p in pieces], special, stops)


def _run(proc: OutputProcessor, ids: list[int]) -> list[StepText]:
    steps = []
    for i in ids:
        steps.append(proc.append(i))
        if steps[-1].finished:
            break
    return steps


def test_plain_text_passes_through() -> None:
    tok = _tok("Hello", ",", " world")
    proc = OutputProcessor(tok, [], frozenset(), False)
    assert [s.text for s in _run(proc, [0, 1, 2])] == ["Hello", ",", " world"]
    assert proc.finish() == ""
    assert proc.text_so_far == "Hello, world"


def test_stop_string_split_across_tokens() -> None:
    tok = _tok("The answer", " is S", "TO", "P and more")
    proc = OutputProcessor(tok, ["STOP"], frozenset(), False)
    steps = _run(proc, [0, 1, 2, 3])
    assert [s.text for s in steps] == ["The answer", " is ", "", ""]
    assert [s.finished for s in steps] == [False, False, False, True]
    assert steps[-1].stop_reason == "STOP"
    assert proc.text_so_far == "The answer is "


def test_emoji_split_across_tokens_is_emitted_whole() -> None:
    tok = _tok(b"hi ", EMOJI[:1], EMOJI[1:3], EMOJI[3:], b"!")
    proc = OutputProcessor(tok, [], frozenset(), False)
    steps = _run(proc, [0, 1, 2, 3, 4])
    assert [s.text for s in steps] == ["hi ", "", "", "😀", "!"]
    # The emoji's first token is published with the step that completes the character.
    assert [s.tokens_published for s in steps] == [1, 1, 1, 4, 5]


def test_incomplete_utf8_at_finish_becomes_replacement_like_decode() -> None:
    tok = _tok(b"ok ", EMOJI[:2])
    proc = OutputProcessor(tok, [], frozenset(), False)
    assert [s.text for s in _run(proc, [0, 1])] == ["ok ", ""]
    assert proc.finish() == "\ufffd"
    assert proc.text_so_far == tok.decode([0, 1])


def test_invalid_bytes_midstream_are_replaced_immediately() -> None:
    tok = _tok(b"a", b"\xff", EMOJI[:2], b"b")
    proc = OutputProcessor(tok, [], frozenset(), False)
    assert [s.text for s in _run(proc, [0, 1, 2, 3])] == ["a", "\ufffd", "", "\ufffdb"]
    assert proc.text_so_far == tok.decode([0, 1, 2, 3])


def test_overlapping_stop_candidates() -> None:
    tok = _tok("a", "b", "c", "e", "x")
    stops = ["abcd", "bce"]
    proc = OutputProcessor(tok, stops, frozenset(), False)
    steps = _run(proc, [0, 1, 2, 3])
    assert [s.text for s in steps] == ["", "", "", "a"]
    assert steps[-1].stop_reason == "bce"
    # The same prefix followed by something else releases everything withheld.
    proc = OutputProcessor(tok, stops, frozenset(), False)
    steps = _run(proc, [0, 1, 2, 4])
    assert [s.text for s in steps] == ["", "", "", "abcx"]
    assert not steps[-1].finished


def test_stop_at_the_very_start() -> None:
    tok = _tok("</s>", "more")
    proc = OutputProcessor(tok, ["</s>"], frozenset(), False)
    step = proc.append(0)
    assert (step.text, step.finished, step.stop_reason, step.tokens_published) == ("", True, "</s>", 0)
    assert proc.text_so_far == ""


def test_earliest_completing_stop_wins() -> None:
    tok = _tok("hello world")
    proc = OutputProcessor(tok, ["world", "lo"], frozenset(), False)
    step = proc.append(0)
    assert (step.text, step.stop_reason) == ("hel", "lo")
    # Two stops completing at the same place: the one starting earlier cuts more.
    proc = OutputProcessor(_tok("xabc"), ["bc", "abc"], frozenset(), False)
    step = proc.append(0)
    assert (step.text, step.stop_reason) == ("x", "abc")


def test_finish_releases_withheld_text() -> None:
    tok = _tok("the", " E", "N")
    proc = OutputProcessor(tok, ["END"], frozenset(), False)
    assert [s.text for s in _run(proc, [0, 1, 2])] == ["the", " ", ""]
    assert proc.finish() == "EN"
    assert proc.text_so_far == "the EN"
    assert proc.stop_reason is None
    assert proc.tokens_published == 3


def test_stop_token_finishes_without_its_text_and_releases_held() -> None:
    tok = _tok("x", "<|end|>", "E", special=frozenset({1}), stops=frozenset({1}))
    proc = OutputProcessor(tok, ["END"], frozenset(), False)
    steps = _run(proc, [0, 2, 1])
    assert [s.text for s in steps] == ["x", "", "E"]
    assert (steps[-1].finished, steps[-1].stop_reason, steps[-1].tokens_published) == (True, 1, 2)


def test_request_stop_tokens_and_ignore_eos() -> None:
    tok = _tok("a", "<eos>", "b", special=frozenset({1}), stops=frozenset({1}))
    # ignore_eos drops the model's own stop token; its text is then ordinary special-token text.
    proc = OutputProcessor(tok, [], frozenset({1}), True)
    assert [s.text for s in _run(proc, [0, 1, 2])] == ["a", "<eos>", "b"]
    # A request stop token that is not the model's still stops under ignore_eos.
    proc = OutputProcessor(tok, [], frozenset({2}), True)
    steps = _run(proc, [0, 1, 2])
    assert steps[-1].stop_reason == 2 and proc.text_so_far == "a<eos>"


def test_special_tokens_emitted_unless_skipped() -> None:
    tok = _tok("<think>", "hm", special=frozenset({0}))
    proc = OutputProcessor(tok, [], frozenset(), False)
    assert [s.text for s in _run(proc, [0, 1])] == ["<think>", "hm"]
    proc = OutputProcessor(tok, [], frozenset(), False, skip_special_tokens=True)
    steps = _run(proc, [0, 1])
    assert [s.text for s in steps] == ["", "hm"]
    assert [s.tokens_published for s in steps] == [1, 2]


def test_tokens_cut_by_a_stop_string_are_not_published() -> None:
    tok = _tok("ab", "cS", "TOPd")
    proc = OutputProcessor(tok, ["STOP"], frozenset(), False)
    steps = _run(proc, [0, 1, 2])
    assert [s.text for s in steps] == ["ab", "c", ""]
    assert [s.tokens_published for s in steps] == [1, 2, 2]


def _reference(text: str, stops: list[str]) -> tuple[str, str | None]:
    """Cut `text` where the first stop completes, scanning character by character."""
    for end in range(1, len(text) + 1):
        for stop in sorted(stops, key=len, reverse=True):
            if text[:end].endswith(stop):
                return text[:end - len(stop)], stop
    return text, None


@pytest.mark.parametrize("seed", range(60))
def test_random_streams_match_whole_text_reference(seed: int) -> None:
    rng = random.Random(seed)
    alphabet = ["a", "b", "c", "ab", "ba", "abc", "\n", "é", "😀"]
    vocab = [s.encode() for s in alphabet] + [EMOJI[:1], EMOJI[1:2], EMOJI[2:], "é".encode()[:1], b"\xbf"]
    tok = FakeTokenizer(vocab)
    stops = rng.sample(["ab", "bca", "aab", "c\n", "😀a", "éé", "bbb"], k=rng.randint(0, 3))
    ids = [rng.randrange(len(vocab)) for _ in range(rng.randint(1, 25))]
    proc = OutputProcessor(tok, stops, frozenset(), False)
    emitted = "".join(s.text for s in _run(proc, ids))
    if not proc.finished:
        emitted += proc.finish()
    expected, stop = _reference(tok.decode(ids), stops)
    assert emitted == expected == proc.text_so_far
    assert proc.stop_reason == stop


@pytest.fixture(scope="module")
def smollm2_tokenizer(smollm2_artifact: Path) -> Tokenizer:
    from ninfer.engine.artifact import Artifact
    from ninfer.engine.tokenizer import Tokenizer

    return Tokenizer.from_metadata(Artifact.open(smollm2_artifact).meta)


def test_real_tokenizer_stream_equals_decode_and_cuts_at_stop(smollm2_tokenizer: Tokenizer) -> None:
    tok = smollm2_tokenizer
    text = "Grüße 😀🎉 — naïve 日本語 done. STOP and beyond"
    ids = tok.encode(text)
    # The emoji/CJK really are split into byte tokens that are not valid UTF-8 alone.
    assert any(_invalid_utf8(tok.token_bytes(i)) for i in ids)

    proc = OutputProcessor(tok, [], frozenset(), False)
    steps = _run(proc, ids)
    for step in steps:
        assert "\ufffd" not in step.text
    assert "".join(s.text for s in steps) + proc.finish() == tok.decode(ids) == text
    assert steps[-1].tokens_published == len(ids)

    proc = OutputProcessor(tok, ["STOP", "beyond"], frozenset(), False)
    steps = _run(proc, ids)
    assert steps[-1].finished and steps[-1].stop_reason == "STOP"
    assert proc.text_so_far == text[:text.index("STOP")]


def test_real_tokenizer_eos_and_special_tokens(smollm2_tokenizer: Tokenizer) -> None:
    tok = smollm2_tokenizer
    eos = tok.eos_token_id
    assert eos in tok.stop_token_ids
    im_start = tok.encode("<|im_start|>", add_special_tokens=False)
    assert len(im_start) == 1 and im_start[0] in tok.special_token_ids and im_start[0] not in tok.stop_token_ids
    ids = tok.encode("Hi") + im_start + tok.encode(" there")
    proc = OutputProcessor(tok, [], frozenset(), False)
    steps = _run(proc, ids + [eos] + tok.encode("junk"))
    assert proc.text_so_far == "Hi<|im_start|> there"
    assert (steps[-1].finished, steps[-1].stop_reason) == (True, eos)
    proc = OutputProcessor(tok, [], frozenset(), False, skip_special_tokens=True)
    _run(proc, ids)
    assert proc.finish() == "" and proc.text_so_far == "Hi there"


def _invalid_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return True
    return False
