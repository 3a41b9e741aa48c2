"""Page pool: exact page ids, refcounts and free-list order."""
from __future__ import annotations

import pytest

from ninfer.engine.kv_cache import PagePool, StatePool, pages_for_tokens


def test_pages_for_tokens() -> None:
    assert [pages_for_tokens(n, 64) for n in (0, 1, 63, 64, 65, 128, 129)] == [0, 1, 1, 1, 2, 2, 3]


def test_allocate_takes_head_and_free_goes_to_tail() -> None:
    pool = PagePool(6, 64)
    assert pool.allocate(2) == [0, 1]
    assert pool.allocate(3) == [2, 3, 4]
    assert (pool.num_free, pool.num_used) == (1, 5)
    assert pool.decref([3, 1]) == [3, 1]
    assert pool.free_page_ids() == [5, 3, 1]
    assert pool.allocate(2) == [5, 3]
    assert pool.free_page_ids() == [1]


def test_shared_page_frees_on_last_release() -> None:
    pool = PagePool(4, 64)
    a = pool.allocate(2)
    pool.incref(a)
    assert [pool.refcount(p) for p in a] == [2, 2]
    assert pool.decref(a) == []
    assert pool.num_used == 2
    assert pool.decref([a[1], a[0]]) == [1, 0]
    assert pool.num_free == 4 and pool.free_page_ids() == [2, 3, 1, 0]


def test_misuse_is_caught() -> None:
    pool = PagePool(2, 64)
    with pytest.raises(AssertionError):
        pool.allocate(3)
    with pytest.raises(AssertionError):
        pool.decref([0])
    with pytest.raises(AssertionError):
        pool.incref([1])


def test_state_pool_ids_pins_and_counts() -> None:
    pool = StatePool(3)
    assert (pool.num_slots, pool.num_free, pool.num_used) == (3, 3, 0)
    assert pool.allocate(1) == [0] and pool.allocate(1) == [1]
    pool.incref([0])  # a pending copy pins a checkpoint beside its holder
    assert pool.decref([0]) == [] and pool.refcount(0) == 1  # the holder dropped it; the pin keeps it
    assert pool.decref([1]) == [1]
    assert pool.free_slot_ids() == [2, 1] and pool.num_used == 1
    assert pool.decref([0]) == [0]  # the copy ran: free at last, behind the others
    assert pool.free_slot_ids() == [2, 1, 0] and pool.allocate(2) == [2, 1]
    with pytest.raises(AssertionError):
        pool.allocate(2)
    with pytest.raises(AssertionError):
        pool.decref([1, 1])
