"""Context-lookup drafting (--spec lookup): propose what followed the longest recent earlier match
of the request's last n tokens (ngram_min <= n <= ngram_max) in its own prompt and output.

Each request keeps one index per n: n-gram -> the position right after its latest occurrence,
extended as tokens are committed (amortized O(ngram_max - ngram_min + 1) per token), so a proposal
is a few dict lookups whatever the context length.

Automatic per request: a round whose drafts all fail costs a wider forward for nothing, so after
FAILS_BEFORE_BACKOFF such rounds in a row the request decodes plainly for a backoff of steps
(doubling up to MAX_BACKOFF while probes keep failing), then probes again; any accepted draft
resets both.
"""
from __future__ import annotations

from dataclasses import dataclass, field

FAILS_BEFORE_BACKOFF = 3
FIRST_BACKOFF = 8  # plain decode steps before the first probe
MAX_BACKOFF = 256


@dataclass(slots=True)
class LookupState:
    """One request's n-gram index and fallback state."""

    index: dict[int, dict[tuple[int, ...], int]] = field(default_factory=dict)  # n -> n-gram -> next position
    indexed: int = 0  # positions < indexed have had their n-grams ending there recorded
    failed_rounds: int = 0  # consecutive rounds that accepted nothing
    backoff: int = 0  # the current backoff length (0: none yet)
    skip: int = 0  # plain steps left before the next probe
    fallback_steps: int = 0  # decode steps taken without drafts while backing off


class LookupDrafter:
    """Proposes up to `draft_tokens` tokens per round from the request's own context."""

    def __init__(self, draft_tokens: int, ngram_min: int, ngram_max: int) -> None:
        self.draft_tokens = draft_tokens
        self.ngram_min = ngram_min
        self.ngram_max = ngram_max

    def new_state(self) -> LookupState:
        return LookupState(index={n: {} for n in range(self.ngram_min, self.ngram_max + 1)})

    def propose(self, state: LookupState, tokens: list[int], limit: int) -> list[int]:
        """Drafts to verify after tokens[-1] (at most min(limit, draft_tokens)); [] while backing
        off or when no n-gram of the context's tail occurred before."""
        limit = min(limit, self.draft_tokens)
        if limit <= 0:
            return []
        if state.skip > 0:
            state.skip -= 1
            state.fallback_steps += 1
            return []
        self._extend(state, tokens)
        end = len(tokens)
        for n in range(min(self.ngram_max, end - 1), self.ngram_min - 1, -1):
            pos = state.index[n].get(tuple(tokens[end - n:]))
            if pos is not None:
                return tokens[pos:pos + limit]
        return []

    def observe(self, state: LookupState, drafted: int, accepted: int) -> None:
        """Record a verified round: `drafted` drafts of which `accepted` survived."""
        if drafted == 0:
            return
        if accepted > 0:
            state.failed_rounds = state.backoff = 0
            return
        state.failed_rounds += 1
        if state.failed_rounds >= FAILS_BEFORE_BACKOFF:
            state.backoff = min(MAX_BACKOFF, state.backoff * 2 if state.backoff else FIRST_BACKOFF)
            state.skip = state.backoff
            state.failed_rounds = FAILS_BEFORE_BACKOFF - 1  # a failed probe backs off again at once

    def _extend(self, state: LookupState, tokens: list[int]) -> None:
        # record every n-gram ending at positions indexed..len-1 (not the tail itself: it ends at
        # len, and its continuation is what we are looking for)
        last = len(tokens) - 1
        for end in range(max(state.indexed, 1), last + 1):
            for n, table in state.index.items():
                if end >= n:
                    table[tuple(tokens[end - n:end])] = end
        state.indexed = max(state.indexed, last + 1)
