"""The context cache: retained finished conversations whose KV pages a new prompt can reuse.

Each entry is a private continuation: the token ids whose KV its pages hold (positions 0..n-1)
and those pages, one reference each. With paged attention every prefix of an entry is a valid
checkpoint, so a prompt that extends a retained conversation (the next turn), or repeats a raw
prompt (a regenerated completion), reuses the longest common prefix. The catalog is small
(--max-private-continuations, 2 x concurrency by default), so lookup is a scan comparing one
page of tokens at a time. Eviction is least recently used first, and only releases the entry's
references: a page an active request also holds stays allocated until that request ends.

With recurrent state (a hybrid model: a StatePool is given) an entry also keeps checkpoints:
state slots holding the recurrent state after exactly a number of its tokens. Its frontier
checkpoint (the state after all its tokens) is the finished sequence's working slot, handed
over; a page checkpoint (at most one, the request's last prompt page boundary below its
frontier) is a copy the scheduler captured while prefilling. That state cannot be rewound, so a
hybrid prompt resumes only at a checkpoint: `match_checkpoint` finds the longest checkpoint
position of any entry that lies on the prompt. Dropping an entry releases every checkpoint slot
with its pages.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Protocol

from ninfer.engine.kv_cache import PagePool, StatePool, pages_for_tokens

LONG_RAW_PROMPT = 512  # raw prompts this long resume one token short of their end (spec)


@dataclass(slots=True)
class CacheEntry:
    entry_id: int
    token_ids: list[int]  # tokens whose KV the pages hold
    pages: list[int]  # pages_for_tokens(len(token_ids)) pages; this entry holds one ref on each
    last_used: int  # LRU clock value of the last insert or hit
    slot: int  # its cell in 0..max_entries-1 (the /slots id, a response's id_slot); stable while retained
    session: tuple[int, ...]  # the session: token_ids plus any sampled tokens not yet executed
    state_slot: int = -1  # frontier checkpoint: the state after exactly token_ids (one ref); -1 without recurrent state
    # page checkpoints below the frontier: (position, state slot holding the state after exactly
    # token_ids[:position]; one ref), position a multiple of page_size, ascending
    page_checkpoints: list[tuple[int, int]] = field(default_factory=list)

    def checkpoints(self) -> list[tuple[int, int]]:
        """Every (position, state slot) checkpoint, ascending; empty without recurrent state."""
        frontier = [(len(self.token_ids), self.state_slot)] if self.state_slot >= 0 else []
        return self.page_checkpoints + frontier


@dataclass(slots=True, frozen=True)
class PrefixMatch:
    entry_id: int
    num_tokens: int  # tokens of the prompt matched by the entry (already capped by max_tokens)
    entry_tokens: int  # the entry's length (its KV frontier)
    state_slot: int = -1  # match_checkpoint: the checkpoint slot holding the state after num_tokens


def reuse_path(match_tokens: int, entry_tokens: int, prompt_len: int, raw_prompt: bool) -> str:
    """The spec's reuse path name for an admission that reused `match_tokens` tokens. A hybrid
    prompt resuming at an entry's page checkpoint (below its frontier) is named like any reuse
    that stops inside an entry: shared_stable_prefix (private_long_anchor in the rare case the
    checkpoint sits one token short of a long raw prompt)."""
    if match_tokens <= 0:
        return "root"
    if match_tokens >= entry_tokens:
        return "private_endpoint"  # the prompt continues the retained conversation
    if raw_prompt and prompt_len >= LONG_RAW_PROMPT and match_tokens == prompt_len - 1:
        return "private_long_anchor"  # the same long raw prompt sent again
    return "shared_stable_prefix"


def common_prefix_len(a: list[int], b: list[int], step: int = 64) -> int:
    """Length of the longest common prefix of `a` and `b` (compares `step` tokens at a time)."""
    n = min(len(a), len(b))
    i = 0
    while i < n:
        j = min(i + step, n)
        if a[i:j] != b[i:j]:
            while a[i] == b[i]:
                i += 1
            return i
        i = j
    return n


class CacheListener(Protocol):
    def evicted(self, entry: CacheEntry) -> None: ...

    def superseded(self, entry_ids: list[int], new_entry: CacheEntry) -> None: ...


class PrefixCache:
    """Retained continuations over a PagePool (and, for a hybrid model, a StatePool holding
    their checkpoints), at most `max_entries` of them."""

    __slots__ = ("pool", "max_entries", "state_pool", "listener", "_entries", "_clock", "_next_id")

    def __init__(self, pool: PagePool, max_entries: int, state_pool: StatePool | None = None) -> None:
        self.pool = pool
        self.max_entries = max_entries
        self.state_pool = state_pool
        # the context tiers (engine/tiers.py), told of every involuntary eviction before the
        # entry's pages are released (evicted(entry)) and of every entry a longer one replaced
        # (superseded(entry_ids, new_entry)); None: nothing is told
        self.listener: CacheListener | None = None
        self._entries: dict[int, CacheEntry] = {}
        self._clock = 0
        self._next_id = 0

    def __len__(self) -> int:
        return len(self._entries)

    def entries(self) -> list[CacheEntry]:
        """Entries, least recently used first."""
        return sorted(self._entries.values(), key=lambda e: e.last_used)

    def pages_held(self) -> set[int]:
        return {p for e in self._entries.values() for p in e.pages}

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def match(self, token_ids: list[int], max_tokens: int) -> PrefixMatch | None:
        """The entry sharing the longest prefix with `token_ids`, capped at `max_tokens`
        (ties go to the most recently used). None when nothing matches."""
        best: PrefixMatch | None = None
        for e in sorted(self._entries.values(), key=lambda e: -e.last_used):
            n = min(common_prefix_len(token_ids, e.token_ids, self.pool.page_size), max_tokens)
            if n > 0 and (best is None or n > best.num_tokens):
                best = PrefixMatch(e.entry_id, n, len(e.token_ids))
        return best

    def match_checkpoint(self, token_ids: list[int], max_tokens: int) -> PrefixMatch | None:
        """The longest checkpoint of any entry that lies on `token_ids` (the entry's tokens up to
        it are a prefix of them) and is at most `max_tokens` long: the only matches recurrent
        state can resume from. Ties go to the most recently used entry. None when none qualifies."""
        best: PrefixMatch | None = None
        for e in sorted(self._entries.values(), key=lambda e: -e.last_used):
            common = None
            for n, slot in reversed(e.checkpoints()):
                if not (0 < n <= max_tokens) or (best is not None and n <= best.num_tokens):
                    continue
                if common is None:
                    common = common_prefix_len(token_ids, e.token_ids, self.pool.page_size)
                if n <= common:
                    best = PrefixMatch(e.entry_id, n, len(e.token_ids), slot)
                    break
        return best

    def entry_pages(self, entry_id: int) -> list[int]:
        """The entry's pages (a copy); a sequence that shares some of them increfs them."""
        return list(self._entries[entry_id].pages)

    def touch(self, entry_id: int) -> None:
        """Mark an entry most recently used (a prompt reused it); a no-op if it is gone."""
        e = self._entries.get(entry_id)
        if e is not None:
            e.last_used = self._tick()

    def insert(self, token_ids: list[int], pages: list[int], session: list[int] | None = None,
               state_slot: int = -1, page_checkpoints: list[tuple[int, int]] | None = None,
               slot: int | None = None) -> list[int]:
        """Retain a finished sequence: the caller hands over one reference on each page and, for
        a hybrid model, its working `state_slot` (the state after exactly `token_ids`), which
        becomes the entry's frontier checkpoint, and its captured `page_checkpoints` ((position,
        slot), one reference each, positions page aligned and below the frontier). `session`
        (default `token_ids`) is the whole conversation, which may run past the KV frontier by
        the last sampled token.

        Entries whose tokens are a prefix of the new one are dropped (the new entry serves
        every prompt they could); then the least recently used go while the catalog is full.
        The new entry takes the lowest free cell, or `slot` (a restored session: the caller
        emptied that cell). Returns the ids of the entries removed, in order."""
        assert len(pages) == pages_for_tokens(len(token_ids), self.pool.page_size)
        assert self.max_entries >= 1
        assert (state_slot >= 0) == (self.state_pool is not None), "a hybrid entry needs its checkpoint"
        page_checkpoints = sorted(page_checkpoints or [])
        assert all(0 < n < len(token_ids) and n % self.pool.page_size == 0 for n, _ in page_checkpoints)
        removed = [e.entry_id for e in self.entries()
                   if len(e.token_ids) <= len(token_ids) and token_ids[:len(e.token_ids)] == e.token_ids]
        for entry_id in removed:
            self.drop(entry_id)
        superseded = list(removed)
        # evict before inserting so the new entry can take the victim's cell; the victims are the
        # same as after inserting, since the new entry is the most recently used
        while len(self._entries) >= self.max_entries:
            victim = self.entries()[0]
            self._evict_one(victim)
            removed.append(victim.entry_id)
        used = {e.slot for e in self._entries.values()}
        if slot is None:
            slot = next(i for i in range(self.max_entries) if i not in used)
        assert 0 <= slot < self.max_entries and slot not in used, f"cell {slot} is taken"
        entry = CacheEntry(self._next_id, list(token_ids), list(pages), self._tick(), slot,
                           tuple(session if session is not None else token_ids), state_slot, page_checkpoints)
        self._next_id += 1
        self._entries[entry.entry_id] = entry
        if superseded and self.listener is not None:
            self.listener.superseded(superseded, entry)
        return removed

    def entry_in_slot(self, slot: int) -> CacheEntry | None:
        """The entry retained in cell `slot`, if any."""
        return next((e for e in self._entries.values() if e.slot == slot), None)

    def get(self, entry_id: int) -> CacheEntry | None:
        return self._entries.get(entry_id)

    def _evict_one(self, entry: CacheEntry) -> None:
        # an involuntary eviction: the listener copies what it keeps before the pages go
        if self.listener is not None:
            self.listener.evicted(entry)
        self.drop(entry.entry_id)

    def newest(self) -> CacheEntry:
        """The entry inserted last (an insert makes it the most recently used)."""
        return max(self._entries.values(), key=lambda e: e.last_used)

    def drop(self, entry_id: int) -> list[int]:
        """Remove one entry and release its page references and its checkpoint slots; returns
        the pages freed."""
        e = self._entries.pop(entry_id)
        if e.state_slot >= 0:
            assert self.state_pool is not None
            self.state_pool.decref([slot for _, slot in e.checkpoints()])
        return self.pool.decref(e.pages)

    def _freeable(self, entry: CacheEntry) -> int:
        # pages this entry is the last holder of
        return sum(1 for p in entry.pages if self.pool.refcount(p) == 1)

    def _slots_freed(self, entry: CacheEntry) -> int:
        # checkpoints the entry holds the last reference on (no pending copy pins them)
        return sum(1 for _, slot in entry.checkpoints() if self.state_pool.refcount(slot) == 1)

    def freeable_slots(self) -> int:
        """State slots that evicting every entry would return to the pool (a checkpoint pinned
        by a pending copy is not counted)."""
        return sum(self._slots_freed(e) for e in self._entries.values())

    def freeable_pages(self) -> int:
        """Pages that evicting every entry would return to the pool (pages an active request
        also holds are not counted)."""
        holders = Counter(p for e in self._entries.values() for p in e.pages)
        return sum(1 for p, n in holders.items() if self.pool.refcount(p) == n)

    def evict(self, need_free: int, need_free_slots: int = 0) -> list[int]:
        """Evict least recently used entries until the page pool has `need_free` free pages and
        the state pool `need_free_slots` free slots, skipping entries whose eviction would free
        nothing that is still short. Returns the evicted entry ids in order."""
        evicted: list[int] = []
        while True:
            short_pages = self.pool.num_free < need_free
            short_slots = self.state_pool is not None and self.state_pool.num_free < need_free_slots
            if not (short_pages or short_slots):
                break
            victim = next((e for e in self.entries() if (short_pages and self._freeable(e) > 0)
                           or (short_slots and self._slots_freed(e) > 0)), None)
            if victim is None:
                break
            self._evict_one(victim)
            evicted.append(victim.entry_id)
        return evicted

    def clear(self) -> None:
        for entry_id in list(self._entries):
            self.drop(entry_id)
