"""Decode rate of one streaming HTTP client against the same engine driven in-process (default model).

Both sides run at once and take turns, request by request, so each pair shares the machine's load of
that moment (this 2-core machine is shared): the engine-direct request through `Engine.submit` in
this process, then the same request as a streaming `/v1/completions` client of a `ninfer serve`
subprocess. Each request: the same prompt ids, greedy, --tokens output tokens with ignore_eos.
Rate = tokens after the first / time from the first token to the final event (the client sees
both through the server's stream), as `ninfer bench` counts tg. Both processes use --threads.

    NINFER_CACHE=... PYTHONPATH=. python scripts/bench_decode_http.py --threads 2 [--rounds 6] [--tokens 64]
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

from bench_http import GREEDY_BODY, PROMPT, free_port, stop_server


def engine_rate(engine, ids: list[int], tokens: int, tag: str) -> float:
    from ninfer.engine.request import PreparedRequest, SamplingParams

    req = PreparedRequest(request_id=tag, prompt_token_ids=ids, sampling=SamplingParams(temperature=0.0),
                          max_tokens=tokens, ignore_eos=True, cache_prompt=False, raw_prompt=True)
    first, n = None, 0
    for ev in engine.submit(req):
        if ev.token_ids and first is None:
            first = time.perf_counter()
            n += len(ev.token_ids) - 1
        else:
            n += len(ev.token_ids)
        if ev.finish_reason is not None:
            assert ev.finish_reason == "length", ev
    return n / (time.perf_counter() - first)


def http_rate(client: httpx.Client, ids: list[int], tokens: int) -> float:
    body = {"prompt": ids, "max_tokens": tokens, "ignore_eos": True, "stream": True, "cache_prompt": False,
            "stream_options": {"include_usage": True}, **GREEDY_BODY}
    first = end = None
    completion = -1
    with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise SystemExit(f"/v1/completions answered {r.status_code}: {r.read()[:300]!r}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            choices = chunk.get("choices") or []
            if choices and choices[0].get("text") and first is None:
                first = time.perf_counter()
            if choices and choices[0].get("finish_reason"):
                end = time.perf_counter()
            if chunk.get("usage"):
                completion = chunk["usage"]["completion_tokens"]
    assert completion == tokens and first is not None and end is not None, (completion, first, end)
    return (completion - 1) / (end - first)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=0, help="CPU threads of both sides (0: each measures the free cores)")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--log", default="/tmp/bench_decode_http_server.log")
    args = ap.parse_args()

    from ninfer.engine import cpu_threads
    plan = cpu_threads.prepare(args.threads or None)  # before torch loads, as the CLI does
    print(plan.describe(), flush=True)
    from ninfer.engine.config import SchedulerConfig
    from ninfer.engine.loader import load_engine

    port = free_port()
    cmd = [sys.executable, "-m", "ninfer.cli.main", "serve", "--port", str(port), "--max-concurrency", "1",
           "--log-level", "info", "--threads", str(args.threads)]
    server = subprocess.Popen(cmd, stdout=Path(args.log).open("w"), stderr=subprocess.STDOUT)
    loaded = load_engine(None, scheduler=SchedulerConfig(max_concurrency=1, prefix_reuse=False), announce=False,
                         threads=args.threads or None)
    try:
        ids = loaded.tokenizer.encode(PROMPT, add_special_tokens=True)
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120.0) as client:
            deadline = time.monotonic() + 300
            while True:
                try:
                    if client.get("/health").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                if server.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"the server did not come up; see {args.log}")
                time.sleep(0.2)
            engine_rate(loaded.engine, ids, 8, "warm")
            http_rate(client, ids, 8)
            eng, web = [], []
            for r in range(args.rounds):
                eng.append(engine_rate(loaded.engine, ids, args.tokens, f"r{r}"))
                web.append(http_rate(client, ids, args.tokens))
                print(f"round {r}: engine-direct {eng[-1]:.1f} tok/s, HTTP stream {web[-1]:.1f} tok/s "
                      f"({web[-1] / eng[-1]:.1%})", flush=True)
    finally:
        loaded.engine.shutdown()
        stop_server(server)
    me, mw = statistics.median(eng), statistics.median(web)
    ratios = [w / e for e, w in zip(eng, web)]
    print(f"median engine-direct {me:.1f} tok/s, HTTP {mw:.1f} tok/s: HTTP / engine {mw / me:.1%} "
          f"(per-round ratios median {statistics.median(ratios):.1%}, {min(ratios):.1%}..{max(ratios):.1%})")


if __name__ == "__main__":
    main()
