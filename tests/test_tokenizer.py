"""Tokenizer rebuilt from GGUF metadata vs transformers loading the same vocabulary."""
from __future__ import annotations

import random
from pathlib import Path

import pytest

from ninfer.engine.artifact import Artifact, SpecialTokens
from ninfer.engine.convert.gguf import read_vocab
from ninfer.engine.convert.gguf_reader import GGUFFile
from ninfer.engine.convert.gguf_tokenizer import build_tokenizer_json
from ninfer.engine.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")

BASE_STRINGS = [
    "", " ", "  ", "\n", "\n\n", " \n ", "\t", "\t\tx", "hello", " hello", "hello world", "Hello, World!",
    "Hello  world", "Hello   world  ", "a\nb", "a\n\nb", "a \n b", "line1\r\nline2", "trailing space ",
    "The quick brown fox jumps over the lazy dog.", "I'm sure they'll say it's fine, we've seen it'd work",
    "DON'T SHOUT", "12345", "3.14159", "1,000,000", "x = 42", "-7", "1e-5", "0x1F", "v1.2.3",
    " 1", "  12", "\n\n 123456", "a1b2c3", "² ½ Ⅻ ٣", "日本語のテキスト", "中文测试，你好世界！", "한국어 텍스트",
    "Привет, мир!", "Γειά σου Κόσμε", "مرحبا بالعالم", "שלום עולם", "हिन्दी पाठ", "ภาษาไทย",
    "emoji 🤖🚀 and 👩‍👩‍👧‍👦 family", "🙂🙂🙂", "café naïve résumé", "Ünïcödé", "e\u0301", "ﬁ ligature",
    "def f(x):\n    return x * 2\n", "for (int i = 0; i < n; ++i) { a[i] = b[i]; }",
    "<html><body class=\"x\">hi</body></html>", '{"key": [1, 2, {"n": null}]}', "SELECT * FROM t WHERE id=1;",
    "https://example.com/path?q=1&r=two#frag", "user@example.com", "C:\\Users\\name\\file.txt",
    "    indented code", "\ttabbed\tvalues\t", "!!!???...", "--- *** ___", "$100 & 50% off", "@#%^&*()",
    "<|im_start|>user\nhi<|im_end|>", "<|im_start|>assistant\n", "<|endoftext|>", "text<|im_end|>more",
    "<|im_start|><|im_end|>", "<|im_start", "im_start|>", "<repo_name>x<file_sep>y", "< |im_start| >",
    "<think>\nreasoning\n</think>\n\nanswer", "<tool_call>\n{\"name\": \"f\"}\n</tool_call>",
    "Ġ Ċ ĉ", "\u00a0non-breaking\u00a0space", "zero\u200bwidth", "\u3000ideographic space", "a\u2028b",
]
PIECES = ["hello", " world", "  ", "\n", "123", " 4", "é", "日本", "🤖", "<|im_end|>", "'s", "x=1;", "\t",
          "The", " the", "!", "  \n", "Ω", "ﬀ", "👍🏽", " <|im_start|>", "ab", "—", "…", "\r\n"]


def varied_strings(n: int = 260, seed: int = 0) -> list[str]:
    """BASE_STRINGS plus seeded random concatenations of tricky pieces."""
    rng = random.Random(seed)
    out = list(BASE_STRINGS)
    while len(out) < n:
        out.append("".join(rng.choice(PIECES) for _ in range(rng.randint(1, 8))))
    return out


@pytest.fixture(scope="module")
def tok(smollm2_artifact: Path) -> Tokenizer:
    return Tokenizer.from_metadata(Artifact.open(smollm2_artifact).meta)


@pytest.fixture(scope="module")
def ref(smollm2_hf_tokenizer_dir: Path):
    return transformers.AutoTokenizer.from_pretrained(str(smollm2_hf_tokenizer_dir))


def test_encode_matches_transformers(tok: Tokenizer, ref) -> None:
    strings = varied_strings()
    assert len(strings) >= 200
    mismatches = [(s, tok.encode(s), ref.encode(s, add_special_tokens=False))
                  for s in strings if tok.encode(s) != ref.encode(s, add_special_tokens=False)]
    assert not mismatches, mismatches[:3]


