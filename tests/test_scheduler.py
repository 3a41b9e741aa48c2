"""Scheduler driven by hand-built runner outputs: exact page ids, admission order, staged
prefill order, decode rounds, prefix reuse and eviction, EOS / stop string / cancel; with
recurrent state: working slots, checkpoints, resume only at a checkpoint, no slot leaks."""
from __future__ import annotations

import pytest

from ninfer.engine.batch import ScheduledBatch, StepOutput
from ninfer.engine.config import SchedulerConfig
from ninfer.engine.kv_cache import PagePool, StatePool
from ninfer.engine.scheduler import Scheduler, Sequence, SeqStatus, derive_output_limit
from ninfer.errors import ConfigError

P = 4
EOS = 2


def make(num_pages: int = 16, **kw: object) -> Scheduler:
    kw.setdefault("max_concurrency", 2)
    kw.setdefault("prefill_chunk", 4)
    kw.setdefault("decode_rounds_per_prefill", 1)
    return Scheduler(SchedulerConfig(**kw), PagePool(num_pages, P))


def seq(seq_id: int, prompt: list[int], max_out: int, **kw: object) -> Sequence:
    return Sequence(seq_id=seq_id, request_id=f"r{seq_id}", prompt_token_ids=prompt,
                    max_output_tokens=max_out, stop_token_ids=frozenset({EOS}), **kw)


def run(s: Scheduler, sample: dict[int, int] | None = None) -> ScheduledBatch:
    """One step: schedule, then answer every sampling row with sample[seq_id] (default 100+seq_id)."""
    batch = s.schedule()
    assert batch is not None
    out = {w.seq_id: (sample or {}).get(w.seq_id, 100 + w.seq_id) for w in batch.seqs if w.sample}
    s.update(batch, StepOutput(out))
    return batch


def rows(batch: ScheduledBatch) -> list[tuple[int, list[int], int, list[int], bool]]:
    return [(w.seq_id, w.token_ids, w.start_pos, w.block_table, w.sample) for w in batch.seqs]


def test_chunked_prefill_decode_and_length_finish_retains() -> None:
    s = make(prefix_reuse=True)
    a = seq(0, [10, 11, 12, 13, 14, 15], max_out=3)
    s.add(a)
    assert rows(run(s)) == [(0, [10, 11, 12, 13], 0, [0], False)]
    assert a.status is SeqStatus.PREFILLING and a.num_computed_tokens == 4
    assert rows(run(s)) == [(0, [14, 15], 4, [0, 1], True)]
    assert a.status is SeqStatus.DECODING and a.output_token_ids == [100]
    assert rows(run(s)) == [(0, [100], 6, [0, 1], True)]
    assert rows(run(s)) == [(0, [100], 7, [0, 1], True)]
    assert a.finished and a.finish_reason == "length" and a.output_token_ids == [100, 100, 100]
    assert s.schedule() is None
    # the executed frontier (8 tokens: the last sampled token has no KV yet) is retained
    (entry,) = s.prefix_cache.entries()
    assert entry.token_ids == [10, 11, 12, 13, 14, 15, 100, 100] and entry.pages == [0, 1]
    assert s.pool.num_used == 2


def test_eos_and_stop_string_finish_without_retention() -> None:
    s = make(prefix_reuse=False)
    a, b = seq(0, [5, 6, 7], 10), seq(1, [8, 9], 10)
    s.add(a)
    s.add(b)
    assert rows(run(s)) == [(0, [5, 6, 7], 0, [0], True)]
    assert [q.seq_id for q in s.running] == [0] and list(s.waiting) == [b]  # held by the staged prefill
    # b is admitted now, but one decode round runs before its prefill; a samples EOS in it
    assert rows(run(s, {0: EOS})) == [(0, [100], 3, [0], True)]
    assert b.status is SeqStatus.PREFILLING and b.lane == 1
    assert a.finished and a.finish_reason == "stop" and a.stop_reason == EOS
    assert a.block_table == [] and s.pool.num_used == 0  # b has no pages until it computes
    assert rows(run(s)) == [(1, [8, 9], 0, [1], True)]
    s.finish(b, "stop", "\n\n")  # the output processor matched a stop string
    assert b.finished and b.stop_reason == "\n\n" and s.pool.num_used == 0 and s.running == []
    s.finish(b, "length")  # a second finish is a no-op
    assert b.finish_reason == "stop"


