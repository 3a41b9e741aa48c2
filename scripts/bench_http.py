"""HTTP overhead of `ninfer serve` against the same engine driven in-process (default model).

Two measurements, each taken engine-direct and then over HTTP (the in-process engine is shut
down before the server starts, so the two never share the cores):

- latency: --n sequential 1-token greedy completions of one fixed raw prompt (the same token
  ids on both sides, prefix reuse on as the server does by default), p50/p99 from submit to the
  final event (engine) and from request to parsed response (HTTP on /v1/completions, over one
  persistent connection of a lean client: each HTTP/1.1 request written in one send on a raw
  socket, the Content-Length body read back and JSON-decoded). The difference is the HTTP
  overhead. The same requests through httpx are timed too, for comparison: that client's own
  cost is several hundred microseconds. The engine's own prompt_ms (the compute of the one
  step) is shown for both sides, so a slower engine inside the server shows apart from the HTTP
  path; "net of it" is the difference of p50/p99 of each request's latency minus its prompt_ms.
  GET /health is timed too (both clients): the transport floor (client + Granian + ASGI app).
- throughput: --clients concurrent requests of --tokens tokens each (ignore_eos, so lengths
  are fixed), --rounds rounds after a warm-up round; aggregate tok/s = all output tokens /
  wall time of the round. Engine-direct: one thread per handle; HTTP: streaming
  /v1/completions clients on one asyncio loop.

    NINFER_CACHE=/tmp/nc /work/venv/bin/python scripts/bench_http.py [--n 200] [--json out.json]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from functools import partial
from pathlib import Path
from typing import Any

import httpx

from ninfer.engine.config import SchedulerConfig
from ninfer.engine.loader import load_engine
from ninfer.engine.request import PreparedRequest, SamplingParams

PROMPT = "The capital of France is"
MAX_CONCURRENCY = 8
MAX_CONTEXT = 8192  # `ninfer serve`'s --max-context default
HINTS = {"protocol": "completions", "timings_per_token": False, "skip_special_tokens": True}  # as prepare_raw
GREEDY_BODY = {"temperature": 0, "top_k": 20, "top_p": 1.0, "min_p": 0.0,
               "presence_penalty": 0.0, "frequency_penalty": 0.0}  # SamplingParams(temperature=0) on the wire


def pct(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100)."""
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q / 100 * len(s) + 0.5) - 1))]


def summary_ms(seconds: list[float]) -> dict[str, float]:
    ms = [s * 1e3 for s in seconds]
    return {"p50_ms": pct(ms, 50), "p99_ms": pct(ms, 99), "mean_ms": statistics.fmean(ms),
            "min_ms": min(ms), "max_ms": max(ms), "n": len(ms)}


def beyond(latency: list[float], compute: list[float]) -> dict[str, float]:
    """Each request's latency minus its engine's own prompt compute: what is left when the
    machine runs the engine faster or slower in one phase than in the other."""
    return summary_ms([t - c for t, c in zip(latency, compute)])


def client_prompts(base: list[int], tok: Any, clients: int) -> list[list[int]]:
    """One distinct prompt per client (a numbered prefix), so no two lanes share a prefix hit."""
    return [tok.encode(f"Story {i}: ", add_special_tokens=False) + base for i in range(clients)]


# ---- engine-direct ----------------------------------------------------------------------------

def engine_request(rid: str, ids: list[int], max_tokens: int, *, cache_prompt: bool,
                   ignore_eos: bool = False) -> PreparedRequest:
    return PreparedRequest(request_id=rid, prompt_token_ids=list(ids), sampling=SamplingParams(temperature=0.0),
                           max_tokens=max_tokens, ignore_eos=ignore_eos, cache_prompt=cache_prompt,
                           raw_prompt=True, hints=dict(HINTS))


def engine_latency(engine: Any, ids: list[int], n: int, warmup: int,
                   cache_prompt: bool) -> tuple[list[float], list[float]]:
    """(submit-to-final-event seconds, the engine's own prompt_ms / 1e3) per timed request."""
    out, compute = [], []
    for i in range(warmup + n):
        req = engine_request(f"lat-{i}", ids, 1, cache_prompt=cache_prompt)
        t0 = time.perf_counter()
        for event in engine.submit(req):
            pass
        dt = time.perf_counter() - t0
        if event.finish_reason not in ("length", "stop"):
            raise SystemExit(f"engine request ended with {event.finish_reason}: {event.error}")
        if i >= warmup:
            out.append(dt)
            compute.append(event.timings.prompt_ms / 1e3)
    return out, compute


