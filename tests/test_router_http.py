"""`ninfer serve --models-preset` as a real process: a router over the default model under two
names with different presets (and one broken entry), driven with the official openai client and
raw HTTP. Each model answers by its name with its own options, /models and /models/sse show the
lifecycle, --models-max 1 swaps them, and a request in flight is never cut by a swap."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

openai = pytest.importorskip("openai")

from test_server_http import free_port  # noqa: E402

PROMPT = [{"role": "user", "content": "Write a long story about a lighthouse keeper."}]


@dataclass
class Router:
    url: str
    proc: subprocess.Popen
    log: Path
    request_log: Path


def _wait(predicate, what: str, timeout: float = 120.0):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def router(smollm2_artifact: Path, tmp_path_factory: pytest.TempPathFactory) -> Router:
    tmp = tmp_path_factory.mktemp("router")
    (tmp / "broken.ninfer").write_bytes(b"not a model")
    preset = tmp / "models.ini"
    preset.write_text(f"""
; the default model under two names with different presets
[*]
max-context = 2048

[alpha]
model = {smollm2_artifact}
alias = a, first
greedy = true
# loaded before the first request
load-on-startup = true

[beta]
model = {smollm2_artifact}
default-max-tokens = 3
max-concurrency = 2

[broken]
model = {tmp / "broken.ninfer"}
""")
    port = free_port()
    log = tmp / "serve.log"
    cmd = [sys.executable, "-m", "ninfer.cli.main", "serve", "--models-preset", str(preset), "--models-max", "1",
           "--port", str(port), "--log-stats-interval-ms", "0", "--request-log-jsonl", str(tmp / "requests.jsonl")]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait(lambda: proc.poll() is not None or "serving" in log.read_text(), "the router to start", 240)
        assert proc.poll() is None, log.read_text()
    except BaseException:
        proc.kill()
        raise
    yield Router(url, proc, log, tmp / "requests.jsonl")
    feed = httpx.Client(timeout=60)  # an open /models/sse stream ends with the server, never holds its stop
    with feed.stream("GET", url + "/models/sse") as r:
        assert r.status_code == 200
        proc.send_signal(signal.SIGTERM)
        list(r.iter_lines())
    assert proc.wait(timeout=60) == 0, log.read_text()
    assert "server stopped" in log.read_text()


def client(router: Router) -> openai.OpenAI:
    return openai.OpenAI(base_url=router.url + "/v1", api_key="none", max_retries=0, timeout=300)


def models(router: Router) -> dict[str, dict]:
    return {m["id"]: m for m in httpx.get(router.url + "/models").json()["data"]}


def status(router: Router, name: str) -> str:
    return models(router)[name]["status"]["value"]


def test_catalog_lists_every_model_with_its_arguments_and_aliases(router: Router) -> None:
    listed = models(router)
    assert list(listed) == ["alpha", "beta", "broken"]
    assert listed["alpha"]["status"]["value"] == "loaded"  # load-on-startup
    assert listed["alpha"]["aliases"] == ["a", "first"]
    assert listed["alpha"]["max_model_len"] == 2048  # a loaded model adds its /v1/models fields
    assert listed["beta"]["status"] == {"value": "unloaded", "args": ["--max-context", "2048", "--default-max-tokens",
                                                                      "3", "--max-concurrency", "2"]}
    assert "max_model_len" not in listed["beta"]
    v1 = client(router).models.list()
    assert [m.id for m in v1.data] == ["alpha", "beta", "broken"]


def test_each_model_answers_by_its_name_with_its_own_preset(router: Router) -> None:
    c = client(router)
    # alpha: --greedy, so two sampled requests agree token for token; reached through an alias
    one = c.chat.completions.create(model="first", messages=PROMPT, max_tokens=8, temperature=1.5, seed=1)
    two = c.chat.completions.create(model="a", messages=PROMPT, max_tokens=8, temperature=1.5, seed=2)
    assert one.model == two.model == "alpha"
    assert one.choices[0].message.content == two.choices[0].message.content
    # beta: --default-max-tokens 3 applies to a request that names no limit
    r = c.chat.completions.create(model="beta", messages=PROMPT)
    assert r.model == "beta" and r.usage.completion_tokens == 3 and r.choices[0].finish_reason == "length"
    listed = models(router)  # --models-max 1: beta took alpha's place
    assert listed["beta"]["status"]["value"] == "loaded" and listed["alpha"]["status"]["value"] == "unloaded"
    # a request that names no model gets the most recently used one
    r = httpx.post(router.url + "/v1/chat/completions", json={"messages": PROMPT}, timeout=120).json()
    assert r["model"] == "beta" and r["usage"]["completion_tokens"] == 3


def test_unknown_model_is_404_and_autoload_off_is_503(router: Router) -> None:
    c = client(router)
    with pytest.raises(openai.NotFoundError) as e:
        c.chat.completions.create(model="gamma", messages=PROMPT, max_tokens=2)
    assert e.value.body["code"] == "model_not_found"
    r = httpx.get(router.url + "/props", params={"model": "gamma"})
    assert r.status_code == 404
    idle = "alpha" if status(router, "beta") == "loaded" else "beta"
    with pytest.raises(openai.APIStatusError) as e:
        c.chat.completions.create(model=idle, messages=PROMPT, max_tokens=2, extra_query={"autoload": "0"})
    assert e.value.status_code == 503 and e.value.body["code"] == "model_not_loaded"
    r = httpx.get(router.url + "/props", params={"model": idle})  # read-only routes never load
    assert r.status_code == 503 and r.json()["error"]["code"] == "model_not_loaded"
    assert status(router, idle) == "unloaded"


def test_a_failed_load_is_503_and_reported_then_the_others_serve_on(router: Router) -> None:
    c = client(router)
    with pytest.raises(openai.APIStatusError) as e:
        c.chat.completions.create(model="broken", messages=PROMPT, max_tokens=2)
    assert e.value.status_code == 503 and e.value.body["code"] == "model_load_failed"
    entry = models(router)["broken"]
    assert entry["status"]["value"] == "unloaded" and entry["status"]["failed"] is True
    assert "broken.ninfer" in entry["status"]["error"]
    r = c.chat.completions.create(model="beta", messages=PROMPT, max_tokens=2)
    assert r.model == "beta"


def test_load_unload_routes_and_the_status_feed(router: Router) -> None:
    events: list[dict] = []

    def listen() -> None:
        with httpx.stream("GET", router.url + "/models/sse", timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(json.loads(line[6:]))
                    if len(events) >= 4:
                        return

    listener = threading.Thread(target=listen, daemon=True)
    listener.start()
    time.sleep(0.5)  # the subscription is in place before the changes
    loaded = "alpha" if status(router, "alpha") == "loaded" else "beta"
    other = "beta" if loaded == "alpha" else "alpha"
    r = httpx.post(router.url + "/models/unload", json={"model": loaded}, timeout=120)
    assert r.status_code == 200 and r.json()["status"] == "unloaded"
    r = httpx.post(router.url + "/models/load", json={"model": other}, timeout=120)
    assert r.status_code == 200 and r.json()["status"] == "loaded"
    listener.join(30)
    assert [(e["model"], e["data"]["status"]) for e in events] == [
        (loaded, "unloading"), (loaded, "unloaded"), (other, "loading"), (other, "loaded")]
    assert all(e["event"] == "model_status" for e in events)
    r = httpx.post(router.url + "/models/load", json={"model": "gamma"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = httpx.post(router.url + "/models/sleep", json={"model": other})
    assert r.status_code == 400 and r.json()["error"]["code"] == "model_suspend_disabled"  # no --model-suspend


def test_a_swap_never_cuts_a_request_in_flight(router: Router) -> None:
    """--models-max 1: a request for beta while a stream runs on alpha waits for the stream to end,
    then beta takes the room; the stream gets every token it asked for."""
    c = client(router)
    httpx.post(router.url + "/models/load", json={"model": "alpha"}, timeout=120)
    stream = c.chat.completions.create(model="alpha", messages=PROMPT, max_tokens=48, stream=True,
                                       stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    pieces: list[str] = []
    first = next(iter(stream))  # the stream is running on alpha
    pieces.append(first.choices[0].delta.content or "" if first.choices else "")
    other: dict = {}

    def ask_beta() -> None:
        other["r"] = c.chat.completions.create(model="beta", messages=PROMPT, max_tokens=2)
        other["at"] = time.monotonic()

    asker = threading.Thread(target=ask_beta)
    asker.start()
    usage = None
    for chunk in stream:
        if chunk.choices:
            pieces.append(chunk.choices[0].delta.content or "")
        if chunk.usage is not None:
            usage = chunk.usage
    ended = time.monotonic()
    asker.join(120)
    assert usage is not None and usage.completion_tokens == 48  # not cut
    assert other["r"].model == "beta" and other["at"] >= ended
    assert status(router, "beta") == "loaded" and status(router, "alpha") == "unloaded"


def test_request_log_names_each_model_and_its_resolved_budget(router: Router) -> None:
    c = client(router)
    seen = len(router.request_log.read_text().splitlines())
    c.chat.completions.create(model="beta", messages=PROMPT)  # beta's --default-max-tokens 3
    records = [json.loads(line) for line in router.request_log.read_text().splitlines()]
    starts = [r for r in records if r["event"] == "server_start"]
    assert {r["model"] for r in starts} >= {"alpha", "beta"}  # one per load
    new = records[seen:]
    start = next(r for r in new if r["event"] == "request_start")
    done = next(r for r in new if r["event"] == "request_done")
    assert start["model"] == done["model"] == "beta"
    assert start["requested_output_tokens"] == 3 and start["requested_max_tokens"] is None
    assert done["prefix_reuse_path"] in ("root", "private_endpoint", "shared_stable_prefix")
    assert done["timings_seconds"]["total"] >= done["timings_seconds"]["decode"] >= 0
    assert done["engine_timing"]["queue_wait_seconds"] >= 0
    assert "lighthouse" not in router.request_log.read_text()