def test_admission_waits_for_entitlement_in_fifo_order() -> None:
    s = make(num_pages=8, max_concurrency=3, prefix_reuse=False, prefill_chunk=16)
    a = seq(0, list(range(20, 28)), max_out=8)  # 16 tokens: 4 pages
    b = seq(1, list(range(30, 38)), max_out=12)  # 20 tokens: 5 pages > 8 - 4
    c = seq(2, [40], max_out=1)  # would fit, but FIFO keeps it behind b
    for q in (a, b, c):
        s.add(q)
    assert rows(run(s)) == [(0, list(range(20, 28)), 0, [0, 1], True)]
    assert list(s.waiting) == [b, c] and s.pool.num_used == 2  # pages are allocated lazily
    for _ in range(7):
        assert [w.seq_id for w in run(s).seqs] == [0]
    assert a.finished and a.finish_reason == "length"
    # a's pages 0..3 went back to the free list's tail behind 4..7
    assert rows(run(s)) == [(1, list(range(30, 38)), 0, [4, 5], True)]
    assert list(s.waiting) == [c]  # b's staged prefill held c back
    assert rows(run(s)) == [(1, [101], 8, [4, 5, 6], True)]  # c admitted; one decode round first
    assert [q.seq_id for q in s.running] == [1, 2] and (b.lane, c.lane) == (0, 1)
    assert rows(run(s)) == [(2, [40], 0, [7], True)]

def test_concurrent_prefill_shortest_first() -> None:
    s = make(num_pages=64, max_concurrency=3, concurrent_prefill=True, prefix_reuse=False)
    long = seq(0, list(range(1000, 1040)), 2)  # 10 chunks
    s.add(long)
    run(s)
    assert long.num_computed_tokens == 4
    shorts = [seq(i, [50 + i] * 6, 2) for i in (1, 2)]
    for q in shorts:
        s.add(q)
    steps = []
    for _ in range(7):
        w = run(s).seqs
        steps.append((w[0].seq_id, "P" if w[0].start_pos < 6 or w[0].seq_id == 0 else "D"))
    # shortest remaining prompt first; a decode round between prefill units once one decodes
    assert steps == [(1, "P"), (1, "P"), (1, "D"), (2, "P"), (2, "P"), (2, "D"), (0, "P")]
    assert shorts[0].finished and shorts[1].finished and long.num_computed_tokens == 8


def test_long_prompt_passed_over_eight_times_runs_next() -> None:
    s = make(num_pages=64, max_concurrency=2, concurrent_prefill=True, prefix_reuse=False)
    long = seq(0, list(range(1000, 1040)), 1)
    short = seq(1, list(range(2000, 2036)), 1)  # always the shorter remaining prompt
    s.add(long)
    s.add(short)
    units = [run(s).seqs[0].seq_id for _ in range(10)]
    assert units == [1] * 8 + [0, 1]
    assert short.finished and long.passed_over == 1 and long.num_computed_tokens == 4


def test_decode_rounds_before_prefill_are_proportional() -> None:
    s = make(num_pages=64, max_concurrency=2, prefill_chunk=8, decode_rounds_per_prefill=4,
             prefix_reuse=False)
    a = seq(0, [1, 1, 1], 50)
    s.add(a)
    run(s)
    assert a.status is SeqStatus.DECODING
    b = seq(1, list(range(100, 120)), 5)  # 20 tokens: units of 8, 8, 4
    s.add(b)
    kinds = ""
    for _ in range(14):
        batch = run(s)
        kinds += "P" if any(w.seq_id == 1 and w.start_pos < 20 for w in batch.seqs) else "D"
    # 4 rounds before each full chunk of 8, ceil(4 * 4 / 8) = 2 before the 4-token tail
    assert kinds == "DDDDPDDDDPDDPD"
    assert len(batch.seqs) == 2  # then both lanes decode in one round

