"""The context tiers through a real Engine over a runner whose "KV" and "recurrent state" are
tensors that TensorMover copies like real ones: page p holds the token ids written at its
positions, a state slot holds (tokens consumed, rolling hash). Every sample is a function of the
KV the row reads and of its state, so a prefix restored from the host tier, the disk tier, a slot
file or the prefix-cache file into the wrong pages (or a stale state) changes the output: each
test compares a resumed run with a run that reused nothing."""
from __future__ import annotations

import random
import time
from pathlib import Path

import pytest
import torch
from engine_helpers import LetterTokens, generate

from ninfer.engine.batch import ScheduledBatch, StepOutput
from ninfer.engine.config import MemoryConfig, SchedulerConfig
from ninfer.engine.engine import Engine
from ninfer.engine.request import PreparedRequest, SamplingParams
from ninfer.engine.session_files import read_session_file, write_session_file
from ninfer.engine.tiers import SlotError

P = 4  # page size
MOD = 1_000_003


class TensorKVRunner:
    """kv: [pages, P] int64 token ids (-1: never written); state: [slots, 2] (count, hash)."""

    page_size, vocab_size = P, 26

    def __init__(self, num_pages: int = 64, num_state_slots: int = 0) -> None:
        self.num_pages = num_pages
        self.num_state_slots = num_state_slots
        self.kv = torch.full((num_pages, P), -1, dtype=torch.int64)
        self.state = torch.zeros(max(num_state_slots, 1), 2, dtype=torch.int64)

    def context_tensors(self):
        return [self.kv], ([self.state] if self.num_state_slots else [])

    def copy_pages(self, copies):
        for s, d in copies:
            self.kv[d] = self.kv[s]

    def run(self, batch: ScheduledBatch) -> StepOutput:
        for s, d in batch.state_copies:
            self.state[d] = self.state[s]
        sampled = {}
        for w in batch.seqs:
            for i, t in enumerate(w.token_ids):
                pos = w.start_pos + i
                self.kv[w.block_table[pos // P], pos % P] = t
            end = w.start_pos + len(w.token_ids)
            history = [int(self.kv[w.block_table[p // P], p % P]) for p in range(end)]
            assert -1 not in history, "a reused position was never written"
            h = 0
            for t in history:
                h = (h * 31 + t + 1) % MOD
            if self.num_state_slots:
                count, sh = (0, 0) if w.start_pos == 0 else map(int, self.state[w.state_slot])
                assert count == w.start_pos, "resumed off the state's position"
                for t in w.token_ids:
                    sh = (sh * 37 + t + 1) % MOD
                self.state[w.state_slot] = torch.tensor([end, sh])
                h = (h + sh) % MOD
            if w.sample:
                sampled[w.seq_id] = 1 + h % 25  # never EOS
        return StepOutput(sampled)


def make_engine(runner: TensorKVRunner, memory: MemoryConfig, entries: int = 1, lanes: int = 1) -> Engine:
    engine = Engine(runner, LetterTokens(), SchedulerConfig(max_concurrency=lanes, max_private_continuations=entries,
                                                            max_pending_requests=64),
                    model_max_context=256, memory=memory, profile={"artifact": "fake"}, model_name="fake")
    engine.start()
    return engine


def idle(engine: Engine) -> None:
    end = time.monotonic() + 30
    while engine.snapshot().running or engine.snapshot().waiting:
        assert time.monotonic() < end
        time.sleep(0.001)
    engine.call_on_worker(lambda: None).result(30)  # one more boundary: the snapshot is current


def prompt(seed: int, n: int) -> list[int]:
    r = random.Random(seed)
    return [r.randrange(1, 26) for _ in range(n)]


def slots_for(hybrid: bool, entries: int = 1, lanes: int = 1) -> int:
    return 2 * lanes + 2 * entries if hybrid else 0


@pytest.mark.parametrize("hybrid", [False, True], ids=["attention", "hybrid"])
def test_an_evicted_conversation_comes_back_from_the_host_tier(hybrid: bool) -> None:
    runner = TensorKVRunner(num_state_slots=slots_for(hybrid))
    engine = make_engine(runner, MemoryConfig(host_kv_bytes=1 << 20))
    try:
        a = prompt(1, 18)
        out_a, _ = generate(engine, "a", a, 3)
        generate(engine, "b", prompt(2, 11), 3)  # one cell: b's retention evicts a to the host tier
        idle(engine)
        g = engine.snapshot().tiers
        assert g.entries == {"device": 1, "host": 1, "disk": 0}
        assert g.pages["host"] == -(-(len(a) + 2) // P) and g.bytes["host"] > 0
        turn = a + out_a + [5, 6, 7]
        resumed, final = generate(engine, "c", turn, 4)
        # the executed frontier of a (prompt + 2 of its 3 outputs); hybrid: its frontier checkpoint
        assert final.usage.cached_tokens == len(a) + 2
        assert final.reuse_tier == "host" and final.reuse_path == "private_endpoint"
        fresh, final = generate(engine, "d", turn, 4, cache_prompt=False)
        assert final.usage.cached_tokens == 0 and fresh == resumed
        idle(engine)
        g = engine.snapshot().tiers
        assert g.hits["host"] == 1 and g.transfer_bytes["main_kv", "h2d"] > 0
        assert (g.transfer_bytes["state", "d2h"] > 0) == hybrid
    finally:
        engine.shutdown()


def test_disk_tier_spills_what_the_host_tier_cannot_hold_and_restores_it(tmp_path: Path) -> None:
    runner = TensorKVRunner()
    one_image = 5 * P * 8  # 5 pages of int64 tokens
    memory = MemoryConfig(host_kv_bytes=one_image, disk_path=str(tmp_path), disk_restore=True)
    engine = make_engine(runner, memory)
    try:
        a, b = prompt(1, 18), prompt(2, 17)
        out_a, _ = generate(engine, "a", a, 3)
        generate(engine, "b", b, 3)  # a -> host
        generate(engine, "x", prompt(3, 9), 3)  # b -> host, a -> disk
        idle(engine)
        engine.tiers.writer.flush()
        idle(engine)
        g = engine.snapshot().tiers
        assert g.entries == {"device": 1, "host": 1, "disk": 1} and g.spills == 1
        files = list(tmp_path.glob("*/*.kvs"))
        assert len(files) == 1
        turn = a + out_a + [9]
        resumed, final = generate(engine, "c", turn, 4)
        assert final.usage.cached_tokens == len(a) + 2 and final.reuse_tier == "disk"
        fresh, _ = generate(engine, "d", turn, 4, cache_prompt=False)
        assert fresh == resumed
    finally:
        engine.shutdown()
    # after a restart the files are found again; a torn one reads as a miss, never as wrong KV
    files = list(tmp_path.glob("*/*.kvs"))
    for f in files:
        data = bytearray(f.read_bytes())
        data[-40] ^= 1
        f.write_bytes(bytes(data))
    engine = make_engine(TensorKVRunner(), memory)
    try:
        assert engine.snapshot().tiers.entries["disk"] == len(files) >= 1
        resumed, final = generate(engine, "e", turn, 4)
        assert final.usage.cached_tokens == 0 and resumed == fresh
        assert len(list(tmp_path.glob("*/*.kvs"))) == len(files) - 1  # the torn file is gone
    finally:
        engine.shutdown()


@pytest.mark.parametrize("hybrid", [False, True], ids=["attention", "hybrid"])
def test_slot_save_restore_into_a_new_engine_is_an_ordinary_cache_entry(tmp_path: Path, hybrid: bool) -> None:
    memory = MemoryConfig(slot_save_path=str(tmp_path))
    engine = make_engine(TensorKVRunner(num_state_slots=slots_for(hybrid, 2)), memory, entries=2)
    a = prompt(4, 21)
    try:
        out_a, final = generate(engine, "a", a, 3)
        slot = final.slot_id
        with pytest.raises(SlotError) as e:
            engine.call_on_worker(lambda: engine.tiers.save_slot(1 - slot, None)).result(30)
        assert e.value.reason == "empty"
        with pytest.raises(SlotError) as e:
            engine.call_on_worker(lambda: engine.tiers.save_slot(slot, "0123456789abcdef")).result(30)
        assert e.value.reason == "mismatch"
        img = engine.call_on_worker(lambda: engine.tiers.save_slot(slot, None)).result(30)
        assert img.session == a + out_a and len(img.checkpoint_positions) == (2 if hybrid else 0)
        write_session_file(tmp_path / "conv", engine.tiers.compat, [img], kind="slot")
        compat = engine.tiers.compat
    finally:
        engine.shutdown()
    # a restart: a new engine, a different slot, an unrelated conversation in the pool first
    engine = make_engine(TensorKVRunner(num_state_slots=slots_for(hybrid, 2)), memory, entries=2)
    try:
        generate(engine, "z", prompt(9, 14), 2)
        _, images, _ = read_session_file(tmp_path / "conv", compat)
        entry = engine.call_on_worker(lambda: engine.tiers.restore_slot(1, images[0], "conv")).result(30)
        assert entry.slot == 1 and list(entry.session) == a + out_a
        turn = a + out_a + [3, 3]
        resumed, final = generate(engine, "b", turn, 4)
        assert final.usage.cached_tokens == len(a) + 2 and final.reuse_tier == "device"
        fresh, _ = generate(engine, "c", turn, 4, cache_prompt=False)
        assert fresh == resumed
        # erase: the next request reuses nothing
        idle(engine)
        n = engine.call_on_worker(lambda: engine.tiers.erase_slot(engine.snapshot().continuations[-1].slot, None)).result(30)
        assert n > 0
    finally:
        engine.shutdown()


def test_auto_save_writes_an_evicted_bound_session_back_to_its_file(tmp_path: Path) -> None:
    memory = MemoryConfig(slot_save_path=str(tmp_path), auto_save_evicted=True)
    engine = make_engine(TensorKVRunner(), memory)
    try:
        a = prompt(5, 10)
        out_a, final = generate(engine, "a", a, 2)
        img = engine.call_on_worker(lambda: engine.tiers.save_slot(final.slot_id, None)).result(30)
        write_session_file(tmp_path / "a", engine.tiers.compat, [img], kind="slot")
        engine.call_on_worker(lambda: engine.tiers.bind(final.slot_id, "a", img.digest)).result(30)
        # the conversation continues (the binding follows it), then another one evicts it
        turn = a + out_a + [4, 4]
        out_b, _ = generate(engine, "b", turn, 2)
        generate(engine, "x", prompt(6, 9), 2)
        idle(engine)
        engine.tiers.writer.flush()
        idle(engine)  # a snapshot after the write
        _, (saved,), _ = read_session_file(tmp_path / "a", engine.tiers.compat)
        assert saved.session == turn + out_b
        assert engine.snapshot().tiers.auto_saves == 1
    finally:
        engine.shutdown()


def test_prefix_cache_file_survives_a_restart_and_another_profile_is_ignored(tmp_path: Path) -> None:
    path = tmp_path / "cache.bin"
    memory = MemoryConfig(host_kv_bytes=1 << 20, prefix_cache_file=str(path))
    engine = make_engine(TensorKVRunner(), memory)
    a = prompt(7, 22)
    out_a, _ = generate(engine, "a", a, 3)
    engine.shutdown()
    assert engine.save_prefix_cache() == 1 and path.exists()
    engine = make_engine(TensorKVRunner(), memory)
    try:
        assert engine.snapshot().tiers.entries["host"] == 1
        turn = a + out_a + [2]
        resumed, final = generate(engine, "b", turn, 3)
        assert final.usage.cached_tokens == len(a) + 2 and final.reuse_tier == "host"
        fresh, _ = generate(engine, "c", turn, 3, cache_prompt=False)
        assert fresh == resumed
    finally:
        engine.shutdown()
    # another artifact: ignored at start
    other = Engine(TensorKVRunner(), LetterTokens(), SchedulerConfig(max_private_continuations=1),
                   model_max_context=256, memory=memory, profile={"artifact": "other"})
    assert other.snapshot().tiers.entries["host"] == 0


@pytest.mark.parametrize("variant", ["host", "hybrid", "host+disk"])
def test_a_thousand_requests_with_random_cancels_leave_every_tier_at_its_baseline(variant: str,
                                                                                   tmp_path: Path) -> None:
    """1,000 requests over six growing conversations, 30 % of them cancelled at random points,
    some with cache_prompt false: afterwards every page and state slot in use belongs to a retained
    entry exactly once, and once those are dropped the device pool, the state pool and the host
    tier are back at their start (pages, bytes, sessions). The disk tier keeps its files by design:
    its gauges must equal the files on disk and stay within --disk-kv-gib."""
    hybrid = variant == "hybrid"
    num_state_slots = slots_for(True, entries=3, lanes=3) if hybrid else 0
    runner = TensorKVRunner(num_pages=24, num_state_slots=num_state_slots)
    page_bytes = P * 8
    if variant == "host+disk":  # a host tier of ~2 short sessions: most evictions spill to disk
        memory = MemoryConfig(host_kv_bytes=2 * 4 * page_bytes, disk_path=str(tmp_path / "disk"),
                              disk_bytes=40_000, disk_restore=True)
    else:
        memory = MemoryConfig(host_kv_bytes=6 * 24 * page_bytes)
    engine = make_engine(runner, memory, entries=3, lanes=3)
    baseline = engine.snapshot()
    r = random.Random(num_state_slots + len(variant))
    convs = [prompt(100 + i, r.randrange(3, 20)) for i in range(6)]
    try:
        handles = []
        for i in range(1000):
            c = r.randrange(len(convs))
            p = convs[c] + [r.randrange(1, 26) for _ in range(r.randrange(0, 4))]
            convs[c] = p if len(p) < 40 else prompt(200 + i, 5)
            req = PreparedRequest(request_id=f"r{i}", prompt_token_ids=p, max_tokens=r.randrange(1, 6),
                                  sampling=SamplingParams(temperature=0.0), cache_prompt=r.random() < 0.9)
            handles.append(engine.submit(req))
            if r.random() < 0.3:
                handles[r.randrange(len(handles))].cancel()
            if len(handles) >= 40:
                for h in handles:
                    for ev in h:
                        assert ev.error is None, ev.error  # the runner asserts every reused position was written
                handles = []
        for h in handles:
            for ev in h:
                assert ev.error is None, ev.error
        idle(engine)
        engine.tiers.flush_writes()
        idle(engine)
        snap = engine.snapshot()
        g = snap.tiers
        assert snap.requests_cancelled > 50 and g.hits["host"] > 0 and g.hits["device"] > 0
        cache = engine.scheduler.prefix_cache
        # nothing runs: every page and state slot in use belongs to a retained entry, once
        held = engine.call_on_worker(lambda: (sorted(p for e in cache.entries() for p in e.pages),
                                    sorted(s for e in cache.entries() for _, s in e.checkpoints()))).result(30)
        assert snap.kv_pages_used == len(set(held[0])) and snap.state_slots_used == len(held[1])
        if variant == "host+disk":
            files = list((tmp_path / "disk").rglob("*.kvs"))
            assert g.spills > 0 and files and g.hits["disk"] > 0, (g.spills, g.hits)
            assert g.entries["disk"] == len(files) and g.bytes["disk"] == sum(f.stat().st_size for f in files)
            assert g.bytes["disk"] <= memory.disk_bytes
            assert not list((tmp_path / "disk").rglob(".*.tmp"))  # no temporary file left behind
        engine.call_on_worker(engine.tiers.clear_retained).result(30)
        idle(engine)
        after = engine.snapshot()
        assert (after.kv_pages_used, after.state_slots_used) == (baseline.kv_pages_used, baseline.state_slots_used)
        for tier in ("device", "host"):
            assert after.tiers.pages[tier] == baseline.tiers.pages[tier]
            assert after.tiers.bytes[tier] == baseline.tiers.bytes[tier]
            assert after.tiers.entries[tier] == baseline.tiers.entries[tier]
        assert engine.pool.num_free == engine.pool.num_pages
    finally:
        engine.shutdown()


def test_the_mover_and_a_suspend_snapshot_copy_fp8_codes_bit_for_bit() -> None:
    """fp8 KV codes (the cuda backend's --kv-dtype fp8): index_copy_ has no float8 kernel, so the
    tiers, page copies and suspend move them as bytes."""
    from ninfer.engine.suspend import restore_snapshot, take_snapshot
    from ninfer.engine.transfer import TensorMover

    torch.manual_seed(0)
    pages = [torch.randn(8, 4, 2).to(torch.float8_e4m3fn), torch.randn(8, 4).half()]
    mover = TensorMover(pages, [])
    host, _ = mover.read([1, 3], [])
    mover.write([5, 6], [], host)
    for t in pages:
        assert torch.equal(t[5:7].view(-1).view(torch.uint8), t[[1, 3]].reshape(-1).view(torch.uint8))
    snap = take_snapshot({"k": pages[:1], "k_scale": pages[1:]}, [2, 4], [], "cpu")
    fresh = [torch.zeros_like(t) for t in pages]
    restore_snapshot({"k": fresh[:1], "k_scale": fresh[1:]}, snap, "cpu")
    for t, f in zip(pages, fresh):
        assert torch.equal(f[[2, 4]].reshape(-1).view(torch.uint8), t[[2, 4]].reshape(-1).view(torch.uint8))
