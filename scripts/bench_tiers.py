"""Time to first token of a long prefix: recompute vs a device hit vs a host-tier hit.

One Engine with one retained conversation (--max-private-continuations 1) and a host tier:
  recompute  the prefix (N random tokens) + 1 new token, cache_prompt false
  device     the prefix + 1 new token again, the prefix retained on the device
  host       the same after an unrelated short prompt evicted the prefix to the host tier
Rounds interleave the three; the table shows the median and min TTFT of each (milliseconds).

    python scripts/bench_tiers.py --synthetic llama-8b --backend cuda --prefix 16384   # H200
    python scripts/bench_tiers.py --prefix 2048                                         # CPU, default model
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from ninfer.engine.config import MemoryConfig, SchedulerConfig
from ninfer.engine.request import PreparedRequest, SamplingParams


def ttft(engine, rid: str, prompt: list[int], cache_prompt: bool = True) -> tuple[float, int, str | None]:
    t0 = time.perf_counter()
    handle = engine.submit(PreparedRequest(request_id=rid, prompt_token_ids=prompt, max_tokens=2,
                                           sampling=SamplingParams(temperature=0.0), cache_prompt=cache_prompt))
    first = None
    final = None
    for ev in handle:
        if first is None and ev.token_ids:
            first = time.perf_counter() - t0
        final = ev
    return first * 1e3, final.usage.cached_tokens, final.reuse_tier


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--synthetic", default=None, help="a synthetic shape (llama-8b, ...); default: the default model")
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--prefix", type=int, default=16384)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--host-mib", type=int, default=16384)
    ap.add_argument("--kv-dtype", default="auto")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    from ninfer.engine.loader import load_engine, resolve_backend, start_engine

    scheduler = SchedulerConfig(max_concurrency=1, max_private_continuations=1, max_context=args.prefix + 64,
                                prefill_chunk=2048)
    memory = MemoryConfig(host_kv_bytes=args.host_mib << 20)
    kv = 2 * (args.prefix + 64)
    if args.synthetic:
        from ninfer.engine.synthetic import SyntheticArtifact
        backend, device = resolve_backend(args.backend, 0)
        loaded = start_engine(SyntheticArtifact(args.synthetic), backend=backend, torch_device=device,
                              scheduler=scheduler, kv_capacity=kv, memory=memory, kv_dtype=args.kv_dtype)
    else:
        loaded = load_engine(None, backend=args.backend, scheduler=scheduler, kv_capacity=kv, memory=memory,
                             announce=False, kv_dtype=args.kv_dtype)
    engine = loaded.engine
    vocab = min(loaded.facts.vocab_size, 30000)
    r = random.Random(0)
    results: dict[str, list[float]] = {"recompute": [], "device": [], "host": []}
    try:
        for i in range(args.rounds):
            prefix = [r.randrange(10, vocab) for _ in range(args.prefix)]
            ms, cached, _ = ttft(engine, f"r{i}", prefix + [11], cache_prompt=False)
            assert cached == 0
            results["recompute"].append(ms)
            ttft(engine, f"w{i}", prefix + [12])  # retain the prefix on the device
            ms, cached, tier = ttft(engine, f"d{i}", prefix + [12, 13])
            assert cached >= args.prefix and tier == "device", (cached, tier)
            results["device"].append(ms)
            ttft(engine, f"x{i}", [r.randrange(10, vocab) for _ in range(8)])  # evicts the prefix to the host
            ms, cached, tier = ttft(engine, f"h{i}", prefix + [12, 13, 14])
            assert cached >= args.prefix and tier == "host", (cached, tier)
            results["host"].append(ms)
    finally:
        engine.shutdown()
    report = {"model": args.synthetic or "default", "backend": loaded.backend, "device": loaded.device,
              "prefix_tokens": args.prefix, "kv_dtype": args.kv_dtype,
              "ttft_ms": {k: {"median": statistics.median(v), "min": min(v), "all": v} for k, v in results.items()}}
    print(f"{'path':<10} {'median ms':>10} {'min ms':>10}")
    for k, v in report["ttft_ms"].items():
        print(f"{k:<10} {v['median']:>10.1f} {v['min']:>10.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
