"""Rebuild a `tokenizers` tokenizer (tokenizer.json text) from a GGUF's `tokenizer.ggml.*` keys.

Two vocabulary kinds, as llama.cpp names them:
  gpt2:  byte-level BPE with merges; the pre-tokenizer regex is chosen by `tokenizer.ggml.pre`.
  llama: SentencePiece-style BPE with byte fallback (<0x00>..<0xFF>), "▁" for spaces, merges
         recovered from the scores, optional space prefix (`tokenizer.ggml.add_space_prefix`).
Control tokens (type 3) become added special tokens and user-defined ones (type 4) plain added
tokens, with their GGUF ids, so their text maps to one id.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

from ninfer.errors import ArtifactError

# llama.cpp token types (llama_token_type)
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = 1, 2, 3, 4, 5, 6

_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# Qwen3.5: Qwen2's with combining marks (\p{M}) kept inside words
_QWEN35_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
                 r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

# tokenizer.ggml.pre -> the regexes llama.cpp splits with, in order (llama-vocab.cpp).
# None: GPT-2's own regex (ByteLevel's built-in one).
_PRE_SPLITS: dict[str, list[str] | None] = {
    "default": None, "gpt2": None, "gpt-2": None, "olmo": None, "jais": None,
    "smollm": [r"\p{N}"], "starcoder": [r"\p{N}"], "refact": [r"\p{N}"], "command-r": [r"\p{N}"],
    "codeshell": [r"\p{N}"], "exaone": [r"\p{N}"], "minerva-7b": [r"\p{N}"],
    "llama3": [_LLAMA3_SPLIT], "llama-v3": [_LLAMA3_SPLIT], "llama-bpe": [_LLAMA3_SPLIT],
    "dbrx": [_LLAMA3_SPLIT], "smaug-bpe": [_LLAMA3_SPLIT], "falcon3": [_LLAMA3_SPLIT],
    "pixtral": [_LLAMA3_SPLIT],
    "qwen2": [_QWEN2_SPLIT], "deepseek-r1-qwen": [_QWEN2_SPLIT], "stablelm2": [_QWEN2_SPLIT],
    "megrez": [_QWEN2_SPLIT], "qwen35": [_QWEN35_SPLIT],
}
# llama.cpp matches a whole-word vocabulary entry before merging for these (Llama 3's tokenizer.json
# says ignore_merges: true).
_IGNORE_MERGES = {"llama3", "llama-v3", "llama-bpe", "dbrx", "smaug-bpe", "falcon3", "pixtral"}


@dataclass(slots=True)
class GGUFVocab:
    """The `tokenizer.ggml.*` arrays of one file."""

    model: str  # "gpt2" | "llama"
    pre: str | None
    tokens: list[str]
    token_types: list[int]
    scores: list[float] | None
    merges: list[str] | None
    add_space_prefix: bool
    unk_token_id: int | None


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table used by byte-level BPE."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def build_tokenizer_json(vocab: GGUFVocab, source: str) -> str:
    """tokenizer.json text for the vocabulary; raises ArtifactError naming `source` if unsupported."""
    if vocab.model == "gpt2":
        tok = _byte_level(vocab, source)
    elif vocab.model == "llama":
        tok = _sentencepiece(vocab, source)
    else:
        raise ArtifactError(f"{source}: unsupported tokenizer model {vocab.model!r} (supported: gpt2, llama)")
    data = json.loads(tok.to_str())
    data["added_tokens"] = _added_tokens(vocab)
    text = json.dumps(data, ensure_ascii=False)
    Tokenizer.from_str(text)  # fail here, not at load time
    return text


def _byte_level(vocab: GGUFVocab, source: str) -> Tokenizer:
    spelling = bytes_to_unicode()
    alphabet = set(spelling.values())
    # Tokens outside the byte alphabet (e.g. user-defined "  ") are respelled byte by byte.
    ids = {(t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8"))): i
           for i, t in enumerate(vocab.tokens)}
    if vocab.merges is None:
        raise ArtifactError(f"{source}: byte-level BPE vocabulary has no tokenizer.ggml.merges")
    merges = [tuple(m.split(" ", 1)) for m in vocab.merges]
    pre = vocab.pre or "default"
    if pre not in _PRE_SPLITS:
        raise ArtifactError(f"{source}: unsupported pre-tokenizer {pre!r} (tokenizer.ggml.pre)")
    bpe = models.BPE(vocab=ids, merges=merges, fuse_unk=False, byte_fallback=False,
                     ignore_merges=pre in _IGNORE_MERGES)
    tok = Tokenizer(bpe)
    splits = _PRE_SPLITS[pre]
    if splits is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    elif splits == [r"\p{N}"]:
        # digits one by one, then GPT-2's regex (llama.cpp's smollm/starcoder pre-tokenizer)
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(r"\p{N}"), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ])
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(s), behavior="isolated") for s in splits]
            + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    return tok


def _sentencepiece(vocab: GGUFVocab, source: str) -> Tokenizer:
    ids = {t: i for i, t in enumerate(vocab.tokens)}
    if vocab.merges is not None:
        merges = [tuple(m.split(" ", 1)) for m in vocab.merges]
    else:
        if vocab.scores is None:
            raise ArtifactError(f"{source}: SentencePiece vocabulary has neither merges nor scores")
        merges = _merges_from_scores(ids, dict(zip(vocab.tokens, vocab.scores)))
    unk = None
    if vocab.unk_token_id is not None and 0 <= vocab.unk_token_id < len(vocab.tokens):
        unk = vocab.tokens[vocab.unk_token_id]
    tok = Tokenizer(models.BPE(vocab=ids, merges=merges, unk_token=unk, fuse_unk=True, byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme="first" if vocab.add_space_prefix else "never", split=False)
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if vocab.add_space_prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    tok.decoder = decoders.Sequence(steps)
    return tok


def _merges_from_scores(ids: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    # Every split of a vocabulary piece into two vocabulary pieces is a merge, ranked by the
    # merged piece's score (higher first), as SentencePiece's BPE would apply them.
    ranked: list[tuple[float, int, int, str, str]] = []
    for piece, score in scores.items():
        local = [(piece[:k], piece[k:]) for k in range(1, len(piece)) if piece[:k] in ids and piece[k:] in ids]
        local.sort(key=lambda lr: (ids[lr[0]], ids[lr[1]]))
        ranked.extend((score, len(lhs), len(rhs), lhs, rhs) for lhs, rhs in local)
    ranked.sort(key=lambda m: (m[0], m[1], m[2]), reverse=True)
    return [(m[3], m[4]) for m in ranked]


def _added_tokens(vocab: GGUFVocab) -> list[dict]:
    out = []
    for i, (text, kind) in enumerate(zip(vocab.tokens, vocab.token_types)):
        if kind in (TOKEN_CONTROL, TOKEN_USER_DEFINED) and text:
            out.append({"id": i, "content": text, "single_word": False, "lstrip": False, "rstrip": False,
                        "normalized": False, "special": kind == TOKEN_CONTROL})
    return out
