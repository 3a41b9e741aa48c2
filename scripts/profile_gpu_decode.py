"""Where a decode step's GPU time goes: runs `ninfer bench` (eager, no CUDA graph, so every kernel is
seen) under torch.profiler and prints CUDA time per kernel, largest first.
Usage: python scripts/profile_gpu_decode.py [bench args...]
  (default: --synthetic llama-8b --weights int4 -p 0 -n 64 -r 1)"""
from __future__ import annotations

import runpy
import sys

import torch
from torch.profiler import ProfilerActivity, profile


def main() -> None:
    args = sys.argv[1:] or ["--synthetic", "llama-8b", "--weights", "int4", "-p", "0", "-n", "64", "-r", "1"]
    sys.argv = ["ninfer", "bench", "--backend", "cuda", "--no-cuda-graph", *args]
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        try:
            runpy.run_module("ninfer.cli.main", run_name="__main__")
        except SystemExit:
            pass
    rows = [e for e in prof.key_averages() if e.device_time_total > 0]
    total = sum(e.device_time_total for e in rows)
    print(f"{'kernel':60s} {'calls':>7s} {'total ms':>9s} {'avg us':>8s} {'share':>6s}")
    for e in sorted(rows, key=lambda e: -e.device_time_total)[:25]:
        print(f"{e.key[:60]:60s} {e.count:7d} {e.device_time_total / 1e3:9.1f} "
              f"{e.device_time_total / e.count:8.1f} {e.device_time_total / total:6.1%}")


if __name__ == "__main__":
    main()