def test_prefix_reuse_shares_full_pages_and_counts_exactly() -> None:
    s = make(max_concurrency=1, prefix_reuse=True, prefill_chunk=64)
    a = seq(0, list(range(10, 19)), 2)  # 9 prompt tokens
    s.add(a)
    run(s)
    run(s)
    assert a.finished  # retained: tokens 0..9 (9 prompt + first sampled), pages [0, 1, 2]
    (entry,) = s.prefix_cache.entries()
    assert entry.pages == [0, 1, 2] and len(entry.token_ids) == 10
    # next turn extends the conversation: 10 retained tokens match; without page copies the
    # partial third page is recomputed, so exactly 8 tokens are reused
    b = seq(1, entry.token_ids + [7, 7, 7], 1)
    s.add(b)
    assert rows(run(s)) == [(1, entry.token_ids[8:] + [7, 7, 7], 8, [0, 1, 3, 4], True)]
    assert b.num_cached_tokens == 8 and b.reuse_path == "private_endpoint"
    assert b.finished and [s.pool.refcount(p) for p in (0, 1, 2)] == [1, 1, 0]
    # b finished (max_out 1) and its entry dominated a's: pages 0, 1 moved on, page 2 freed
    (entry,) = s.prefix_cache.entries()
    assert entry.pages == [0, 1, 3, 4] and entry.entry_id == 1
    assert s.pool.free_page_ids()[-1] == 2


def test_prefix_reuse_copy_on_write_is_exact() -> None:
    s = Scheduler(SchedulerConfig(max_concurrency=1, prefill_chunk=64), PagePool(16, P), copy_on_write=True)
    a = seq(0, list(range(10, 19)), 2)
    s.add(a)
    run(s)
    run(s)
    (entry,) = s.prefix_cache.entries()
    b = seq(1, entry.token_ids + [7], 1, raw_prompt=True)
    s.add(b)
    batch = run(s)
    assert batch.page_copies == [(2, 3)]  # the entry's partial page into b's own page 3
    assert rows(batch) == [(1, [7], 10, [0, 1, 3], True)]
    assert b.num_cached_tokens == 10 and b.reuse_path == "private_endpoint"
    assert s.pool.refcount(2) == 0  # the dominated entry and the copy source are both released


def test_same_prompt_again_reuses_all_but_one_token() -> None:
    s = Scheduler(SchedulerConfig(max_concurrency=1, prefill_chunk=64), PagePool(16, P), copy_on_write=True)
    prompt = list(range(100, 111))
    for i in range(2):
        q = seq(i, list(prompt), 3, raw_prompt=True)
        s.add(q)
        first = run(s)
        run(s)
        run(s)
        assert q.finished
    assert first.seqs[0].start_pos == 10 and q.num_cached_tokens == 10


def test_admission_evicts_lru_continuations_but_not_pages_in_use() -> None:
    s = make(num_pages=6, max_concurrency=2, prefix_reuse=True, prefill_chunk=64)
    x = seq(0, [1] * 4, 1)
    y = seq(1, [2] * 4, 1)
    for q in (x, y):
        s.add(q)
        run(s)
    assert [e.pages for e in s.prefix_cache.entries()] == [[0], [1]]
    # z needs 5 pages with 4 free: the least recently used continuation (x's) is evicted
    z = seq(2, [3] * 16, 4)
    s.add(z)
    run(s)
    assert [e.token_ids for e in s.prefix_cache.entries()] == [[2] * 4]
    assert z.block_table == [2, 3, 4, 5] and s.pool.free_page_ids() == [0]


def test_cancel_frees_lane_and_pages_at_any_point() -> None:
    s = make(num_pages=16, prefix_reuse=True)
    a = seq(0, list(range(10, 20)), 5)
    b = seq(1, [3, 3], 5)
    s.add(a)
    s.add(b)
    run(s)
    s.abort(b)  # still waiting
    assert b.finished and list(s.waiting) == []
    run(s)
    s.abort(a)  # mid-prefill
    assert a.finish_reason == "cancelled" and s.running == [] and s.pool.num_used == 0
    assert len(s.prefix_cache) == 0 and s.schedule() is None