def engine_round(engine: Any, prompts: list[list[int]], tokens: int, tag: str,
                 cache_prompt: bool) -> tuple[int, float]:
    """One throughput round: all requests submitted at once, drained by one thread each."""
    counts = [0] * len(prompts)

    def drain(k: int, handle: Any) -> None:
        for event in handle:
            counts[k] += len(event.token_ids)

    t0 = time.perf_counter()
    handles = [engine.submit(engine_request(f"{tag}-{k}", p, tokens, cache_prompt=cache_prompt, ignore_eos=True))
               for k, p in enumerate(prompts)]
    threads = [threading.Thread(target=drain, args=(k, h)) for k, h in enumerate(handles)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(counts), time.perf_counter() - t0


# ---- HTTP -------------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(port: int, deadline_s: float, log: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "ninfer.cli.main", "serve", "--port", str(port),
           "--max-concurrency", str(MAX_CONCURRENCY), "--log-level", "warning"]
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + deadline_s
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=2.0) as c:
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"the server exited with {proc.returncode}; see {log}")
            try:
                if c.get("/health").status_code == 200:  # 503 model_loading until the engine is up
                    return proc
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                proc.terminate()
                raise SystemExit(f"the server was not healthy within {deadline_s:.0f} s; see {log}")
            time.sleep(0.1)


def stop_server(proc: subprocess.Popen) -> None:
    proc.terminate()  # SIGTERM: a clean stop
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


class LeanClient:
    """HTTP/1.1 over one keep-alive socket: the request written in one send, the response's
    Content-Length body read back. Only what this benchmark needs (no chunked responses)."""

    def __init__(self, host: str, port: int) -> None:
        self._sock = socket.create_connection((host, port))
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._host = f"{host}:{port}".encode()
        self._buf = b""

    def close(self) -> None:
        self._sock.close()

    def request(self, method: str, path: str, body: bytes | None = None) -> tuple[int, bytes]:
        head = [f"{method} {path} HTTP/1.1".encode(), b"Host: " + self._host]
        if body is not None:
            head += [b"Content-Type: application/json", b"Content-Length: %d" % len(body)]
        self._sock.sendall(b"\r\n".join(head) + b"\r\n\r\n" + (body or b""))
        while (end := self._buf.find(b"\r\n\r\n")) < 0:
            self._recv()
        lines = self._buf[:end].split(b"\r\n")
        self._buf = self._buf[end + 4:]
        length = next((int(line[15:]) for line in lines[1:] if line[:15].lower() == b"content-length:"), None)
        if length is None:
            raise SystemExit(f"{method} {path}: no Content-Length in the response")
        while len(self._buf) < length:
            self._recv()
        payload, self._buf = self._buf[:length], self._buf[length:]
        return int(lines[0].split()[1]), payload

    def _recv(self) -> None:
        data = self._sock.recv(65536)
        if not data:
            raise SystemExit("the server closed the connection")
        self._buf += data


def lean_call(client: LeanClient, method: str, path: str, body: bytes | None = None) -> tuple[int, Any]:
    status, payload = client.request(method, path, body)
    return status, json.loads(payload)


def httpx_call(client: httpx.Client, method: str, path: str, body: bytes | None = None) -> tuple[int, Any]:
    headers = {"content-type": "application/json"} if body is not None else None
    r = client.request(method, path, content=body, headers=headers)
    return r.status_code, r.json()


def http_latency(post: Any, ids: list[int], n: int, warmup: int,
                 cache_prompt: bool) -> tuple[list[float], list[float]]:
    """(request-to-parsed-response seconds, the server engine's prompt_ms / 1e3) per timed request;
    `post(path, body bytes)` is one client's round trip, returning (status, decoded JSON)."""
    body = json.dumps({"prompt": ids, "max_tokens": 1, "cache_prompt": cache_prompt, **GREEDY_BODY}).encode()
    out, compute = [], []
    for i in range(warmup + n):
        t0 = time.perf_counter()
        status, payload = post("/v1/completions", body)
        dt = time.perf_counter() - t0
        if status != 200 or payload["usage"]["completion_tokens"] != 1:
            raise SystemExit(f"/v1/completions answered {status}: {str(payload)[:300]}")
        if i >= warmup:
            out.append(dt)
            compute.append(payload["timings"]["prompt_ms"] / 1e3)
    return out, compute


