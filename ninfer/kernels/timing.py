"""Timing a device call: per-call seconds over repeated samples, with CUDA events on a GPU (no
host sync inside a sample) and the wall clock on the CPU. Optionally the calls of a sample are
captured once into a CUDA graph and replayed, so host launch overhead is left out (what a decode
step replayed from its graph pays).
"""
from __future__ import annotations

import time
from collections.abc import Callable

import torch


def sample_seconds(fn: Callable[[], object], device: torch.device, *, reps: int = 5, inner: int = 1,
                   warmup: int = 1, graph: bool = False) -> list[float]:
    """Seconds per call of `fn`, one figure per sample of `inner` back-to-back calls."""
    if reps < 1 or inner < 1:
        raise ValueError("reps and inner must be >= 1")
    for _ in range(warmup):
        fn()
    if device.type != "cuda":
        out = []
        for _ in range(reps):
            t0 = time.perf_counter()
            for _ in range(inner):
                fn()
            out.append((time.perf_counter() - t0) / inner)
        return out
    run = _graphed(fn, inner, device) if graph else (lambda: [fn() for _ in range(inner)])
    torch.cuda.synchronize(device)
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for start, end in events:
        start.record()
        run()
        end.record()
    torch.cuda.synchronize(device)
    return [start.elapsed_time(end) / 1e3 / inner for start, end in events]


def _graphed(fn: Callable[[], object], inner: int, device: torch.device) -> Callable[[], None]:
    """`inner` calls of fn captured into one CUDA graph (fn has run eagerly before: modules loaded)."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream(device).wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, capture_error_mode="thread_local"):
        for _ in range(inner):
            fn()
    return g.replay


def calls_for(seconds_per_call: float, target_s: float, limit: int = 1000) -> int:
    """How many back-to-back calls make one sample of about `target_s` seconds."""
    if seconds_per_call <= 0:
        return limit
    return max(1, min(limit, round(target_s / seconds_per_call)))
