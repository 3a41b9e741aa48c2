"""Prefix index: longest-prefix match, domination, LRU eviction that spares pages in use."""
from __future__ import annotations

from ninfer.engine.kv_cache import PagePool, StatePool
from ninfer.engine.prefix_cache import PrefixCache, common_prefix_len, reuse_path

P = 4  # small pages keep the token lists readable


def _retain(cache: PrefixCache, tokens: list[int]) -> list[int]:
    pages = cache.pool.allocate(-(-len(tokens) // P))
    cache.insert(tokens, pages)
    return pages


def test_common_prefix_len() -> None:
    a = list(range(10))
    assert common_prefix_len(a, a, step=4) == 10
    assert common_prefix_len(a, a[:7], step=4) == 7
    assert common_prefix_len(a, a[:5] + [99, 6], step=4) == 5
    assert common_prefix_len(a, [1], step=4) == 0


def test_match_picks_longest_then_most_recent() -> None:
    cache = PrefixCache(PagePool(16, P), max_entries=4)
    _retain(cache, [1, 2, 3, 4, 5, 6])
    _retain(cache, [1, 2, 3, 9, 9])
    m = cache.match([1, 2, 3, 4, 5, 7, 8], max_tokens=6)
    assert (m.entry_id, m.num_tokens, m.entry_tokens) == (0, 5, 6)
    m = cache.match([1, 2, 3, 0], max_tokens=3)  # both match 3: the newer wins
    assert (m.entry_id, m.num_tokens) == (1, 3)
    cache.touch(0)
    assert cache.match([1, 2, 3, 0], max_tokens=3).entry_id == 0
    assert cache.match([7, 7], max_tokens=1) is None


def test_insert_drops_entries_the_new_one_extends() -> None:
    pool = PagePool(16, P)
    cache = PrefixCache(pool, max_entries=4)
    _retain(cache, [1, 2, 3, 4, 5])  # entry 0: pages 0, 1
    shared = cache.entry_pages(0)[:1]
    pool.incref(shared)  # a turn that reused the first page, then finished
    own = pool.allocate(2)
    assert own == [2, 3]
    removed = cache.insert([1, 2, 3, 4, 5, 6, 7, 8, 9], shared + own)
    assert removed == [0]
    assert [e.entry_id for e in cache.entries()] == [1]
    assert cache.entries()[0].pages == [0, 2, 3]
    assert pool.free_page_ids()[-1] == 1  # the dropped entry's private tail page was freed


def test_capacity_evicts_least_recently_used() -> None:
    pool = PagePool(16, P)
    cache = PrefixCache(pool, max_entries=2)
    _retain(cache, [1, 1])
    _retain(cache, [2, 2])
    cache.touch(0)
    assert cache.insert([3, 3], pool.allocate(1)) == [1]
    assert [e.token_ids for e in cache.entries()] == [[1, 1], [3, 3]]


def test_pressure_eviction_order_spares_pages_in_use() -> None:
    pool = PagePool(8, P)
    cache = PrefixCache(pool, max_entries=8)
    a = _retain(cache, [1] * 8)  # entry 0: pages 0, 1
    b = _retain(cache, [2] * 8)  # entry 1: pages 2, 3
    c = _retain(cache, [3] * 4)  # entry 2: page 4
    assert (a, b, c) == ([0, 1], [2, 3], [4])
    pool.incref(a)  # an active request holds all of entry 0's pages
    assert cache.freeable_pages() == 3
    assert pool.num_free == 3
    # entry 0 is least recently used but frees nothing, so entry 1 goes first, then entry 2
    assert cache.evict(5) == [1]
    assert pool.free_page_ids() == [5, 6, 7, 2, 3]
    assert cache.evict(6) == [2]
    assert cache.evict(8) == []  # entry 0's pages stay with the active request
    assert len(cache) == 1 and pool.num_free == 6
    pool.decref(a)
    assert cache.evict(8) == [0] and pool.num_free == 8


def test_reuse_path_names() -> None:
    assert reuse_path(0, 10, 20, False) == "root"
    assert reuse_path(10, 10, 20, False) == "private_endpoint"
    assert reuse_path(599, 700, 600, True) == "private_long_anchor"
    assert reuse_path(300, 700, 600, False) == "shared_stable_prefix"
    assert reuse_path(99, 700, 100, True) == "shared_stable_prefix"  # short raw prompt


def test_entries_keep_a_stable_cell_and_reuse_freed_ones() -> None:
    cache = PrefixCache(PagePool(16, P), max_entries=3)
    for tokens in ([1, 1], [2, 2], [3, 3]):
        _retain(cache, tokens)
    assert {e.slot: e.token_ids for e in cache.entries()} == {0: [1, 1], 1: [2, 2], 2: [3, 3]}
    _retain(cache, [2, 2, 2])  # extends entry 1: takes the cell it frees, the others keep theirs
    _retain(cache, [4, 4])  # full: the LRU entry ([1, 1], cell 0) goes, and its cell is reused
    assert {e.slot: e.token_ids for e in cache.entries()} == {2: [3, 3], 1: [2, 2, 2], 0: [4, 4]}
    pages = cache.pool.allocate(1)
    cache.insert([5, 5], pages, session=[5, 5, 6])
    assert cache.newest().session == (5, 5, 6) and cache.newest().token_ids == [5, 5]


def _retain_hybrid(cache: PrefixCache, tokens: list[int], page_checkpoint: int = 0) -> tuple[list[int], int]:
    pages = cache.pool.allocate(-(-len(tokens) // P))
    (slot,) = cache.state_pool.allocate(1)  # the finished sequence's working slot, handed over
    inner = [(page_checkpoint, cache.state_pool.allocate(1)[0])] if page_checkpoint else []  # its capture
    cache.insert(tokens, pages, state_slot=slot, page_checkpoints=inner)
    return pages, slot


def test_checkpoint_match_needs_the_whole_entry() -> None:
    cache = PrefixCache(PagePool(16, P), max_entries=4, state_pool=StatePool(4))
    _retain_hybrid(cache, [1, 2, 3, 4, 5, 6])  # entry 0, checkpoint slot 0
    _retain_hybrid(cache, [1, 2, 3])  # entry 1, checkpoint slot 1 (a prefix of entry 0: both stay)
    prompt = [1, 2, 3, 4, 5, 9, 9]
    assert cache.match(prompt, max_tokens=6).num_tokens == 5  # any-prefix reuse would pick entry 0
    m = cache.match_checkpoint(prompt, max_tokens=6)  # only entry 1's frontier lies on the prompt
    assert (m.entry_id, m.num_tokens, m.entry_tokens, m.state_slot) == (1, 3, 3, 1)
    m = cache.match_checkpoint([1, 2, 3, 4, 5, 6, 7], max_tokens=6)
    assert (m.entry_id, m.num_tokens) == (0, 6)
    assert cache.match_checkpoint([1, 2, 3, 4, 5, 6], max_tokens=5).entry_id == 1  # capped below entry 0
    assert cache.match_checkpoint([1, 2, 7], max_tokens=2) is None


def test_checkpoint_slots_free_with_their_entry_unless_pinned() -> None:
    pool, state = PagePool(16, P), StatePool(3)
    cache = PrefixCache(pool, max_entries=2, state_pool=state)
    _retain_hybrid(cache, [1] * 4)  # entry 0: page 0, slot 0
    _retain_hybrid(cache, [2] * 4)  # entry 1: page 1, slot 1
    assert cache.freeable_slots() == 2
    state.incref([0])  # a sequence resuming entry 0 pins its checkpoint until its copy runs
    assert cache.freeable_slots() == 1
    # short of slots, not pages: entry 0 is least recently used but frees no slot, so entry 1 goes
    assert cache.evict(0, need_free_slots=2) == [1]
    assert state.free_slot_ids() == [2, 1] and pool.free_page_ids()[-1] == 1
    assert cache.evict(0, need_free_slots=3) == []
    _retain_hybrid(cache, [1] * 8)  # extends entry 0 (slot 2 handed over): entry 0 is dropped
    assert [(e.token_ids, e.state_slot) for e in cache.entries()] == [([1] * 8, 2)]
    assert state.refcount(0) == 1  # still pinned by the pending copy
    state.decref([0])
    cache.clear()
    assert state.num_free == 3 and pool.num_free == 16


def test_checkpoint_match_considers_page_checkpoints() -> None:
    pool, state = PagePool(16, P), StatePool(5)
    cache = PrefixCache(pool, max_entries=4, state_pool=state)
    _retain_hybrid(cache, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10], page_checkpoint=8)  # entry 0: slots 0 (10), 1 (8)
    _retain_hybrid(cache, [1, 2, 3, 4, 5, 6, 7, 8, 50, 51], page_checkpoint=4)  # entry 1: slots 2 (10), 3 (4)
    assert [e.checkpoints() for e in cache.entries()] == [[(8, 1), (10, 0)], [(4, 3), (10, 2)]]
    # diverges at token 9: entry 0's page checkpoint at 8 is the longest on the prompt
    m = cache.match_checkpoint([1, 2, 3, 4, 5, 6, 7, 8, 9, 99, 99], max_tokens=10)
    assert (m.entry_id, m.num_tokens, m.entry_tokens, m.state_slot) == (0, 8, 10, 1)
    # entry 1's frontier wins when the prompt extends it; capped below it, its page checkpoint (4)
    # loses to entry 0's (8), which lies on the prompt too
    assert cache.match_checkpoint([1, 2, 3, 4, 5, 6, 7, 8, 50, 51, 0], 10).state_slot == 2
    assert cache.match_checkpoint([1, 2, 3, 4, 5, 6, 7, 8, 50, 51], 9).state_slot == 1
    # a prompt leaving both entries at token 5: only entry 1's page checkpoint at 4 lies on it
    m = cache.match_checkpoint([1, 2, 3, 4, 7, 7], 5)
    assert (m.entry_id, m.num_tokens, m.state_slot) == (1, 4, 3)
    assert cache.match_checkpoint([1, 2, 3, 9], 3) is None
    # eviction and drop release every checkpoint slot of the entry, unless pinned
    assert cache.freeable_slots() == 4
    state.incref([1])  # a pending copy out of entry 0's page checkpoint
    assert cache.freeable_slots() == 3
    assert cache.evict(0, need_free_slots=2) == [0]  # frees slot 0 (slot 1 stays pinned)
    assert state.free_slot_ids() == [4, 0] and state.refcount(1) == 1
    state.decref([1])
    cache.clear()
    assert state.num_free == 5 and pool.num_free == 16
