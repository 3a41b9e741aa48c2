"""The KV page pool: page ids, refcounts and a free list, in plain Python (no torch).

A page holds `page_size` consecutive token positions of one sequence in every layer; the runner
owns the physical tensors and addresses them by page id. A page is shared by refcount: a
sequence that reuses a retained prefix holds the same full pages as the prefix cache entry,
and a page returns to the free list only when its last holder releases it.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Iterable


def pages_for_tokens(num_tokens: int, page_size: int) -> int:
    """Pages needed to hold `num_tokens` positions."""
    return -(-num_tokens // page_size)


class PagePool:
    """Fixed pool of `num_pages` KV pages. Allocation takes the free list's head and frees
    go to its tail, so page ids are deterministic (a fresh pool hands out 0, 1, 2, ...)."""

    __slots__ = ("num_pages", "page_size", "_refcounts", "_free")

    def __init__(self, num_pages: int, page_size: int) -> None:
        assert num_pages > 0 and page_size > 0
        self.num_pages = num_pages
        self.page_size = page_size
        self._refcounts = [0] * num_pages
        self._free: deque[int] = deque(range(num_pages))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free)

    def refcount(self, page: int) -> int:
        return self._refcounts[page]

    def allocate(self, n: int) -> list[int]:
        """Take `n` free pages (refcount 1 each). The caller checked `num_free` first."""
        assert 0 <= n <= len(self._free), f"allocate({n}) with {len(self._free)} free pages"
        pages = [self._free.popleft() for _ in range(n)]
        for p in pages:
            self._refcounts[p] = 1
        return pages

    def incref(self, pages: Iterable[int]) -> None:
        """Add a holder to pages that are already in use (sharing a prefix)."""
        for p in pages:
            assert self._refcounts[p] > 0, f"incref of free page {p}"
            self._refcounts[p] += 1

    def decref(self, pages: Iterable[int]) -> list[int]:
        """Drop one holder from each page; returns the pages that became free, in order."""
        freed: list[int] = []
        for p in pages:
            assert self._refcounts[p] > 0, f"decref of free page {p}"
            self._refcounts[p] -= 1
            if self._refcounts[p] == 0:
                self._free.append(p)
                freed.append(p)
        return freed

    def free_page_ids(self) -> list[int]:
        """The free list, head first (tests and invariant checks)."""
        return list(self._free)