def test_derive_output_limit() -> None:
    # one lane: the whole remaining context
    assert derive_output_limit(100, max_context=8192, num_pages=128, page_size=64, max_concurrency=1) == 8092
    # 4 lanes over 8192 tokens: share 2048
    assert derive_output_limit(100, max_context=8192, num_pages=128, page_size=64, max_concurrency=4) == 1948
    # a pool of 4 x context: the whole remaining context
    assert derive_output_limit(100, max_context=8192, num_pages=512, page_size=64, max_concurrency=4) == 8092
    # a prompt past its share keeps the remaining context
    assert derive_output_limit(3000, max_context=8192, num_pages=128, page_size=64, max_concurrency=4) == 5192


def test_a_whole_pool_entitlement_is_admitted_despite_a_partial_prefix_hit() -> None:
    """The reuse plan must not pin more than the pool can give: a request whose entitlement is
    the whole pool, with a prefix hit ending inside a page, is admitted by reusing less (here:
    its full pages, without the copy source) instead of waiting forever with nothing running."""
    s = Scheduler(SchedulerConfig(max_concurrency=1, prefill_chunk=64), PagePool(4, P), copy_on_write=True)
    a = seq(0, list(range(10, 16)), 1)  # 6 prompt tokens + 1: retained as 1 full page + a partial one
    s.add(a)
    run(s)  # prefill samples the one output token
    assert a.finished and s.pool.num_used == 2
    b = seq(1, list(range(10, 16)) + [9], 16 - 7)  # entitlement 16 tokens = every page of the pool
    s.add(b)
    batch = run(s)
    assert b.status is not SeqStatus.WAITING and not batch.page_copies
    assert b.num_cached_tokens == 4 and b.block_table[0] == 0  # the full page is still shared


# ---- recurrent state (hybrid models) ------------------------------------------------------


def make_hybrid(num_pages: int = 32, num_state_slots: int = 3, copy_on_write: bool = True,
                **kw: object) -> Scheduler:
    kw.setdefault("max_concurrency", 2)
    kw.setdefault("prefill_chunk", 64)
    kw.setdefault("decode_rounds_per_prefill", 1)
    return Scheduler(SchedulerConfig(**kw), PagePool(num_pages, P), copy_on_write=copy_on_write,
                     state_pool=StatePool(num_state_slots))


def slots(batch: ScheduledBatch) -> list[tuple[int, int]]:
    return [(w.seq_id, w.state_slot) for w in batch.seqs]


def finish(s: Scheduler, q: Sequence) -> None:
    while not q.finished:
        run(s)


def test_hybrid_resumes_exactly_at_the_frontier_checkpoint() -> None:
    s = make_hybrid(max_concurrency=1, num_state_slots=3)  # one lane + one entry's two checkpoints
    a = seq(0, list(range(10, 19)), 2)  # 9 prompt tokens: its page checkpoint is at 8
    s.add(a)
    first = run(s)
    assert slots(first) == [(0, 0)] and first.state_copies == [] and first.page_copies == []
    assert rows(first)[0][1:] == (list(range(10, 18)), 0, [0, 1], False)
    second = run(s)
    assert rows(second)[0][1:] == ([18], 8, [0, 1, 2], True) and second.state_copies == [(0, 1)]
    run(s)
    assert a.finished and a.state_slot == -1 and a.checkpoint_slot == -1
    (entry,) = s.prefix_cache.entries()
    # the working slot became the checkpoint of the executed frontier (10 tokens), without a copy
    assert (len(entry.token_ids), entry.pages, entry.state_slot) == (10, [0, 1, 2], 0)
    assert entry.checkpoints() == [(8, 1), (10, 0)]
    assert s.state_pool.free_slot_ids() == [2]
    b = seq(1, entry.token_ids + [7, 7], 1)
    s.add(b)
    batch = s.schedule()
    # all 10 tokens: full pages 0, 1 shared, the partial page 2 copied into b's page 3, and the
    # frontier checkpoint copied into b's working slot 2
    assert rows(batch) == [(1, [7, 7], 10, [0, 1, 3], True)] and slots(batch) == [(1, 2)]
    assert batch.page_copies == [(2, 3)] and batch.state_copies == [(0, 2)]
    assert b.num_cached_tokens == 10 and b.reuse_path == "private_endpoint"
    assert b.checkpoint_at == 0  # its last page boundary (8) lies below what it reused
    assert s.state_pool.refcount(0) == 2  # the entry and the pending copy
    s.update(batch, StepOutput({1: 50}))
    assert b.finished
    # b's entry dominated a's: a's checkpoints (no longer pinned) and private page are freed
    (entry,) = s.prefix_cache.entries()
    assert (len(entry.token_ids), entry.pages, entry.checkpoints()) == (12, [0, 1, 3], [(12, 2)])
    assert s.state_pool.free_slot_ids() == [1, 0] and s.pool.refcount(2) == 0


