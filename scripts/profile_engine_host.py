"""Where the engine thread's host time goes during `ninfer bench` (cProfile inside the engine's worker
thread, which cProfile cannot see from the main thread). Prints the top functions by own time.
Usage: python scripts/profile_engine_host.py [bench args...]
  (default: --synthetic llama-8b --weights q4_k_m --backend cuda -p 0 -n 128 -r 2)"""
from __future__ import annotations

import cProfile
import pstats
import runpy
import sys

from ninfer.engine import engine as engine_mod

profiler = cProfile.Profile()


def main() -> None:
    args = sys.argv[1:] or ["--synthetic", "llama-8b", "--weights", "q4_k_m", "--backend", "cuda",
                            "-p", "0", "-n", "128", "-r", "2"]
    inner = engine_mod.Engine._run_loop

    def run_loop(self):
        profiler.enable()
        try:
            return inner(self)
        finally:
            profiler.disable()
    engine_mod.Engine._run_loop = run_loop
    sys.argv = ["ninfer", "bench", *args]
    try:
        runpy.run_module("ninfer.cli.main", run_name="__main__")
    except SystemExit:
        pass
    stats = pstats.Stats(profiler)
    stats.sort_stats("tottime").print_stats(30)
    stats.sort_stats("cumulative").print_stats(40)


if __name__ == "__main__":
    main()
