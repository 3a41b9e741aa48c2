"""Soak a running `ninfer serve`: N minutes at full concurrency over a mix of routes and streams.

  python scripts/soak.py --url http://127.0.0.1:8080 --api-key KEY --minutes 10 --workers 28 --pid PID

Each worker sends one request after another, drawn from a mix of Chat (plain and streamed),
legacy and llama.cpp completions, Messages (streamed), Responses, tokenize and token counts,
with short outputs. Counts sent / ok / errors by status / never answered (transport errors and
timeouts), and reads the server's resources before and after (engine gauges; RSS and open files
with --pid). Exit status 1 when a request went unanswered, a 5xx other than the spec's 503/504
queue timeout and 529 overload appeared, or pages are still held beyond the retained sessions once idle.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from reliability_common import resources, served_model, wait_idle  # noqa: E402


def mix(model: str) -> list[tuple[str, dict[str, Any], bool]]:
    """(path, body, streamed) choices; repeated entries weigh the draw."""
    chat = {"model": model, "max_tokens": 8, "messages": [{"role": "user", "content": "Tell me about rivers."}]}
    return [
        ("/v1/chat/completions", chat, False), ("/v1/chat/completions", chat, False),
        ("/v1/chat/completions", {**chat, "stream": True, "stream_options": {"include_usage": True}}, True),
        ("/v1/chat/completions", {**chat, "stream": True}, True),
        ("/v1/completions", {"model": model, "prompt": "Rivers flow", "max_tokens": 8}, False),
        ("/completion", {"prompt": "Once upon a time", "n_predict": 8, "stream": True}, True),
        ("/v1/messages", {"model": "soak", "max_tokens": 8, "stream": True,
                          "messages": [{"role": "user", "content": "Hello there"}]}, True),
        ("/v1/responses", {"model": model, "input": "Say something.", "max_output_tokens": 8, "store": False}, False),
        ("/tokenize", {"content": "some text to tokenize " * 20}, False),
        ("/v1/messages/count_tokens", {"model": "soak", "messages": [{"role": "user", "content": "count me"}]}, False),
    ]


async def run(url: str, api_key: str | None, minutes: float, workers: int, pid: int | None,
              seed: int = 0, timeout: float = 600.0) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    with httpx.Client(base_url=url, headers=headers, timeout=60) as sync:
        model = served_model(sync)
        before = wait_idle(sync)
        if pid is not None:
            before = resources(sync, pid)
    choices = mix(model)
    counts: Counter[str] = Counter()
    by_status: Counter[int] = Counter()
    stream_errors: list[str] = []
    unanswered: list[str] = []
    deadline = time.monotonic() + minutes * 60
    limits = httpx.Limits(max_connections=workers, max_keepalive_connections=workers)
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=timeout, limits=limits) as client:

        async def worker(i: int) -> None:
            rng = random.Random(seed * 1000 + i)
            while time.monotonic() < deadline:
                path, body, streamed = rng.choice(choices)
                counts["sent"] += 1
                try:
                    if streamed:
                        async with client.stream("POST", path, json=body) as r:
                            text = (await r.aread()).decode("utf-8", "replace")
                        if r.status_code == 200 and ('data: {"error"' in text or "event: error" in text
                                                     or "response.failed" in text):
                            stream_errors.append(text[-300:])
                    else:
                        r = await client.post(path, json=body)
                except httpx.HTTPError as e:
                    unanswered.append(f"{path}: {type(e).__name__}: {e}")
                    continue
                by_status[r.status_code] += 1
                counts["ok" if r.status_code == 200 else "error"] += 1

        await asyncio.gather(*(worker(i) for i in range(workers)))
    with httpx.Client(base_url=url, headers=headers, timeout=60) as sync:
        after = wait_idle(sync)
        if pid is not None:
            after = resources(sync, pid)
    # 503/504: queue timeouts (Messages: 504), 529: Messages overload, as the spec answers them
    bad_5xx = {s: n for s, n in by_status.items() if s >= 500 and s not in (503, 504, 529)}
    return {"minutes": minutes, "workers": workers, "sent": counts["sent"], "ok": counts["ok"],
            "errors_by_status": {s: n for s, n in sorted(by_status.items()) if s != 200},
            "unanswered": len(unanswered), "in_stream_errors": len(stream_errors), "unexpected_5xx": bad_5xx,
            "before": before, "after": after, "examples": (unanswered + stream_errors)[:3]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default="http://127.0.0.1:8080")
    ap.add_argument("--api-key")
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--workers", type=int, default=16)
    ap.add_argument("--pid", type=int, help="the server's pid, to read its RSS and open files")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    report = asyncio.run(run(args.url, args.api_key, args.minutes, args.workers, args.pid, args.seed))
    print(json.dumps(report, indent=1))
    after = report["after"]
    bad = report["unanswered"] or report["unexpected_5xx"] or after["leaked_pages"] or after["admitted"]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
