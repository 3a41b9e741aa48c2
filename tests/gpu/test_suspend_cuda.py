"""Model suspend on the cuda backend (engine/suspend.py, CudaModelRunner.release_memory /
restore_memory): a suspend gives the device memory back (measured with torch.cuda.mem_get_info),
a resume restores the retained conversation into the same pages, so the next turn reuses its prefix
and produces the tokens an Engine that was never suspended produces. The first test suspends without
configure_suspend, so the move to fixed addresses happens at that suspend (graphs captured before it
are captured again); test_suspend_fixed_cuda.py covers the graphs kept across a suspend."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from engine_helpers import assert_as_never_suspended, generate

from ninfer.engine.config import SchedulerConfig
from ninfer.engine.loader import load_engine


def _used() -> int:
    free, total = torch.cuda.mem_get_info()
    return total - free


def test_cuda_suspend_gives_device_memory_back_and_keeps_prefixes(smollm2_artifact: Path) -> None:
    def load():
        return load_engine(str(smollm2_artifact), backend="cuda", scheduler=SchedulerConfig(max_context=4096),
                           announce=False)

    m = load()
    engine = m.engine
    prompt = m.tokenizer.encode("The lighthouse keeper climbed the stairs and looked out at the sea. " * 12)
    first, _ = generate(engine, "a", prompt, 16)
    try:
        before = _used()
        r = engine.suspend().result(120)
        during = _used()
        assert r.state == "suspended" and r.host_snapshot_bytes > 0
        # the weights and the KV pool (at least) left the device: what the engine counted releasable at load
        # (last_suspend.weight_bytes is the fixed-address arena's mapped chunks, mapped during this first
        # suspend, so not in `before`; the full suite passed on other tests' cached blocks released with it)
        assert before - during >= 0.8 * r.releasable_bytes > 0, (before, during, r.to_dict())
        r = engine.resume().result(300)
        assert r.state == "resident" and _used() >= during
        second, final = generate(engine, "b", prompt + first, 16)
        assert final.usage.cached_tokens >= len(prompt)
        print(f"suspend {r.last_suspend.seconds * 1e3:.0f} ms, resume {r.last_resume.seconds * 1e3:.0f} ms, "
              f"device used {before / 2**20:.0f} -> {during / 2**20:.0f} MiB")
    finally:
        engine.shutdown()
    assert_as_never_suspended(load, prompt, 16, first, second, final)


@pytest.mark.parametrize("kv_dtype", ["auto", "int8", "fp8"])
def test_cuda_pinned_snapshot_and_host_weights(smollm2_artifact: Path, kv_dtype: str) -> None:
    """--suspend-snapshot pinned (a page-locked block for the whole KV pool reserved at load; int8 /
    fp8 caches with their scales, fp8 codes as bytes) and --suspend-weights host (the stored weights
    in pinned host memory, no file read at resume): the device memory still goes back, two cycles
    keep the conversation, and the tokens match an Engine never suspended."""
    from ninfer.engine.suspend import SuspendOptions

    def load():
        return load_engine(str(smollm2_artifact), backend="cuda", scheduler=SchedulerConfig(max_context=4096),
                           announce=False, kv_dtype=kv_dtype)

    m = load()
    engine = m.engine
    prompt = m.tokenizer.encode("The lighthouse keeper climbed the stairs and looked out at the sea. " * 12)
    try:
        r = engine.configure_suspend(SuspendOptions("pinned", "host")).result(120)
        reserved = r.host_reserved_bytes
        assert reserved > 0 and all(t.is_pinned() for ts in r.reserved.values() for t in ts)
        first, _ = generate(engine, "a", prompt, 16)
        for _ in range(2):
            before = _used()
            r = engine.suspend().result(120)
            during = _used()
            assert before - during >= 0.8 * r.last_suspend.weight_bytes, (before, during, r.to_dict())
            assert 0 < r.last_suspend.state_bytes < reserved and r.host_reserved_bytes == reserved
            # the weights held on the host: as they sit on the device at fixed addresses (the
            # normal case with CUDA VMM), else the artifact's stored tensors read at the suspend
            held = r.last_suspend.weight_bytes if engine.runner.fixed_addresses else r.last_suspend.artifact_read_bytes
            assert r.host_snapshot_bytes == r.last_suspend.state_bytes + held
            r = engine.resume().result(300)
            assert r.state == "resident" and r.last_resume.artifact_read_bytes == 0
            assert r.last_resume.state_bytes == r.last_suspend.state_bytes
        second, final = generate(engine, "b", prompt + first, 16)
        assert final.usage.cached_tokens >= len(prompt)
        print(f"pinned+host: suspend {r.last_suspend.seconds * 1e3:.0f} ms, resume {r.last_resume.seconds * 1e3:.0f} ms")
    finally:
        engine.shutdown()
    assert_as_never_suspended(load, prompt, 16, first, second, final)
