"""Where a captured decode step's time goes: runs `ninfer bench` with CUDA graphs (as served) under
torch.profiler, cuts the kernel timeline into steps at each `sample_tokens` launch, and prints, over
the middle half of the decode steps (those with the commonest kernel sequence), the step period
against the time some kernel runs (the rest: gaps between kernels, i.e. launch latency), then each
kernel's launches and microseconds per step, then the step's first NINFER_STEP_LIST (default 16)
launches in order: the gap before each and its time (a layer's kernels one by one: which projection
costs what). With programmatic dependent launch a kernel starts before the one ahead of it ends, so
its time includes that wait (negative gaps): NINFER_PDL=0 for each kernel's own time.
(scripts/profile_gpu_decode.py profiles eager steps instead, where launch gaps are the host's.)
Usage: python scripts/profile_gpu_step.py [bench args...]
  (default: --synthetic smollm2-135m --weights int4 -p 0 -n 128 -r 1 --device-profile off --ceilings off)"""
from __future__ import annotations

import collections
import os
import runpy
import sys

from torch.profiler import ProfilerActivity, profile

DEFAULT = ["--synthetic", "smollm2-135m", "--weights", "int4", "-p", "0", "-n", "128", "-r", "1",
           "--device-profile", "off", "--ceilings", "off"]


def main() -> None:
    sys.argv = ["ninfer", "bench", "--backend", "cuda", *(sys.argv[1:] or DEFAULT)]
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        try:
            runpy.run_module("ninfer.cli.main", run_name="__main__")
        except SystemExit:
            pass
    kernels = sorted(((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                      if e.device_type.name == "CUDA" and e.time_range.end > e.time_range.start
                      and not e.name.startswith("Memcpy") and not e.name.startswith("Memset")), key=lambda k: k[0])
    # a step ends at its sampler's last kernel (the split sampler launches two in a row)
    sampler = [k[2].startswith("sample_tokens") for k in kernels] + [False]
    cuts = [i for i in range(len(kernels)) if sampler[i] and not sampler[i + 1]]
    steps = [kernels[a + 1:b + 1] for a, b in zip(cuts, cuts[1:])]
    # decode steps replay one graph: keep the steps with the commonest kernel sequence (not those that
    # also hold a prompt's forward between bench runs), then their middle half
    shapes = collections.Counter(tuple(k[2] for k in s) for s in steps if s)
    if shapes:
        common = shapes.most_common(1)[0][0]
        steps = [s for s in steps if tuple(k[2] for k in s) == common]
        steps = steps[len(steps) // 4:3 * len(steps) // 4 or None]
    if not steps:
        raise SystemExit("no decode steps seen (did the bench run on the cuda backend with graphs?)")
    n = len(steps)
    period = sum(s[-1][1] - s[0][0] for s in steps) / n
    busy = 0.0
    per = collections.defaultdict(lambda: [0, 0.0])
    for s in steps:
        end = s[0][0]
        for a, b, name in s:
            busy += max(0.0, b - max(a, end))
            end = max(end, b)
            per[name][0] += 1
            per[name][1] += b - a
    launches = sum(c for c, _ in per.values()) / n
    print(f"{n} steps: period {period:.1f} us ({1e6 / period:.0f} steps/s), kernels running {busy / n:.1f} us, "
          f"gaps {period - busy / n:.1f} us over {launches:.0f} launches ({(period - busy / n) / launches:.2f} us each)")
    print(f"{'kernel':60s} {'per step':>8s} {'us/step':>8s} {'us each':>8s}")
    for name, (count, total) in sorted(per.items(), key=lambda kv: -kv[1][1]):
        print(f"{name[:60]:60s} {count / n:8.1f} {total / n:8.1f} {total / count:8.2f}")
    first = min(len(s) for s in steps)
    print(f"\nthe step's launches in order, mean over the steps ({'gap us':>6s} {'us':>6s}):")
    for i in range(min(first, int(os.environ.get("NINFER_STEP_LIST", "16")))):
        gap = sum(s[i][0] - s[i - 1][1] for s in steps) / n if i else 0.0
        print(f"{i:3d} {steps[0][i][2][:60]:60s} {gap:6.2f} {sum(s[i][1] - s[i][0] for s in steps) / n:6.2f}")


if __name__ == "__main__":
    main()
