"""Decode of the default model with and without one core kept busy by another process.

Rounds alternate: `ninfer bench -p 0 -n N` as it is, then the same while a spinning process (a
Python busy loop) runs beside it, started a second before (so the thread plan made at start sees
it). Optionally a third run per round with --threads forced to all cores under the same spinner,
which is what happened before threads were chosen from the free cores. Prints each figure with
the 1-minute load average, and busy / quiet per round.

    NINFER_CACHE=... PYTHONPATH=. python scripts/bench_cpu_busy.py [--rounds 3] [--tokens 64] [--forced]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time


def bench(tokens: int, reps: int, threads: int | None) -> tuple[float, int]:
    cmd = [sys.executable, "-m", "ninfer.cli.main", "bench", "-p", "0", "-n", str(tokens), "-r", str(reps),
           "-o", "json", "--backend", "torch"] + (["--threads", str(threads)] if threads else [])
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=1200)
    if out.returncode != 0:
        raise SystemExit(out.stderr[-2000:])
    row = json.loads(out.stdout)[0]
    return row["avg_ts"], row["n_threads"]


def load1() -> float:
    return os.getloadavg()[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--forced", action="store_true", help="also run with --threads = all cores under the spinner")
    args = ap.parse_args()
    cores = len(os.sched_getaffinity(0))
    ratios = []
    for r in range(args.rounds):
        quiet, tq = bench(args.tokens, args.reps, None)
        lq = load1()
        spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        try:
            time.sleep(1.0)
            busy, tb = bench(args.tokens, args.reps, None)
            lb = load1()
            forced = bench(args.tokens, args.reps, cores) if args.forced else None
        finally:
            spinner.kill()
            spinner.wait()
        ratios.append(busy / quiet)
        line = (f"round {r}: quiet {quiet:.1f} tok/s ({tq} threads, load {lq:.1f}); one core busy "
                f"{busy:.1f} tok/s ({tb} threads, load {lb:.1f}): {busy / quiet:.0%} of quiet")
        if forced is not None:
            line += f"; busy with --threads {cores}: {forced[0]:.1f} tok/s"
        print(line, flush=True)
    print(f"busy / quiet: median {statistics.median(ratios):.0%} (min {min(ratios):.0%})")


if __name__ == "__main__":
    main()