def test_hybrid_prompt_diverging_inside_an_entry_reuses_nothing() -> None:
    pure = Scheduler(SchedulerConfig(max_concurrency=1, prefill_chunk=64), PagePool(32, P), copy_on_write=True)
    hybrid = make_hybrid(max_concurrency=1, num_state_slots=4)
    for s in (pure, hybrid):
        a = seq(0, list(range(10, 19)), 2)
        s.add(a)
        finish(s, a)
        b = seq(1, list(range(10, 16)) + [99, 99, 99], 1)  # diverges after 6 of the entry's 10 tokens
        s.add(b)
        batch = run(s)
        if s is pure:  # any prefix of a KV entry is reusable
            assert b.num_cached_tokens == 6 and batch.page_copies == [(1, 3)]
            assert slots(batch) == [(1, -1)] and batch.state_copies == []
        else:  # no state exists at token 6 (the checkpoints are at 8 and 10): root, split at its own 8
            assert rows(batch) == [(1, b.prompt_token_ids[:8], 0, [3, 4], False)]
            assert slots(batch) == [(1, 2)] and batch.state_copies == [] and batch.page_copies == []
            assert (b.num_cached_tokens, b.reuse_path) == (0, "root")
            run(s)
        assert b.finished
    # both conversations are retained, each with its own two checkpoints
    assert [e.checkpoints() for e in hybrid.prefix_cache.entries()] == [[(8, 1), (10, 0)], [(8, 3), (9, 2)]]
    assert hybrid.state_pool.num_free == 0


def test_hybrid_without_page_copies_resumes_only_at_a_page_boundary() -> None:
    s = make_hybrid(max_concurrency=1, num_state_slots=3, copy_on_write=False)
    a = seq(0, list(range(10, 17)), 2)  # 7 prompt tokens: the frontier is 8, two whole pages
    s.add(a)
    finish(s, a)
    (entry,) = s.prefix_cache.entries()
    b = seq(1, entry.token_ids + [7], 1)
    s.add(b)
    batch = run(s)
    assert rows(batch) == [(1, [7], 8, [0, 1, 2], True)] and batch.state_copies == [(0, 2)]
    assert b.num_cached_tokens == 8
    (entry,) = s.prefix_cache.entries()  # b's frontier, 9 tokens, ends inside page 2
    c = seq(2, entry.token_ids + [5], 1)
    s.add(c)
    batch = run(s)
    # the full pages alone would stop short of the checkpoint, where no state exists: root
    assert batch.seqs[0].start_pos == 0 and batch.state_copies == [] and c.num_cached_tokens == 0