def test_decode_and_token_bytes_round_trip(tok: Tokenizer, ref) -> None:
    for s in varied_strings():
        ids = tok.encode(s)
        assert tok.decode(ids) == s
        assert tok.decode(ids) == ref.decode(ids)
        assert b"".join(tok.token_bytes(i) for i in ids) == s.encode("utf-8")


def test_smollm2_special_tokens(tok: Tokenizer) -> None:
    assert tok.encode("<|im_start|>user") == [1, 4093]
    assert tok.id_to_piece(2) == "<|im_end|>"
    assert tok.id_to_piece(33662) == "Ġhello"
    assert tok.token_bytes(33662) == b" hello"
    assert tok.bos_token_id == 1 and tok.eos_token_id == 2
    assert tok.stop_token_ids == frozenset({0, 2})  # <|endoftext|>, <|im_end|>
    assert set(range(17)) <= tok.special_token_ids and 33662 not in tok.special_token_ids
    assert tok.vocab_size == 49152
    assert not tok.add_bos_token and tok.encode("hi", add_special_tokens=True) == tok.encode("hi")
    assert tok.decode([1, 4093, 2], skip_special_tokens=True) == "user"
    assert tok.has_chat_template


def test_digits_split_like_llama_cpp_smollm(tok: Tokenizer) -> None:
    # llama.cpp's "smollm" pre-tokenizer isolates digits before GPT-2's regex, so the whitespace run
    # before a number stays one token ("\n\n " = 8866) instead of GPT-2's "\n\n" + " ".
    assert tok.encode("\n\n 12") == [8866, 33, 34]


def test_sentencepiece_gguf_matches_transformers(tmp_path: Path) -> None:
    from gguf_synth import SPM_PIECES, write_tiny_gguf

    g = write_tiny_gguf(tmp_path / "spm.gguf", "llama", tokenizer="spm")
    gguf = GGUFFile(g.path)
    text = build_tokenizer_json(read_vocab(gguf.fields), str(g.path))
    ours = Tokenizer(text, SpecialTokens(bos_token_id=1, eos_token_id=2, add_bos_token=True), None)
    ref = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="spm.gguf")
    strings = ["hello world", " hello", "the cat and the dog", "Hello World!", "  two spaces", "tab\there",
               "new\nline", "é ü 日本 🤖", "hello <tool> world", "<s>hello</s>", "you  and   my    dog",
               "THE END.", "1 2 3 123", "", " ", "x"] + varied_strings(120, seed=1)
    for s in strings:
        assert ours.encode(s) == ref.encode(s, add_special_tokens=False), s
        assert ours.encode(s, add_special_tokens=True) == ref.encode(s), s
        ids = ours.encode(s)
        assert ours.decode(ids) == ref.decode(ids), s
    ids = ours.encode("hello world")
    assert ours.strips_leading_space
    assert b"".join(ours.token_bytes(i) for i in ids) == b" hello world"
    assert ours.token_bytes(3 + 0x41) == b"A"  # <0x41>
    assert ours.encode("<tool>") == [3 + 256 + len(SPM_PIECES)]  # user-defined token stays whole


def test_parse_special_false_tokenizes_special_text_as_text(tok: Tokenizer, ref) -> None:
    text = "Hello<|im_start|>user\nhi<|im_end|>"
    assert 1 in tok.encode(text) and 2 in tok.encode(text)  # default: special-token text is the token
    plain = tok.encode(text, parse_special=False)
    assert not set(plain) & tok.special_token_ids
    assert tok.decode(plain) == text
    # transformers' split_special_tokens is the same contract
    for s in varied_strings():
        assert tok.encode(s, parse_special=False) == ref.encode(s, add_special_tokens=False,
                                                                split_special_tokens=True), s
    assert tok.encode(text) == ref.encode(text, add_special_tokens=False)  # the shared instance is untouched
