"""Where a decode step's wall time goes on the cuda backend: runs `ninfer bench` (CUDA graphs on) with
timers around the engine's step, the runner's execute and the graph replay (CUDA events), and prints
per decode step: loop iteration (wall), engine step, runner execute, graph replay (GPU), and what the
host adds. Usage: python scripts/decode_step_split.py [bench args...]
  (default: --synthetic llama-8b --weights q4_k_m -p 0 -n 128 -r 2)"""
from __future__ import annotations

import runpy
import statistics
import sys
import time

import torch

from ninfer.engine import engine as engine_mod
from ninfer.engine.backends import cuda_graphs, cuda_runner

samples: dict[str, list[float]] = {"loop": [], "step": [], "execute": [], "graph_gpu": [], "graph_host": []}
_events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
_last_loop = [0.0]


def timed(cls, name: str, key: str):
    inner = getattr(cls, name)

    def wrapper(self, *args, **kwargs):
        t0 = time.perf_counter()
        out = inner(self, *args, **kwargs)
        samples[key].append(time.perf_counter() - t0)
        return out
    setattr(cls, name, wrapper)


def main() -> None:
    args = sys.argv[1:] or ["--synthetic", "llama-8b", "--weights", "q4_k_m", "-p", "0", "-n", "128", "-r", "2"]
    step_inner = engine_mod.Engine._step

    def step(self, batch):
        now = time.perf_counter()
        if _last_loop[0]:
            samples["loop"].append(now - _last_loop[0])
        t0 = time.perf_counter()
        step_inner(self, batch)
        samples["step"].append(time.perf_counter() - t0)
        _last_loop[0] = now
    engine_mod.Engine._step = step
    timed(cuda_runner.CudaModelRunner, "_execute", "execute")
    replay_inner = cuda_graphs.DecodeGraphs.run

    def replay(self, n, parts, width=1):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        a.record()
        replay_inner(self, n, parts, width)
        b.record()
        samples["graph_host"].append(time.perf_counter() - t0)
        _events.append((a, b))
    cuda_graphs.DecodeGraphs.run = replay
    sys.argv = ["ninfer", "bench", "--backend", "cuda", *args]
    try:
        runpy.run_module("ninfer.cli.main", run_name="__main__")
    except SystemExit:
        pass
    torch.cuda.synchronize()
    samples["graph_gpu"] = [a.elapsed_time(b) / 1e3 for a, b in _events]
    # drop the first quarter (warm-up, captures)
    print(f"{'per decode step':18s} {'median us':>10s} {'mean us':>9s} {'n':>6s}")
    for key, vals in samples.items():
        v = vals[len(vals) // 4:]
        if v:
            print(f"{key:18s} {1e6 * statistics.median(v):10.1f} {1e6 * statistics.fmean(v):9.1f} {len(v):6d}")


if __name__ == "__main__":
    main()
