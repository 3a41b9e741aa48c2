"""Fixed-address suspend on the cuda backend (backends/vmm.py, CudaModelRunner.fix_addresses):
with --model-suspend the runner's weights, KV pool and step buffers sit in CUDA VMM arenas; a
suspend releases their physical memory (torch.cuda.mem_get_info shows it back on the device) and
keeps the CUDA Graphs, a resume maps fresh memory at the same addresses, so the graphs captured
before the suspend replay after it (the same objects, nothing captured again) and the tokens are
those of an Engine that was never suspended. Fast: the default model, 16-token turns."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from engine_helpers import generate

from ninfer.engine.config import SchedulerConfig
from ninfer.engine.loader import load_engine
from ninfer.engine.suspend import SuspendOptions


def _used() -> int:
    free, total = torch.cuda.mem_get_info()
    return total - free


def _turns(engine, prompt: list[int], between=None) -> list[tuple[list[int], int]]:
    """The first turn, the first turn again (twice, `between` before each), the next turn ->
    [(tokens, cached tokens)] of each."""
    out = []
    ids, final = generate(engine, "a", prompt, 16)
    out.append((ids, final.usage.cached_tokens))
    for cycle in range(2):
        if between is not None:
            between(cycle)
        again, final = generate(engine, f"again{cycle}", prompt, 16)
        out.append((again, final.usage.cached_tokens))
    second, final = generate(engine, "b", prompt + out[0][0], 16)
    out.append((second, final.usage.cached_tokens))
    return out


@pytest.mark.parametrize(("snapshot", "weights", "kv_dtype"),
                         [("pageable", "artifact", "auto"), ("pinned", "host", "fp8")])
def test_suspend_keeps_addresses_and_graphs(smollm2_artifact: Path, snapshot: str, weights: str,
                                            kv_dtype: str) -> None:
    def load():
        return load_engine(str(smollm2_artifact), backend="cuda", scheduler=SchedulerConfig(max_context=4096),
                           announce=False, kv_dtype=kv_dtype)

    m = load()
    engine = m.engine
    runner = engine.runner
    prompt = m.tokenizer.encode("The lighthouse keeper climbed the stairs and looked out at the sea. " * 12)
    seen: dict = {}

    def suspend_and_resume(cycle: int) -> None:
        if cycle == 0:  # the graphs of the first turn, captured before any suspend
            seen.update(graphs=runner.graphs, captured=dict(runner.graphs._graphs), captures=runner.graphs.captures,
                        addresses=[t.data_ptr() for t in (*runner.k_cache, runner.state.i32, runner.state.logits)])
            assert seen["captures"] > 0
        else:  # the previous turn replayed them: nothing captured again
            assert runner.graphs.captures == seen["captures"]
        arena_bytes = sum(a.arena.nbytes for a in runner._arenas.values())
        before = _used()
        r = engine.suspend().result(120)
        during = _used()
        assert r.state == "suspended" and runner.model is None
        assert before - during >= 0.95 * arena_bytes, (before, during, arena_bytes, r.to_dict())
        held_weights = r.last_suspend.weight_bytes if weights == "host" else 0
        assert r.host_snapshot_bytes == r.last_suspend.state_bytes + held_weights
        assert r.last_suspend.weight_bytes == runner._arenas["weights"].arena.nbytes
        r = engine.resume().result(300)
        assert r.state == "resident" and _used() - during >= 0.95 * arena_bytes
        assert r.last_resume.state_bytes == r.last_suspend.state_bytes
        assert (r.last_resume.artifact_read_bytes == 0) == (weights == "host")
        assert [t.data_ptr() for t in (*runner.k_cache, runner.state.i32, runner.state.logits)] == seen["addresses"]
        assert runner.graphs is seen["graphs"]
        assert all(runner.graphs._graphs[k] is g for k, g in seen["captured"].items())
        seen["timing"] = (arena_bytes, r.last_suspend.seconds, r.last_resume.seconds)

    try:
        engine.configure_suspend(SuspendOptions(snapshot, weights)).result(300)
        assert runner.fixed_addresses, "fix_addresses refused (its warning is in the captured log)"
        got = _turns(engine, prompt, suspend_and_resume)
        assert runner.graphs.captures == seen["captures"]  # the turns after the resumes replayed the old graphs
        arena_bytes, suspend_s, resume_s = seen["timing"]
        print(f"{snapshot}+{weights} kv {kv_dtype}: arenas {arena_bytes / 2**20:.0f} MiB, "
              f"suspend {suspend_s * 1e3:.1f} ms, resume {resume_s * 1e3:.1f} ms")
    finally:
        engine.shutdown()
    ref = load()
    try:
        want = _turns(ref.engine, prompt)
    finally:
        ref.engine.shutdown()
    assert got == want  # tokens and prefix reuse as an Engine never suspended
    assert got[3][1] >= len(prompt)


def test_without_fixed_addresses_a_resume_rebuilds(smollm2_artifact: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The fallback where VMM is missing: a suspend drops the runner's memory, a resume builds it
    again (graphs captured anew), with the same tokens."""
    from ninfer.engine.backends import vmm

    monkeypatch.setattr(vmm, "supported", lambda device: False)
    m = load_engine(str(smollm2_artifact), backend="cuda", scheduler=SchedulerConfig(max_context=4096),
                    announce=False)
    engine = m.engine
    prompt = m.tokenizer.encode("The lighthouse keeper climbed the stairs. " * 8)
    try:
        engine.configure_suspend(SuspendOptions()).result(300)
        assert not engine.runner.fixed_addresses
        first, _ = generate(engine, "a", prompt, 8)
        engine.suspend().result(120)
        assert engine.runner.graphs is None
        engine.resume().result(300)
        again, final = generate(engine, "b", prompt, 8)
        assert (final.finish_reason, final.error) == ("length", None)
        assert again == first
    finally:
        engine.shutdown()
