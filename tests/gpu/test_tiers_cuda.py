"""Host-tier copies on CUDA: TensorMover's pinned side-stream copies on fresh random data (ordered
against later writes into the same pages), and the host tier, slot files and the prefix-cache
file through a real Engine over the cuda backend (default model, and a synthetic hybrid
qwen3.5 for recurrent-state checkpoints): a resumed conversation samples what a run without reuse
samples."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from engine_helpers import generate as _generate

from ninfer.engine.config import MemoryConfig, SchedulerConfig
from ninfer.engine.transfer import TensorMover


def test_mover_round_trip_is_exact_and_ordered_before_later_writes() -> None:
    torch.manual_seed(0)
    dev = torch.device("cuda")
    pages = [torch.randn(16, 64, 8, 128, device=dev).to(torch.bfloat16) for _ in range(3)]
    slots = [torch.randn(6, 16, 128, 128, device=dev) for _ in range(2)]
    mover = TensorMover(pages, slots)
    expect_p = [t[[3, 1, 7]].cpu() for t in pages]
    expect_s = [t[[2]].cpu() for t in slots]
    host, ready = mover.read([3, 1, 7], [2])
    # the freed pages are overwritten at once on the engine's stream: the copy must not see it
    for t in pages:
        t[[3, 1, 7]] = 0
    ready.synchronize()
    assert all(h.is_pinned() for h in host)
    for h, e in zip(host, expect_p + expect_s):
        assert torch.equal(h, e)
    mover.write([0, 9, 12], [5], host)
    torch.cuda.current_stream().synchronize()
    for t, e in zip(pages, expect_p):
        assert torch.equal(t[[0, 9, 12]].cpu(), e)
    for t, e in zip(slots, expect_s):
        assert torch.equal(t[[5]].cpu(), e)


def _engine(artifact, tmp_path: Path, kv_tokens: int = 4096, kv_dtype: str = "auto", host: bool = True):
    from ninfer.engine.loader import start_engine

    scheduler = SchedulerConfig(max_concurrency=1, max_private_continuations=1, max_context=2048)
    memory = MemoryConfig(host_kv_bytes=1 << 30, slot_save_path=str(tmp_path),
                          prefix_cache_file=str(tmp_path / "prefix.cache")) if host else MemoryConfig()
    return start_engine(artifact, backend="cuda", torch_device="cuda:0", scheduler=scheduler,
                        kv_capacity=kv_tokens, memory=memory, kernel_cache_dir=tmp_path / "kernels", kv_dtype=kv_dtype)


@pytest.fixture(scope="module")
def smollm2(request: pytest.FixtureRequest):
    from ninfer.engine.artifact import Artifact

    path = os.environ.get("NINFER_TEST_ARTIFACT")
    return Artifact.open(Path(path) if path else request.getfixturevalue("smollm2_artifact"))


@pytest.fixture(scope="module")
def hybrid():
    from ninfer.engine.synthetic import SyntheticArtifact

    return SyntheticArtifact("qwen3.5-0.8b")


@pytest.mark.parametrize("model, kv_dtype", [("smollm2", "auto"), ("smollm2", "int8"), ("smollm2", "fp8"),
                                             ("hybrid", "auto")])
def test_host_tier_slot_file_and_prefix_cache_file_on_the_cuda_backend(model: str, kv_dtype: str, tmp_path: Path,
                                                                       request: pytest.FixtureRequest) -> None:
    artifact = request.getfixturevalue(model)
    loaded = _engine(artifact, tmp_path, kv_dtype=kv_dtype)
    engine = loaded.engine
    a = [(i * 37) % 5000 + 10 for i in range(300)]
    try:
        out_a, _ = _generate(engine, "a", a, 4)
        _generate(engine, "b", [(i * 11) % 5000 + 10 for i in range(100)], 4)  # a -> host tier
        turn = a + out_a + [42, 43]
        resumed, final = _generate(engine, "c", turn, 16)
        assert final.usage.cached_tokens == len(a) + 3 and final.reuse_tier == "host"
        fresh, final = _generate(engine, "d", turn, 16, cache_prompt=False)
        # a real model's margins: decode-written K/V sample as a fresh prefill does, on the exact cache.
        # Not through codes: decode attention splits a context into partitions where a prompt's reads
        # it whole, and the two roundings of the same K/V can land in different int8 / fp8 codes; on
        # this random-token prompt the first token's top two are 0.03-0.07 apart (docs/PERF.md). The
        # tier itself is exact for every cache: the device-page resume below samples `resumed`.
        if model == "smollm2" and kv_dtype == "auto":
            assert fresh == resumed
        snap = engine.snapshot()
        slot = next(c.slot for c in snap.continuations)
        img = engine.call_on_worker(lambda: engine.tiers.save_slot(slot, None)).result(60)
        from ninfer.engine.session_files import write_session_file
        write_session_file(tmp_path / "s", engine.tiers.compat, [img], kind="slot")
    finally:
        engine.shutdown()
    assert engine.save_prefix_cache() >= 1
    # the host tier is transparent: the same turn resumed from device pages (the random hybrid's
    # margins are too small for a fresh prefill's bf16 rounding to sample the same tokens)
    loaded = _engine(artifact, tmp_path, kv_dtype=kv_dtype, host=False)
    try:
        _generate(loaded.engine, "a", a, 4)
        on_device, final = _generate(loaded.engine, "c", turn, 16)
        assert final.reuse_tier == "device" and final.usage.cached_tokens == len(a) + 3 and on_device == resumed
        # the next turn of that conversation: it extends c's frontier (a hybrid resumes only at a
        # recurrent-state checkpoint, and c's is its frontier, past `turn`)
        follow = turn + resumed + [44, 45]
        follow_device, final = _generate(loaded.engine, "g", follow, 8)
        assert final.reuse_tier == "device" and final.usage.cached_tokens == len(turn) + len(resumed) - 1
    finally:
        loaded.engine.shutdown()
    # a restart: the prefix-cache file fills the host tier; the slot file restores too
    loaded = _engine(artifact, tmp_path, kv_dtype=kv_dtype)
    engine = loaded.engine
    try:
        assert engine.snapshot().tiers.entries["host"] >= 1
        again, final = _generate(engine, "e", follow, 8)
        assert final.reuse_tier == "host" and final.usage.cached_tokens == len(turn) + len(resumed) - 1
        assert again == follow_device
        from ninfer.engine.session_files import read_session_file
        _, (img,), _ = read_session_file(tmp_path / "s", engine.tiers.compat)
        engine.call_on_worker(lambda: engine.tiers.restore_slot(0, img, "s")).result(60)
        again, final = _generate(engine, "f", list(img.session) + [7], 8)
        assert final.reuse_tier == "device" and final.usage.cached_tokens >= len(img.token_ids) - 1
    finally:
        engine.shutdown()