def http_health(get: Any, n: int, warmup: int) -> list[float]:
    """GET /health round trips; `get(path)` is one client's round trip, returning (status, decoded JSON)."""
    out = []
    for i in range(warmup + n):
        t0 = time.perf_counter()
        status, payload = get("/health")
        dt = time.perf_counter() - t0
        if status != 200 or payload.get("status") != "ok":
            raise SystemExit(f"/health answered {status}: {payload}")
        if i >= warmup:
            out.append(dt)
    return out


async def _stream_one(client: httpx.AsyncClient, ids: list[int], tokens: int, cache_prompt: bool) -> int:
    body = {"prompt": ids, "max_tokens": tokens, "ignore_eos": True, "stream": True, "cache_prompt": cache_prompt,
            "stream_options": {"include_usage": True}, **GREEDY_BODY}
    completion = -1
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise SystemExit(f"streaming /v1/completions answered {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise SystemExit(f"stream error: {chunk['error']}")
            if chunk.get("usage"):
                completion = chunk["usage"]["completion_tokens"]
    return completion


async def http_rounds(base_url: str, prompts: list[list[int]], tokens: int, rounds: int,
                      cache_prompt: bool) -> list[tuple[int, float]]:
    limits = httpx.Limits(max_connections=len(prompts), max_keepalive_connections=len(prompts))
    out = []
    async with httpx.AsyncClient(base_url=base_url, timeout=300.0, limits=limits) as client:
        for _ in range(rounds):
            t0 = time.perf_counter()
            counts = await asyncio.gather(*(_stream_one(client, p, tokens, cache_prompt) for p in prompts))
            out.append((sum(counts), time.perf_counter() - t0))
    return out


# ---- driver -----------------------------------------------------------------------------------

def tok_s(rounds: list[tuple[int, float]]) -> dict[str, Any]:
    rates = [n / s for n, s in rounds]
    return {"median_tok_s": statistics.median(rates), "best_tok_s": max(rates), "rounds_tok_s": rates,
            "tokens_per_round": [n for n, _ in rounds]}


def run_engine(args: argparse.Namespace) -> tuple[dict[str, Any], list[int], list[list[int]]]:
    sched = SchedulerConfig(max_concurrency=MAX_CONCURRENCY, max_context=MAX_CONTEXT)
    loaded = load_engine(None, scheduler=sched, announce=False)
    try:
        tok = loaded.tokenizer
        ids = tok.encode(PROMPT, add_special_tokens=False)
        if tok.add_bos_token and tok.bos_token_id is not None:
            ids = [tok.bos_token_id] + ids  # what the server does for a text prompt
        prompts = client_prompts(ids, tok, args.clients)
        lat, compute = engine_latency(loaded.engine, ids, args.n, args.warmup, not args.no_cache_prompt)
        rounds = [engine_round(loaded.engine, prompts, args.tokens, f"tp{r}", not args.no_cache_prompt)
                  for r in range(args.rounds + 1)][1:]
        for n, _ in rounds:
            if n != args.clients * args.tokens:
                raise SystemExit(f"engine round produced {n} tokens, expected {args.clients * args.tokens}")
    finally:
        loaded.engine.shutdown()
    return {"latency": summary_ms(lat), "compute": summary_ms(compute), "beyond_compute": beyond(lat, compute),
            "throughput": tok_s(rounds)}, ids, prompts


def run_http(args: argparse.Namespace, ids: list[int], prompts: list[list[int]]) -> dict[str, Any]:
    port = args.port or free_port()
    log = Path(args.server_log)
    t0 = time.monotonic()
    proc = start_server(port, args.start_deadline, log)
    startup_s = time.monotonic() - t0
    base_url = f"http://127.0.0.1:{port}"
    try:
        lean = LeanClient("127.0.0.1", port)
        try:
            health = http_health(partial(lean_call, lean, "GET"), args.n, args.warmup)
            lat, compute = http_latency(partial(lean_call, lean, "POST"), ids, args.n, args.warmup,
                                        not args.no_cache_prompt)
        finally:
            lean.close()
        with httpx.Client(base_url=base_url, timeout=60.0) as client:
            health_httpx = http_health(partial(httpx_call, client, "GET"), args.n, args.warmup)
            lat_httpx, _ = http_latency(partial(httpx_call, client, "POST"), ids, args.n, args.warmup,
                                        not args.no_cache_prompt)
        rounds = asyncio.run(http_rounds(base_url, prompts, args.tokens, args.rounds + 1,
                                         not args.no_cache_prompt))[1:]
        for n, _ in rounds:
            if n != args.clients * args.tokens:
                raise SystemExit(f"HTTP round produced {n} tokens, expected {args.clients * args.tokens}")
    finally:
        stop_server(proc)
    return {"latency": summary_ms(lat), "compute": summary_ms(compute), "beyond_compute": beyond(lat, compute),
            "health": summary_ms(health),
            "latency_httpx": summary_ms(lat_httpx), "health_httpx": summary_ms(health_httpx),
            "throughput": tok_s(rounds),
            "server_startup_s": startup_s}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=200, help="timed sequential 1-token requests per side")
    ap.add_argument("--warmup", type=int, default=20, help="untimed requests before them")
    ap.add_argument("--clients", type=int, default=MAX_CONCURRENCY, help="concurrent streams")
    ap.add_argument("--tokens", type=int, default=64, help="output tokens per stream (ignore_eos)")
    ap.add_argument("--rounds", type=int, default=3, help="timed throughput rounds (after one warm-up round)")
    ap.add_argument("--no-cache-prompt", action="store_true", help="send cache_prompt false on both sides")
    ap.add_argument("--port", type=int, default=0, help="server port (default: a free one)")
    ap.add_argument("--start-deadline", type=float, default=180.0, help="seconds for the server to become healthy")
    ap.add_argument("--server-log", default="/tmp/ninfer-bench-http-server.log")
    ap.add_argument("--json", type=Path, help="also write the results here")
    args = ap.parse_args()

    load_before = os.getloadavg()[0]  # the machine may be shared: record how busy it was
    engine, ids, prompts = run_engine(args)
    http = run_http(args, ids, prompts)
    el, hl, hx = engine["latency"], http["latency"], http["latency_httpx"]
    eb, hb = engine["beyond_compute"], http["beyond_compute"]
    et, ht = engine["throughput"], http["throughput"]
    result = {
        "config": {"n": args.n, "warmup": args.warmup, "clients": args.clients, "tokens": args.tokens,
                   "rounds": args.rounds, "cache_prompt": not args.no_cache_prompt, "prompt_tokens": len(ids),
                   "max_concurrency": MAX_CONCURRENCY, "cpu_count": os.cpu_count(),
                   "loadavg_1m_before": load_before, "loadavg_1m_after": os.getloadavg()[0]},
        "engine": engine, "http": http,
        "overhead_ms": {"p50": hl["p50_ms"] - el["p50_ms"], "p99": hl["p99_ms"] - el["p99_ms"]},
        "overhead_net_of_compute_ms": {"p50": hb["p50_ms"] - eb["p50_ms"], "p99": hb["p99_ms"] - eb["p99_ms"]},
        "overhead_httpx_ms": {"p50": hx["p50_ms"] - el["p50_ms"], "p99": hx["p99_ms"] - el["p99_ms"]},
        "throughput_ratio_pct": 100 * ht["median_tok_s"] / et["median_tok_s"],
    }

    def row(name: str, s: dict[str, float], minus: dict[str, float] | None = None) -> None:
        d = {k: s[k] - (minus[k] if minus else 0.0) for k in ("p50_ms", "p99_ms", "mean_ms")}
        print(f"  {name:26} {d['p50_ms']:8.2f} {d['p99_ms']:8.2f} {d['mean_ms']:8.2f}")

    print(f"1-token completion, {args.n} sequential requests ({len(ids)}-token prompt, "
          f"cache_prompt={not args.no_cache_prompt}):")
    print(f"  {'':26} {'p50 ms':>8} {'p99 ms':>8} {'mean ms':>8}")
    row("engine-direct", el)
    row("HTTP /v1/completions", hl)
    row("HTTP - engine", hl, el)
    row("  same through httpx", hx)
    row("  httpx - engine", hx, el)
    row("engine compute, direct", engine["compute"])
    row("engine compute, in server", http["compute"])
    row("HTTP - engine, net of it", hb, eb)
    row("HTTP GET /health (floor)", http["health"])
    row("  same through httpx", http["health_httpx"])
    print(f"{args.clients} concurrent streams x {args.tokens} tokens, {args.rounds} rounds:")
    print(f"  {'':26} {'median':>8} {'best':>8}   rounds (tok/s)")
    for name, t in (("engine-direct", et), ("HTTP stream", ht)):
        rounds_s = ", ".join(f"{r:.1f}" for r in t["rounds_tok_s"])
        print(f"  {name:26} {t['median_tok_s']:8.1f} {t['best_tok_s']:8.1f}   {rounds_s}")
    print(f"  HTTP / engine (median): {result['throughput_ratio_pct']:.1f} %")
    print(f"1-minute load average: {load_before:.2f} before, {os.getloadavg()[0]:.2f} after ({os.cpu_count()} CPUs)")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
