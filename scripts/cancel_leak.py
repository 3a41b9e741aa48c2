"""Cancel-leak check for a running `ninfer serve`: disconnect clients at every stage of a request,
then check that lanes, queue, pages, state slots and the process's open files are back to baseline.

  python scripts/cancel_leak.py --url http://127.0.0.1:8080 --api-key KEY --n 200 --pid PID

Stages, drawn at random: mid-body (headers and half a body, then close), queued (behind lanes held
by long requests), prefilling (a long prompt, closed right after sending), decoding (a stream closed
after its first bytes), aggregate (a non-streamed generation closed after a random delay), and a
Messages and a Responses stream closed mid-way. Exit status 1 when anything stays held once idle.
Serve with --max-concurrency >= 1 and a queue (--max-pending-requests) so some requests wait.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import socket
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from reliability_common import resources, served_model, wait_idle  # noqa: E402

STAGES = ("mid_body", "queued", "prefilling", "decoding", "aggregate", "messages_stream", "responses_stream")


async def _mid_body(url: str, api_key: str | None) -> None:
    u = urlparse(url)
    reader, writer = await asyncio.open_connection(u.hostname, u.port)
    body = b'{"messages": [{"role": "user", "content": "' + b"x" * 4000 + b'"}]}'
    auth = f"Authorization: Bearer {api_key}\r\n".encode() if api_key else b""
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n" + auth
                 + b"Content-Type: application/json\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n"
                 + body[:len(body) // 2])
    await writer.drain()
    writer.transport.set_write_buffer_limits(0)
    writer.close()


async def _closed_after(client: httpx.AsyncClient, path: str, body: dict[str, Any], nbytes: int,
                        delay: float = 0.0) -> None:
    """Stream `body` and drop the connection after `nbytes` of response (or `delay` s)."""
    async def go() -> None:
        async with client.stream("POST", path, json=body) as r:
            got = 0
            async for chunk in r.aiter_raw():
                got += len(chunk)
                if got >= nbytes:
                    return

    if delay:
        try:
            await asyncio.wait_for(go(), delay)
        except asyncio.TimeoutError:
            pass
    else:
        await go()


async def run(url: str, api_key: str | None, n: int, pid: int | None, seed: int = 0,
              concurrency: int = 6) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    with httpx.Client(base_url=url, headers=headers, timeout=60) as sync:
        model = served_model(sync)
        wait_idle(sync)
        before = resources(sync, pid)
    rng = random.Random(seed)
    done: Counter[str] = Counter()
    failures: list[str] = []
    long_prompt = "The history of every river in the world, told slowly. " * 60
    chat = {"model": model, "messages": [{"role": "user", "content": "Write a long story about rivers."}],
            "max_tokens": 64, "ignore_eos": True}
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=300) as client:

        async def one(stage: str) -> None:
            async with sem:
                try:
                    if stage == "mid_body":
                        await _mid_body(url, api_key)
                    elif stage == "queued":  # lanes held by others: this one waits, then leaves
                        await _closed_after(client, "/v1/chat/completions", {**chat, "stream": True},
                                            1 << 30, delay=rng.uniform(0.05, 0.6))
                    elif stage == "prefilling":
                        await _closed_after(client, "/v1/chat/completions",
                                            {**chat, "messages": [{"role": "user", "content": long_prompt}]},
                                            1 << 30, delay=rng.uniform(0.05, 0.5))
                    elif stage == "decoding":
                        await _closed_after(client, "/v1/chat/completions", {**chat, "stream": True},
                                            rng.randint(1, 600))
                    elif stage == "aggregate":
                        await _closed_after(client, "/v1/chat/completions", chat, 1 << 30,
                                            delay=rng.uniform(0.1, 2.0))
                    elif stage == "messages_stream":
                        await _closed_after(client, "/v1/messages", {"model": "x", "max_tokens": 64, "stream": True,
                                                                     "messages": [{"role": "user", "content": "Hi"}]},
                                            rng.randint(1, 900))
                    else:
                        await _closed_after(client, "/v1/responses", {"model": model, "input": "Tell a story",
                                                                      "max_output_tokens": 64, "stream": True},
                                            rng.randint(1, 1500))
                except (httpx.HTTPError, OSError, socket.error) as e:
                    failures.append(f"{stage}: {type(e).__name__}: {e}")
                done[stage] += 1

        await asyncio.gather(*(one(rng.choice(STAGES)) for _ in range(n)))
    with httpx.Client(base_url=url, headers=headers, timeout=60) as sync:
        wait_idle(sync)
        # a request whose client vanished is cancelled at the next step boundary; give it a moment
        deadline = time.monotonic() + 30
        while True:
            after = resources(sync, pid)
            settled = (after["leaked_pages"] == 0 and after["processing_slots"] == 0
                       and (pid is None or after["open_files"] <= before["open_files"]))
            if settled or time.monotonic() > deadline:
                break
            time.sleep(0.2)
    leaks = {k: (before[k], after[k]) for k in ("admitted", "running", "waiting", "leaked_pages",
                                                "processing_slots", "open_files")
             if k in after and after[k] > before.get(k, 0)}
    return {"disconnects": n, "by_stage": dict(done), "client_side_failures": len(failures),
            "before": before, "after": after, "leaks": leaks, "examples": failures[:3]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default="http://127.0.0.1:8080")
    ap.add_argument("--api-key")
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--pid", type=int, help="the server's pid, to compare its open files")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    report = asyncio.run(run(args.url, args.api_key, args.n, args.pid, args.seed))
    print(json.dumps(report, indent=1))
    return 1 if report["leaks"] else 0


if __name__ == "__main__":
    sys.exit(main())
