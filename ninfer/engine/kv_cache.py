"""The KV page pool and the recurrent-state slot pool: ids, refcounts and a free list, in plain
Python (no torch).

A page holds `page_size` consecutive token positions of one sequence in every layer; the runner
owns the physical tensors and addresses them by page id. A page is shared by refcount: a
sequence that reuses a retained prefix holds the same full pages as the prefix cache entry,
and a page returns to the free list only when its last holder releases it.

A state slot holds every recurrent layer's state (conv window + delta-rule matrix) of one
sequence at one token position: a running sequence's working state, or a retained entry's
checkpoint. It is never shared for writing; the refcount only keeps a checkpoint alive until a
pending copy out of it has run.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Iterable


def pages_for_tokens(num_tokens: int, page_size: int) -> int:
    """Pages needed to hold `num_tokens` positions."""
    return -(-num_tokens // page_size)


class _RefcountedIds:
    """Ids 0..n-1 with refcounts and a FIFO free list. Allocation takes the free list's head and
    frees go to its tail, so ids are deterministic (a fresh pool hands out 0, 1, 2, ...)."""

    __slots__ = ("_refcounts", "_free")
    _what = "id"  # what an id names, for assertion messages

    def __init__(self, n: int) -> None:
        self._refcounts = [0] * n
        self._free: deque[int] = deque(range(n))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._refcounts) - len(self._free)

    def refcount(self, i: int) -> int:
        return self._refcounts[i]

    def allocate(self, n: int) -> list[int]:
        """Take `n` free ids (refcount 1 each). The caller checked `num_free` first."""
        assert 0 <= n <= len(self._free), f"allocate({n}) with {len(self._free)} free {self._what}s"
        ids = [self._free.popleft() for _ in range(n)]
        for i in ids:
            self._refcounts[i] = 1
        return ids

    def incref(self, ids: Iterable[int]) -> None:
        """Add a holder to ids that are already in use (sharing a prefix, pinning a copy source)."""
        for i in ids:
            assert self._refcounts[i] > 0, f"incref of free {self._what} {i}"
            self._refcounts[i] += 1

    def decref(self, ids: Iterable[int]) -> list[int]:
        """Drop one holder from each id; returns the ids that became free, in order."""
        freed: list[int] = []
        for i in ids:
            assert self._refcounts[i] > 0, f"decref of free {self._what} {i}"
            self._refcounts[i] -= 1
            if self._refcounts[i] == 0:
                self._free.append(i)
                freed.append(i)
        return freed


class PagePool(_RefcountedIds):
    """Fixed pool of `num_pages` KV pages of `page_size` token positions each."""

    __slots__ = ("num_pages", "page_size")
    _what = "page"

    def __init__(self, num_pages: int, page_size: int) -> None:
        assert num_pages > 0 and page_size > 0
        super().__init__(num_pages)
        self.num_pages = num_pages
        self.page_size = page_size

    def free_page_ids(self) -> list[int]:
        """The free list, head first (tests and invariant checks)."""
        return list(self._free)


class StatePool(_RefcountedIds):
    """Fixed pool of `num_slots` recurrent-state slots (hybrid models only; a pure-attention
    model has no StatePool).

    Sizing: a running sequence holds one working slot and, once its prefill passed its page
    checkpoint, a captured checkpoint slot; a retained prefix-cache entry holds up to two
    checkpoint slots (page and frontier). So the engine sizes the pool as 2 x max_concurrency
    (working + capture, per lane) + 2 x the retained entries (normally
    --max-private-continuations; loader.resolve_state_slots). Admission evicts least recently
    used entries when no slot is free, and a capture takes only a slot the idle lanes could not
    need, so a smaller pool only retains fewer conversations and checkpoints; fewer than
    max_concurrency slots in all would leave lanes idle and is refused by the scheduler."""

    __slots__ = ("num_slots",)
    _what = "state slot"

    def __init__(self, num_slots: int) -> None:
        assert num_slots > 0
        super().__init__(num_slots)
        self.num_slots = num_slots

    def free_slot_ids(self) -> list[int]:
        """The free list, head first (tests and invariant checks)."""
        return list(self._free)
