"""Fuzz every route of a running `ninfer serve` with mutated and hand-written hostile bodies.

  python scripts/fuzz.py --url http://127.0.0.1:8080 --api-key KEY --n 5000 --out /tmp/fuzz

Each case mutates a valid seed body of one route (fields dropped, retyped, pushed to extreme
numbers, huge or control-character strings, deep nesting, unknown fields), or sends a hostile body
as it is (invalid JSON, wrong top-level types, NaN, 1e999, lone surrogates, 100k-deep arrays), or
a GET with a random query. Reports a status histogram (all and per route), every 5xx the spec
does not prescribe (request and body saved under --out; the prescribed ones, such as 503
model_not_loaded after a fuzzed unload, are counted by code), error responses outside the
protocol's envelope, requests never answered, and /health after
each batch. Exit status 1 when any of those is non-zero. On a CPU, serve with a small context and
default output limit (--max-context 128 --default-max-tokens 8) and pass --cap-output 8, so that
mutated generations stay short.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from reliability_common import GET_ROUTES, envelope_problem, seed_bodies, served_model  # noqa: E402

EXTREMES: list[Any] = [None, True, False, 0, -1, 1, 2**31, -2**31, 2**63, -2**63 - 1, 2**64, 10**30, 1e308, -1e308,
                       0.5, -0.0, 1e-320, "", "x", "0", "-1", "true", "null", [], {}, [None], {"": None},
                       "\u0000", "\ud800", "A" * 70_000, "\u202e" * 50, "<|im_start|>", [[[[]]]], "\n" * 1000]

HOSTILE: list[bytes] = [
    b"", b" ", b"{", b"}", b"[]", b"null", b"0", b'"str"', b"{'single': 1}", b'{"a":1,}', b"\x00" * 64,
    b"\xff\xfe\xfd", b'{"messages": NaN}', b'{"max_tokens": Infinity}', b'{"temperature": 1e999}',
    b'{"max_tokens": 1' + b"0" * 500 + b"}", b'{"a":"\\ud800"}', b'{"a":"\\u0000"}',
    b"[" * 100_000 + b"]" * 100_000, b'{"a":' * 5000 + b"1" + b"}" * 5000,
    b'{"messages": [' + b'{"role":"user","content":"x"},' * 20_000 + b'{"role":"user","content":"x"}]}',
    json.dumps({"prompt": list(range(100_000))}).encode(), b'{"prompt": [-1]}', b'{"prompt": [1e20]}',
    b'{"tokens": [99999999999]}', b'{"tokens": [-5]}', b'{"content": 5}',
    b'{"model":"x","messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"file:///etc/passwd"}}]}]}',
    b'{"model":"x","max_tokens":4,"messages":[{"role":"user","content":[{"type":"image","source":{}}]}]}',
    # objects and arrays where a name is looked up (an unhashable key)
    b'{"model":"x","input":[{"type":{},"role":"user","content":""}]}', b'{"input":[{"type":[]}]}',
    b'{"model":"x","max_tokens":4,"messages":[{"role":{},"content":"x"}]}',
    b'{"model":"x","max_tokens":4,"messages":[{"role":"user","content":[{"type":{},"text":"x"}]}]}',
    b'{"messages":[{"role":"user","content":"x"}],"tool_choice":{"type":{}},"reasoning_effort":{}}',
    b'{"input":"x","pooling":{},"encoding_format":[]}',
]


def mutate(body: Any, rng: random.Random, depth: int = 0) -> Any:
    """One random mutation somewhere in a JSON value."""
    if isinstance(body, dict) and body and rng.random() < 0.8:
        body = dict(body)
        key = rng.choice(list(body))
        roll = rng.random()
        if roll < 0.2:
            del body[key]
        elif roll < 0.35:
            body[rng.choice(["unknown_field", "__proto__", "n", "logit_bias", "tools", "stream", "grammar",
                             "response_format", "stop", "seed", "id_slot"])] = rng.choice(EXTREMES)
        elif roll < 0.7 or depth > 3:
            body[key] = rng.choice(EXTREMES)
        else:
            body[key] = mutate(body[key], rng, depth + 1)
        return body
    if isinstance(body, list) and body and rng.random() < 0.8:
        body = list(body)
        i = rng.randrange(len(body))
        roll = rng.random()
        if roll < 0.2:
            del body[i]
        elif roll < 0.4:
            body.insert(i, rng.choice(EXTREMES))
        elif roll < 0.5:
            body = body * rng.randint(2, 50)
        else:
            body[i] = mutate(body[i], rng, depth + 1)
        return body
    return rng.choice(EXTREMES)


def route_key(path: str) -> str:
    """The route a request path names, for the per-route histogram ({id} for any model name)."""
    path = path.split("?")[0]
    if path.startswith("/slots/"):
        return "/slots/{id}"
    m = re.match(r"^/v1/models/[^/]+(/(suspend|resume|residency))?$", path)
    return "/v1/models/{id}" + (m.group(1) or "") if m else path[:80]


# The 5xx answers the spec gives to a request that is itself fine, keyed by status and error code:
# a model not loaded (a fuzzed /models/unload before a sleep, suspend or resume of it), the queue
# timeout (504 on Messages) and Messages' overload. Every other 5xx is a server error.
SPEC_5XX = {(503, "model_not_loaded"), (503, "request_queue_timeout"), (504, "timeout_error"),
            (529, "overloaded_error"), (501, "slot_persistence_disabled")}


def spec_5xx_code(path: str, status: int, body: bytes) -> str | None:
    """The error code of a 5xx the spec prescribes (None: a server error)."""
    try:
        err = json.loads(body)["error"]
        code = err.get("type") if path.split("?")[0].startswith("/v1/messages") else err.get("code")
    except (ValueError, KeyError, TypeError, AttributeError):
        return None
    return code if (status, code) in SPEC_5XX else None


OUTPUT_FIELDS = ("max_tokens", "max_completion_tokens", "n_predict", "max_output_tokens")


def cases(n: int, model: str, seed: int, cap_output: int | None = None) -> list[tuple[str, str, bytes | None, dict[str, str]]]:
    """(method, path, body, extra headers) for n cases: hostile bodies, then mutations. cap_output
    (for runs on a CPU): an output limit above it is lowered to it, so no mutated request generates
    more; missing, negative and mistyped limits are sent as mutated."""
    rng = random.Random(seed)
    seeds = seed_bodies(model)
    routes = list(seeds)
    out: list[tuple[str, str, bytes | None, dict[str, str]]] = []
    hostile = [("POST", path.replace("{model}", model), raw, {}) for raw in HOSTILE for path in routes]
    rng.shuffle(hostile)  # at most a quarter of a run (all of them in a 5,000-case run), mutations the rest
    out += hostile[:max(1, n // 4)]
    names = [model, model, model, "nope", "%00", "a" * 300]
    while len(out) < n:
        roll = rng.random()
        if roll < 0.08:
            path = rng.choice(GET_ROUTES).replace("{model}", rng.choice(names))
            query = rng.choice(["", "?limit=0", "?limit=-1", "?limit=x", "?order=sideways", "?after=" + "z" * 500,
                                "?model=" + model, "?model=nope", "?autoload=2", "?autoload=0"])
            out.append((rng.choice(["GET", "GET", "HEAD", "DELETE", "PUT"]), path + query, None, {}))
            continue
        template = rng.choice(routes)
        path = template.replace("{model}", rng.choice(names))
        if rng.random() < 0.03:
            path += ("&" if "?" in path else "?") + rng.choice(["autoload=2", "autoload=0", "model=nope", "q" * 3000,
                                                               "action=nope"])
        body = seeds[template]
        for _ in range(rng.randint(1, 3)):
            body = mutate(body, rng)
        if isinstance(body, dict) and rng.random() < 0.3:
            body["stream"] = True
        if cap_output is not None and isinstance(body, dict):
            for key in OUTPUT_FIELDS:  # a valid limit above the cap is lowered; invalid ones stay
                value = body.get(key)
                if isinstance(value, int) and not isinstance(value, bool) and value > cap_output:
                    body[key] = cap_output
        headers = {}
        if rng.random() < 0.05:
            headers["content-type"] = rng.choice(["text/plain", "application/x-www-form-urlencoded", "garbage"])
        try:
            raw = json.dumps(body, allow_nan=rng.random() < 0.1).encode("utf-8", "surrogatepass")
        except (ValueError, TypeError):
            raw = b"{}"
        out.append(("POST", path, raw, headers))
    rng.shuffle(out)
    return out[:n]


async def run(url: str, api_key: str | None, n: int, seed: int, out_dir: Path | None, concurrency: int,
              batch: int = 250, timeout: float = 300.0, cap_output: int | None = None) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    with httpx.Client(base_url=url, headers=headers, timeout=30) as sync:
        model = served_model(sync)
    todo = cases(n, model, seed, cap_output)
    statuses: Counter[int] = Counter()
    by_route: dict[str, Counter[int]] = {}
    server_errors: list[dict[str, Any]] = []
    spec_5xx: Counter[str] = Counter()
    malformed: list[dict[str, Any]] = []
    unanswered: list[dict[str, Any]] = []
    health_failures = 0
    sem = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=timeout, limits=limits) as client:

        async def one(method: str, path: str, body: bytes | None, extra: dict[str, str]) -> None:
            async with sem:
                try:
                    request = client.build_request(method, path, content=body,
                                                   headers={"content-type": "application/json", **extra})
                    r = await client.send(request, stream=True)
                    try:  # an event stream that stays open (/models/sse) is judged by its head
                        if not (r.status_code == 200 and r.headers.get("content-type", "").startswith(
                                "text/event-stream") and path.split("?")[0] == "/models/sse"):
                            await r.aread()
                    finally:
                        await r.aclose()
                except httpx.HTTPError as e:
                    unanswered.append({"method": method, "path": path, "error": f"{type(e).__name__}: {e}",
                                       "body": (body or b"")[:2000].decode("utf-8", "replace")})
                    return
                statuses[r.status_code] += 1
                by_route.setdefault(f"{method} {route_key(path)}", Counter())[r.status_code] += 1
                content = r.content if r.is_stream_consumed else b""
                record = {"method": method, "path": path, "status": r.status_code,
                          "request": (body or b"")[:4000].decode("utf-8", "replace"),
                          "response": content[:4000].decode("utf-8", "replace")}
                if r.status_code >= 500:
                    if method == "HEAD":  # no body to read the code from: the same GET tells it
                        again = await client.get(path)
                        content = again.content if again.status_code == r.status_code else b""
                    code = spec_5xx_code(path, r.status_code, content)
                    if code is None:
                        server_errors.append(record)
                    else:
                        spec_5xx[f"{r.status_code} {code}"] += 1
                problem = envelope_problem(path.split("?")[0], r.status_code, content,
                                           r.headers.get("content-type", ""))
                if problem and method != "HEAD":
                    malformed.append({**record, "problem": problem})

        for start in range(0, len(todo), batch):
            await asyncio.gather(*(one(*c) for c in todo[start:start + batch]))
            h = await client.get("/health")
            if h.status_code != 200:
                health_failures += 1
    report = {"cases": len(todo), "seed": seed, "statuses": dict(sorted(statuses.items())),
              "server_errors": len(server_errors), "spec_5xx": dict(spec_5xx),
              "malformed_envelopes": len(malformed),
              "unanswered": len(unanswered), "health_failures": health_failures,
              "by_route": {k: dict(sorted(v.items())) for k, v in sorted(by_route.items())}}
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        for name, items in (("server_errors", server_errors), ("malformed", malformed), ("unanswered", unanswered)):
            if items:
                (out_dir / f"{name}.json").write_text(json.dumps(items, indent=1))
        (out_dir / "report.json").write_text(json.dumps(report, indent=1))
    report["examples"] = (server_errors + malformed + unanswered)[:3]
    return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default="http://127.0.0.1:8080")
    ap.add_argument("--api-key")
    ap.add_argument("--n", type=int, default=5000)
    ap.add_argument("--seed", type=int, default=int(time.time()))
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--cap-output", type=int, help="lower output limits above this many tokens to it")
    args = ap.parse_args(argv)
    t0 = time.monotonic()
    report = asyncio.run(run(args.url, args.api_key, args.n, args.seed, args.out, args.concurrency,
                             cap_output=args.cap_output))
    report["seconds"] = round(time.monotonic() - t0, 1)
    print(json.dumps(report, indent=1))
    bad = report["server_errors"] + report["malformed_envelopes"] + report["unanswered"] + report["health_failures"]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