def test_hybrid_admission_evicts_the_lru_entry_for_a_slot() -> None:
    s = make_hybrid(num_pages=32, max_concurrency=2, num_state_slots=3, concurrent_prefill=True)
    for i in (0, 1):
        q = seq(i, [i + 3] * 4, 1)
        s.add(q)
        run(s)
        assert q.finished
    assert [(e.token_ids, e.state_slot) for e in s.prefix_cache.entries()] == [([3] * 4, 0), ([4] * 4, 1)]
    c, d = seq(2, [5] * 4, 1), seq(3, [6] * 4, 1)
    s.add(c)
    s.add(d)
    s.schedule()
    # pages are plentiful, but only slot 2 is free: d's admission evicts the LRU entry for its slot
    assert (c.state_slot, d.state_slot) == (2, 0) and s.running == [c, d]
    assert [e.token_ids for e in s.prefix_cache.entries()] == [[4] * 4]
    assert s.pool.refcount(0) == 0  # the evicted entry's page went too


def test_hybrid_pinned_checkpoint_holds_admission_until_its_copy_runs() -> None:
    s = make_hybrid(num_pages=32, max_concurrency=2, num_state_slots=2, concurrent_prefill=True)
    a = seq(0, [5] * 6, 1)
    s.add(a)
    run(s)
    (entry,) = s.prefix_cache.entries()  # 6 tokens on pages 0, 1; checkpoint slot 0
    b = seq(1, entry.token_ids + [6, 6], 3)  # resumes the entry
    x = seq(2, [9] * 3, 1)
    s.add(b)
    s.add(x)
    batch = run(s)
    # b holds the last free slot and pins the checkpoint: x cannot be given a slot yet
    assert batch.state_copies == [(0, 1)] and batch.page_copies == [(1, 2)]
    assert list(s.waiting) == [x]
    batch = run(s)  # the copy ran: evicting the entry frees slot 0 for x (b decodes first)
    assert x.status is SeqStatus.PREFILLING and x.state_slot == 0 and len(s.prefix_cache) == 0
    assert slots(batch) == [(1, 1)]
    assert slots(run(s)) == [(2, 0)] and x.finished
    while not b.finished:
        run(s)
    assert sorted(e.state_slot for e in s.prefix_cache.entries()) == [0, 1]
    s.prefix_cache.clear()
    assert s.state_pool.num_free == 2 and s.pool.num_free == 32


def test_hybrid_cancel_and_finish_leak_no_slots() -> None:
    s = make_hybrid(num_pages=32, max_concurrency=2, num_state_slots=4, concurrent_prefill=True)
    a = seq(0, [5] * 6, 2)
    s.add(a)
    finish(s, a)
    (entry,) = s.prefix_cache.entries()  # checkpoints at 4 (slot 1) and its frontier 7 (slot 0)
    b = seq(1, entry.token_ids + [6] * 9, 4)  # resumes the entry with a longer remaining prompt
    y = seq(2, [8, 8], 4)  # the shorter prompt runs first
    z = seq(3, [9], 4)
    for q in (b, y, z):
        s.add(q)
    batch = run(s)
    assert rows(batch)[0][0] == 2 and b.state_copy_src == 0  # b admitted, its copy still pending
    assert s.state_pool.num_used == 4  # the two checkpoints, b's and y's working slots
    s.abort(b)  # before its copy ran: the pin and the working slot both go, nothing is retained
    s.abort(z)  # still waiting: it never held a slot
    assert s.state_pool.num_used == 3 and s.state_pool.refcount(0) == 1 and len(s.prefix_cache) == 1
    run(s)
    s.abort(y)  # decoding: not retained
    assert s.running == [] and s.state_pool.num_used == 2 and s.pool.num_used == len(entry.pages)
    s.prefix_cache.clear()
    assert s.state_pool.num_free == 4 and s.pool.num_free == 32


def test_hybrid_needs_a_slot_per_lane() -> None:
    with pytest.raises(ConfigError):
        make_hybrid(max_concurrency=4, num_state_slots=3)


# ---- page checkpoints (hybrid models) -----------------------------------------------------


