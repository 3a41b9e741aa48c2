"""Suspend / resume of a model (default: the default model) on the torch or cuda backend: durations, bytes moved, and the
process's resident memory before a suspend, while suspended and after the resume (docs/PERF.md).

    python scripts/suspend_bench.py [MODEL] [--cycles 3] [--backend torch|cuda]
        [--suspend-snapshot pageable|pinned] [--suspend-weights artifact|host]
"""
from __future__ import annotations

import argparse
import os
import time


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def device_used_mib() -> float | None:
    import torch
    if not torch.cuda.is_available():
        return None
    free, total = torch.cuda.mem_get_info()
    return (total - free) / 2**20


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?")
    ap.add_argument("--cycles", type=int, default=3)
    ap.add_argument("--backend", default="torch")
    ap.add_argument("--suspend-snapshot", default="pageable", choices=("pageable", "pinned"))
    ap.add_argument("--suspend-weights", default="artifact", choices=("artifact", "host"))
    args = ap.parse_args()
    from ninfer.engine.config import SchedulerConfig
    from ninfer.engine.loader import load_engine
    from ninfer.engine.request import PreparedRequest, SamplingParams
    from ninfer.engine.suspend import SuspendOptions

    m = load_engine(args.model, backend=args.backend, scheduler=SchedulerConfig(max_context=4096), announce=False)
    engine = m.engine
    reserved = engine.configure_suspend(SuspendOptions(args.suspend_snapshot, args.suspend_weights)).result()
    print(f"--suspend-snapshot {args.suspend_snapshot} --suspend-weights {args.suspend_weights}: "
          f"reserved {reserved.host_reserved_bytes / 2**20:.1f} MiB, fixed addresses (CUDA VMM, graphs kept): "
          f"{getattr(engine.runner, 'fixed_addresses', False)}")
    prompt = m.tokenizer.encode("The lighthouse keeper climbed the stairs. " * 60)
    for event in engine.submit(PreparedRequest("warm", prompt, SamplingParams(temperature=0.0), max_tokens=16)):
        pass
    print(f"releasable {engine.residency.releasable_bytes / 2**20:.1f} MiB")
    for n in range(args.cycles):
        before, dev_before = rss_mib(), device_used_mib()
        r = engine.suspend().result()
        suspended, dev_suspended = rss_mib(), device_used_mib()
        held = r.host_snapshot_bytes
        t0 = time.monotonic()
        r = engine.resume().result()
        wall = time.monotonic() - t0
        after = rss_mib()
        s, u = r.last_suspend, r.last_resume
        dev = f" device used {dev_before:.0f} -> {dev_suspended:.0f} MiB" if dev_before is not None else ""
        print(f"cycle {n}: suspend {s.seconds * 1e3:.0f} ms (state {s.state_bytes / 2**20:.1f} MiB, weights "
              f"{s.weight_bytes / 2**20:.1f} MiB released) | resume {u.seconds * 1e3:.0f} ms (wall {wall * 1e3:.0f} ms, "
              f"artifact read {u.artifact_read_bytes / 2**20:.1f} MiB, snapshot held "
              f"{held / 2**20:.1f} MiB) | RSS {before:.0f} -> {suspended:.0f} -> "
              f"{after:.0f} MiB{dev}")
    final = None
    for event in engine.submit(PreparedRequest("again", prompt, SamplingParams(temperature=0.0), max_tokens=4)):
        final = event
    print(f"after the cycles: cached {final.usage.cached_tokens} of {final.usage.prompt_tokens} prompt tokens")
    engine.shutdown()


if __name__ == "__main__":
    main()
