"""Per-request output text: incremental detokenization, stop tokens and stop strings.

Token bytes go through an incremental UTF-8 decoder, so a character split across tokens is emitted
once complete and bytes that can never form one become U+FFFD, exactly as decoding all the bytes at
once would. Decoded text is then checked against the stop strings: a stop string can span tokens;
text that could still grow into one is withheld until it is resolved; the matched stop string and
everything after it are never emitted.

Special tokens that are not stops are emitted as their text (llama.cpp's default) unless
`skip_special_tokens` (raw completions, where the spec returns the generated text without them).
"""
from __future__ import annotations

import codecs
from bisect import bisect_left
from dataclasses import dataclass
from typing import Protocol


class TokenText(Protocol):
    """What the processor needs from a tokenizer (ninfer.engine.tokenizer.Tokenizer has it)."""

    special_token_ids: frozenset[int]
    stop_token_ids: frozenset[int]

    def token_bytes(self, token_id: int) -> bytes: ...


@dataclass(slots=True)
class StepText:
    """What one appended token released.

    text: newly committed text (never a partial UTF-8 character, never part of a possible stop
    match). stop_reason: the matched stop string, or the stop token id, once finished.
    tokens_published: how many output tokens (stop tokens excluded) have had their first byte
    committed so far, cumulative; a logprob record travels with the text that publishes its token,
    and the records of tokens a stop string cuts are never published.
    """

    text: str
    finished: bool = False
    stop_reason: str | int | None = None
    tokens_published: int = 0


class OutputProcessor:
    """Turns generated token ids into committed text, one `append` per token.

    stop_token_ids: extra stop tokens; the tokenizer's own stop tokens are added unless
    ignore_eos, which removes them (the spec's "drops the checkpoint's own stop tokens").
    """

    def __init__(self, tokenizer: TokenText, stop: list[str], stop_token_ids: frozenset[int],
                 ignore_eos: bool, *, skip_special_tokens: bool = False) -> None:
        self._tokenizer = tokenizer
        self._stops = [s for s in dict.fromkeys(stop) if s]  # deduplicated, non-empty, in order
        model_stops = frozenset(tokenizer.stop_token_ids)
        self.stop_token_ids = (frozenset(stop_token_ids) - model_stops) if ignore_eos \
            else (frozenset(stop_token_ids) | model_stops)
        self._skip_special = skip_special_tokens
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._bytes_fed = 0
        # Decoded but uncommitted text, as (text, stream bytes it consumed) pieces: a suffix that
        # could still begin a stop string. Byte counts map committed characters back to tokens.
        self._held: list[tuple[str, int]] = []
        self._committed: list[str] = []
        self._committed_bytes = 0
        self._token_starts: list[int] = []  # stream byte offset where each output token begins
        self._token_empty: list[bool] = []  # the token added no bytes (a skipped special token)
        self.finished = False
        self.stop_reason: str | int | None = None

    @property
    def text_so_far(self) -> str:
        """All text committed so far."""
        return "".join(self._committed)

    def append(self, token_id: int) -> StepText:
        """Add one generated token; returns the text it commits and whether output is finished."""
        assert not self.finished, "append after the output finished"
        if token_id in self.stop_token_ids:
            text = self._release(final=True)
            self.finished, self.stop_reason = True, token_id
            return self._step(text)
        if self._skip_special and token_id in self._tokenizer.special_token_ids:
            data = b""
        else:
            data = self._tokenizer.token_bytes(token_id)
        self._token_starts.append(self._bytes_fed)
        self._token_empty.append(not data)
        return self._step(self._feed(data, final=False))

    def finish(self) -> str:
        """End output for another reason (length, cancel): release the withheld text.

        Incomplete UTF-8 at the end becomes U+FFFD. A stop string that the final flush completes
        still cuts the text (then `stop_reason` is set).
        """
        if self.finished:
            return ""
        text = self._release(final=True)
        self.finished = True
        return text

    def _step(self, text: str) -> StepText:
        return StepText(text=text, finished=self.finished, stop_reason=self.stop_reason,
                        tokens_published=self._tokens_published())

    def _feed(self, data: bytes, *, final: bool) -> str:
        before = self._bytes_fed - len(self._decoder.getstate()[0])
        piece = self._decoder.decode(data, final)
        self._bytes_fed += len(data)
        consumed = self._bytes_fed - len(self._decoder.getstate()[0]) - before
        if piece or consumed:
            self._held.append((piece, consumed))
        return self._resolve(final)

    def _release(self, *, final: bool) -> str:
        return self._feed(b"", final=final)

    def _resolve(self, final: bool) -> str:
        """Commit what can no longer be part of a stop match; stop at the first complete match."""
        held = "".join(text for text, _ in self._held)
        match = self._first_match(held)
        if match is not None:
            start, stop = match
            out = self._commit(start)
            self._held.clear()
            self.finished, self.stop_reason = True, stop
            return out
        keep = 0 if final else self._possible_prefix_len(held)
        return self._commit(len(held) - keep)

    def _first_match(self, text: str) -> tuple[int, str] | None:
        """The stop string that completes first in `text` (ties: the one starting earlier)."""
        best: tuple[int, int, str] | None = None
        for stop in self._stops:
            i = text.find(stop)
            if i >= 0 and (best is None or (i + len(stop), i) < best[:2]):
                best = (i + len(stop), i, stop)
        return None if best is None else (best[1], best[2])

    def _possible_prefix_len(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
        longest = 0
        for stop in self._stops:
            for k in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:k]):
                    longest = k
                    break
        return longest

    def _commit(self, n_chars: int) -> str:
        """Move the first n_chars of the held text to the committed text."""
        out: list[str] = []
        while n_chars > 0 and self._held:
            text, nbytes = self._held[0]
            if len(text) <= n_chars:
                out.append(text)
                self._committed_bytes += nbytes
                n_chars -= len(text)
                self._held.pop(0)
                continue
            head = text[:n_chars]
            # Exact unless the piece holds a U+FFFD that stands for fewer or more bytes.
            head_bytes = min(len(head.encode("utf-8")), nbytes)
            out.append(head)
            self._committed_bytes += head_bytes
            self._held[0] = (text[n_chars:], nbytes - head_bytes)
            n_chars = 0
        text = "".join(out)
        if text:
            self._committed.append(text)
        return text

    @property
    def tokens_published(self) -> int:
        """Output tokens (stop tokens excluded) whose first byte has been committed."""
        return self._tokens_published()

    def _tokens_published(self) -> int:
        if self.finished and not isinstance(self.stop_reason, str):
            return len(self._token_starts)  # no stop string cut: everything was released
        # Tokens are ordered by start offset; a token with bytes is published once its first byte
        # is committed (start < committed), an empty one once output reaches it (start <= committed).
        n = bisect_left(self._token_starts, self._committed_bytes)
        while n < len(self._token_starts) and self._token_empty[n] \
                and self._token_starts[n] == self._committed_bytes:
            n += 1
        return n