def test_hybrid_prefill_splits_at_the_page_checkpoint_and_the_next_batch_captures_it() -> None:
    s = make_hybrid(max_concurrency=2, num_state_slots=6)
    a = seq(0, [1, 1, 1], 50)  # no page boundary inside its prompt: no checkpoint
    s.add(a)
    assert rows(run(s)) == [(0, [1, 1, 1], 0, [0], True)] and a.checkpoint_at == 0
    b = seq(1, list(range(20, 30)), 2)  # 10 prompt tokens: its last page boundary is 8
    s.add(b)
    assert rows(run(s)) == [(0, [100], 3, [0], True)]  # a decode round before b's prefill
    assert b.checkpoint_at == 8 and b.state_slot == 1
    chunk = run(s)  # the 64-token chunk ends at 8
    assert rows(chunk) == [(1, list(range(20, 28)), 0, [1, 2], False)] and chunk.state_copies == []
    assert b.checkpoint_slot == 2 and s.state_pool.refcount(2) == 1
    # the very next batch built carries the capture, though it only decodes a: its copies run
    # before any row, and b's next chunk comes after it
    decode = run(s)
    assert rows(decode) == [(0, [100], 4, [0, 3], True)] and decode.state_copies == [(1, 2)]
    rest = run(s)
    assert rows(rest) == [(1, [28, 29], 8, [1, 2, 4], True)] and rest.state_copies == []
    while not b.finished:
        assert run(s).state_copies == []
    entry = s.prefix_cache.newest()
    assert (len(entry.token_ids), entry.pages, entry.checkpoints()) == (11, [1, 2, 4], [(8, 2), (11, 1)])


def test_hybrid_prompt_diverging_after_a_page_checkpoint_resumes_there() -> None:
    s = make_hybrid(max_concurrency=1, num_state_slots=4)
    a = seq(0, list(range(20, 30)), 2)
    s.add(a)
    finish(s, a)
    (entry,) = s.prefix_cache.entries()
    assert (entry.pages, entry.checkpoints()) == ([0, 1, 2], [(8, 1), (11, 0)])
    c = seq(1, list(range(20, 29)) + [99, 98], 1)  # a's first 9 tokens, then its own
    s.add(c)
    batch = s.schedule()
    # exactly 8 tokens: pages 0, 1 shared (no partial page), the page checkpoint copied into c's slot
    assert rows(batch) == [(1, [28, 99, 98], 8, [0, 1, 3], True)] and slots(batch) == [(1, 2)]
    assert batch.state_copies == [(1, 2)] and batch.page_copies == []
    assert (c.num_cached_tokens, c.reuse_path, c.checkpoint_at) == (8, "shared_stable_prefix", 0)
    assert [s.pool.refcount(p) for p in (0, 1, 2)] == [2, 2, 1] and s.state_pool.refcount(1) == 2
    s.update(batch, StepOutput({1: 50}))
    assert c.finished and s.state_pool.refcount(1) == 1  # the copy ran: the pin is gone
    # both retained (c does not extend a); c's prompt had no boundary above what it reused
    assert [e.checkpoints() for e in s.prefix_cache.entries()] == [[(8, 1), (11, 0)], [(11, 2)]]
    s.prefix_cache.clear()
    assert s.state_pool.num_free == 4 and s.pool.num_free == 32


def test_hybrid_page_checkpoint_slots_return_on_cancel_and_without_retention() -> None:
    s = make_hybrid(max_concurrency=1, num_state_slots=4)
    a = seq(0, list(range(20, 30)), 5)
    s.add(a)
    run(s)
    assert a.checkpoint_slot == 1 and s.state_pool.num_used == 2
    s.abort(a)  # before the capture copy ran: it is dropped with the slot
    assert s.state_pool.num_free == 4 and s.pool.num_free == 32 and s.schedule() is None
    b = seq(1, list(range(20, 30)), 5)
    s.add(b)
    run(s)
    run(s)  # the capture ran with b's next chunk
    s.abort(b)  # decoding: not retained
    assert s.state_pool.num_free == 4 and s.pool.num_free == 32 and len(s.prefix_cache) == 0
    c = seq(2, list(range(20, 30)), 2, cache_prompt=False)  # never retained: no checkpoint, no split
    s.add(c)
    assert rows(run(s)) == [(2, list(range(20, 30)), 0, [5, 6, 7], True)] and c.checkpoint_at == 0
    finish(s, c)
    assert s.state_pool.num_free == 4 and s.pool.num_free == 32
    d = seq(3, list(range(20, 30)), 2)
    s.add(d)
    finish(s, d)
    assert s.prefix_cache.entries()[0].checkpoints() == [(8, 3), (11, 0)]
    assert s.prefix_cache.evict(0, need_free_slots=4) == [0]  # eviction frees both checkpoints
    assert s.state_pool.num_free == 4 and s.pool.num_free == 32


def test_hybrid_no_page_checkpoint_without_a_spare_slot() -> None:
    # two lanes, two slots: the second lane's working slot is not spare, so no split, no capture
    s = make_hybrid(max_concurrency=2, num_state_slots=2)
    pure = Scheduler(SchedulerConfig(max_concurrency=2, prefill_chunk=64, decode_rounds_per_prefill=1),
                     PagePool(32, P), copy_on_write=True)
    for sched in (s, pure):
        a = seq(0, list(range(20, 30)), 2)
        sched.add(a)
        assert rows(run(sched)) == [(0, list(range(20, 30)), 0, [0, 1, 2], True)]
        finish(sched, a)
    assert s.prefix_cache.entries()[0].checkpoints() == [(11, 0)]
    assert pure.prefix_cache.entries()[0].checkpoints() == []  # pure attention: KV only


def test_short_packable_prompts_share_one_prefill_unit_generation_does_not() -> None:
    s = make(max_concurrency=3, prefill_chunk=8)
    a = seq(0, [10, 11, 12], max_out=1, return_hidden=True, cache_prompt=False, packable=True)
    b = seq(1, [20, 21, 22, 23], max_out=1, return_hidden=True, cache_prompt=False, packable=True)
    c = seq(2, [30, 31], max_out=1, return_hidden=True, cache_prompt=False, packable=True)
    for x in (a, b, c):
        s.add(x)
    first = run(s)  # the unit is the shortest (c); a fits the 6 tokens left, then b (4) not the 3 left
    assert [(w.seq_id, w.token_ids, w.start_pos, w.sample, w.return_hidden) for w in first.seqs] == [
        (2, [30, 31], 0, True, True), (0, [10, 11, 12], 0, True, True)]
    assert a.finished and c.finished and not b.finished  # one sampled token each ends them
    assert [(w.seq_id, w.token_ids, w.start_pos, w.sample) for w in run(s).seqs] == [(1, [20, 21, 22, 23], 0, True)]
    # a generation request is never packed, and a staged one holds admission back as before
    s = make(max_concurrency=3, prefill_chunk=8)
    g = seq(0, [10, 11, 12], max_out=4)
    e = seq(1, [20, 21], max_out=1, return_hidden=True, cache_prompt=False, packable=True)
    s.add(g)
    s.add(e)
    assert [w.seq_id for w in run(s).seqs] == [0]


def test_packed_judgements_resume_a_shared_prefix_with_their_page_copies() -> None:
    s = Scheduler(SchedulerConfig(max_concurrency=2, prefill_chunk=8, decode_rounds_per_prefill=1, prefix_reuse=True),
                  PagePool(16, P), copy_on_write=True)
    s.add(seq(0, [1, 2, 3, 4, 5, 6], max_out=1))  # the judging prefix, retained
    run(s)
    x = seq(1, [1, 2, 3, 4, 5, 6, 7], max_out=1, packable=True, retain=False)
    y = seq(2, [1, 2, 3, 4, 5, 6, 8, 9], max_out=1, packable=True, retain=False)
    s.add(x)
    s.add(y)
    batch = run(s)
    assert [(w.seq_id, w.token_ids, w.start_pos) for w in batch.seqs] == [(1, [7], 6), (2, [8, 9], 6)]
    # each resumed inside the prefix's second page: a private copy of it, made before the forward
    shared = s.prefix_cache.entries()[0].pages[1]
    assert sorted(batch.page_copies) == sorted((shared, w.block_table[1]) for w in batch.seqs)
    assert x.finished and y.finished and len(s.prefix_cache) == 1  # the judgements retained nothing
