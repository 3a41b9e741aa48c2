"""`ninfer serve` as a real process on the default model, driven with the official openai client
and raw HTTP: chat, completions, llama.cpp endpoints, ops endpoints, auth, CORS and errors."""
from __future__ import annotations

import asyncio
import json
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

openai = pytest.importorskip("openai")

KEY = "test-secret"
MODEL = "smol-test"
AUTH = {"Authorization": f"Bearer {KEY}"}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 4, "temperature": 0}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_health(proc: subprocess.Popen, url: str, log: Path, timeout_s: float = 240) -> None:
    """Until `url`/health answers 200; fails with the server's log if it exits or never gets there."""
    deadline = time.monotonic() + timeout_s
    with httpx.Client(timeout=5) as client:
        while True:
            assert proc.poll() is None, f"serve exited early:\n{log.read_text()}"
            assert time.monotonic() < deadline, f"serve never became ready:\n{log.read_text()}"
            try:
                if client.get(f"{url}/health").status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.05)


@dataclass
class Server:
    url: str
    port: int
    stats_url: str
    proc: subprocess.Popen
    log: Path
    loading: list[httpx.Response]  # answers seen before the model was ready
    request_log: Path  # --request-log-jsonl


def _serve_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "ninfer.cli.main", "serve", *args]


@pytest.fixture(scope="module")
def server(smollm2_artifact: Path, tmp_path_factory: pytest.TempPathFactory) -> Server:
    port, stats_port = free_port(), free_port()
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    request_log = log.parent / "requests.jsonl"
    cmd = _serve_cmd(str(smollm2_artifact), "--port", str(port), "--api-key", KEY, "--model-id", MODEL,
                     "--cors", "--max-request-mib", "1", "--max-pending-requests", "2",
                     "--pending-timeout-ms", "6000", "--stats-port", str(stats_port), "--structured-output",
                     "--request-log-jsonl", str(request_log), "--log-stats-interval-ms", "300")
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    loading: list[httpx.Response] = []
    deadline = time.monotonic() + 240
    try:
        with httpx.Client(timeout=5) as client:
            while True:
                assert proc.poll() is None, f"serve exited early:\n{log.read_text()}"
                assert time.monotonic() < deadline, f"serve never became ready:\n{log.read_text()}"
                try:
                    r = client.get(f"{url}/health")
                except httpx.TransportError:
                    time.sleep(0.02)
                    continue
                if r.status_code == 200:
                    break
                loading.append(r)
                for extra in (client.post(f"{url}/v1/messages", json={}), client.options(f"{url}/v1/models")):
                    if extra.status_code == 503:
                        loading.append(extra)
    except BaseException:
        proc.kill()  # a failed start-up must not leave the server running
        raise
    yield Server(url, port, f"http://127.0.0.1:{stats_port}", proc, log, loading, request_log)
    proc.send_signal(signal.SIGINT)  # Ctrl+C twice stops the server
    time.sleep(0.3)
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=60) == 0, log.read_text()
    assert "server stopped" in log.read_text()


def client(server: Server, **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, **kw)


# ---- start-up --------------------------------------------------------------------------------

def test_loading_answers_503_model_loading(server: Server) -> None:
    assert server.loading, "no answer was seen while the model loaded"
    for r in server.loading:
        assert r.status_code == 503
        assert r.headers["retry-after"] == "2"
        assert r.headers["x-ninfer-version"]
        body = r.json()
        if r.request.url.path == "/v1/messages":
            assert body["type"] == "error" and body["error"]["type"] == "api_error"
            assert body["request_id"] == r.headers["request-id"]
        else:
            assert body["error"]["code"] == "model_loading"
            assert body["error"]["type"] == "service_unavailable"
            assert r.headers["x-request-id"]
    text = server.log.read_text()
    assert f"API base: http://127.0.0.1:{server.port}/v1" in text


def test_one_ctrl_c_only_asks_for_a_second(server: Server) -> None:
    server.proc.send_signal(signal.SIGINT)
    time.sleep(0.5)
    assert _get(server, "/health").status_code == 200
    assert "Press Ctrl+C again within 5 s to close" in server.log.read_text()
    time.sleep(5.0)  # the window closes: the next press asks again instead of stopping
    server.proc.send_signal(signal.SIGINT)
    time.sleep(0.5)
    assert server.proc.poll() is None and _get(server, "/health").status_code == 200
    assert server.log.read_text().count("Press Ctrl+C again") == 2
    time.sleep(5.0)


def test_port_clash_fails_fast_with_the_port_named(server: Server) -> None:
    r = subprocess.run(_serve_cmd("--port", str(server.port)), capture_output=True, text=True, timeout=120)
    assert r.returncode == 1
    assert f"--port {server.port}" in r.stderr and "in use" in r.stderr


@pytest.mark.parametrize("args, option", [
    (["--max-concurrency", "9"], "--max-concurrency"), (["--top-p", "1.5"], "--top-p"),
    (["--kv-capacity", "lots"], "--kv-capacity"), (["--log-level", "loud"], "--log-level"),
    (["--dtype", "float16"], "--dtype"), (["--log-stats-interval-ms", "-1"], "--log-stats-interval-ms"),
    (["--request-log-jsonl", "/nonexistent-folder/requests.jsonl"], "--request-log-jsonl"),
])
def test_invalid_option_fails_at_start_up(args: list[str], option: str) -> None:
    r = subprocess.run(_serve_cmd("--port", str(free_port()), *args), capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and option in r.stderr, r.stderr


# ---- OpenAI clients --------------------------------------------------------------------------

def test_chat_sync_and_stream_agree(server: Server) -> None:
    c = client(server)
    # Warm the prefix cache first so the two compared requests take the same path (a prefix hit
    # recomputes only the last prompt token, whose bf16 CPU arithmetic may differ at a near-tie).
    c.chat.completions.create(**CHAT)
    raw = c.chat.completions.with_raw_response.create(**CHAT)
    assert raw.headers["x-request-id"] and raw.headers["x-ninfer-version"]
    resp = raw.parse()
    assert resp.model == MODEL and resp.object == "chat.completion"
    choice = resp.choices[0]
    assert choice.finish_reason == "length" and choice.message.role == "assistant"
    assert choice.message.content and choice.logprobs is None
    assert resp.usage.completion_tokens == 4
    assert resp.usage.prompt_tokens_details.cached_tokens >= 0
    extra = resp.model_extra
    assert extra["timings"]["predicted_n"] == 4
    assert extra["timings"]["cache_n"] + extra["timings"]["prompt_n"] == resp.usage.prompt_tokens
    assert len(extra["session_digest"]) == 16

    chunks = list(c.chat.completions.create(**CHAT, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == choice.message.content  # greedy: same text either way
    finish = [ch for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert [f.choices[0].finish_reason for f in finish] == ["length"]
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == 4
    assert last.usage.prompt_tokens_details.cached_tokens > 0  # the same prompt again reuses its prefix
    assert "timings" in last.model_extra


def test_chat_logprobs(server: Server) -> None:
    resp = client(server).chat.completions.create(**CHAT, logprobs=True, top_logprobs=2)
    content = resp.choices[0].logprobs.content
    assert len(content) == resp.usage.completion_tokens == 4
    assert "".join(r.token for r in content) == resp.choices[0].message.content
    for r in content:
        assert r.logprob <= 0 and len(r.top_logprobs) == 2 and bytes(r.bytes).decode() == r.token
        assert r.top_logprobs[0].logprob >= r.top_logprobs[1].logprob


def test_async_chat_and_completions_stream(server: Server) -> None:
    async def go() -> tuple[str, str, str]:
        ac = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
        chat = await ac.chat.completions.create(**CHAT)
        stream = await ac.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=4,
                                             temperature=0, stream=True)
        streamed = "".join([ch.choices[0].text async for ch in stream if ch.choices])
        whole = await ac.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=4,
                                            temperature=0)
        await ac.close()
        return chat.choices[0].message.content, streamed, whole.choices[0].text

    chat_text, streamed, whole = asyncio.run(go())
    assert chat_text
    assert streamed == whole and whole


def test_completions_echo_and_usage_stream(server: Server) -> None:
    c = client(server)
    prompt = "The capital of France is"
    resp = c.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0, echo=True)
    assert resp.object == "text_completion" and resp.choices[0].text.startswith(prompt)
    assert resp.usage.completion_tokens == 3 and resp.choices[0].finish_reason == "length"
    chunks = list(c.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0, echo=True,
                                       stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].text == prompt  # the echo opens the stream
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == resp.choices[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 3


def test_doubled_v1_base_and_models(server: Server) -> None:
    c = openai.OpenAI(base_url=server.url + "/v1/v1", api_key=KEY, max_retries=0)
    models = c.models.list().data
    assert [m.id for m in models] == [MODEL]
    m = models[0].model_extra
    assert m["max_model_len"] == m["context_window"] == m["context_length"] == 8192
    assert m["architecture"] == {"input_modalities": ["text"], "output_modalities": ["text"]}
    assert m["meta"]["n_vocab"] == 49152 and m["meta"]["n_ctx_train"] == 8192 and m["meta"]["n_params"] > 1e8
    assert c.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        c.models.retrieve("other-model")


def test_openai_errors_are_typed(server: Server) -> None:
    c = client(server)
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(**CHAT, n=2)
    assert e.value.body["code"] == "n_not_supported" and e.value.body["param"] == "n"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0).models.list()


# ---- raw HTTP: llama.cpp endpoints -------------------------------------------------------------

def _post(server: Server, path: str, body: object, **kw) -> httpx.Response:
    return httpx.post(server.url + path, json=body, headers=AUTH, timeout=120, **kw)


def test_llamacpp_completion(server: Server) -> None:
    body = {"prompt": "The capital of France is", "n_predict": 3, "temperature": 0, "return_tokens": True}
    r = _post(server, "/completion", body)
    assert r.status_code == 200
    obj = r.json()
    assert obj["stop"] is True and obj["stop_type"] == "limit" and obj["truncated"] is False
    assert len(obj["tokens"]) == obj["tokens_predicted"] == 3
    assert obj["tokens_evaluated"] > 0 and obj["prompt"] == "The capital of France is"
    assert obj["generation_settings"]["n_predict"] == 3 and "timings" in obj
    r = _post(server, "/completions", {**body, "response_fields": ["content", "generation_settings/n_predict"]})
    assert r.json() == {"content": obj["content"], "generation_settings/n_predict": 3}
    # a stop word the greedy continuation starts with
    first = httpx.post(server.url + "/detokenize", json={"tokens": obj["tokens"][:1]}, headers=AUTH).json()["content"]
    r = _post(server, "/completion", {**body, "stop": [first]})
    assert r.json()["stop_type"] == "word" and r.json()["stopping_word"] == first and r.json()["content"] == ""


def test_llamacpp_completion_stream(server: Server) -> None:
    body = {"prompt": "The capital of France is", "n_predict": 3, "temperature": 0, "stream": True}
    with httpx.stream("POST", server.url + "/completion", json=body, headers=AUTH, timeout=120) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    assert all(e["tokens"] == [] for e in events[:-1])  # llama-server's array, empty without return_tokens
    final = events[-1]
    assert final["stop"] is True and final["content"] == "" and len(final["tokens"]) == 3
    text = "".join(e["content"] for e in events[:-1])
    whole = _post(server, "/completion", {**body, "stream": False}).json()
    assert text == whole["content"]


def test_llamacpp_prompt_forms_and_refusals(server: Server) -> None:
    ids = _post(server, "/tokenize", {"content": "The capital of"}).json()["tokens"]
    mixed = _post(server, "/completion", {"prompt": [*ids, " France is"], "n_predict": 1, "temperature": 0})
    plain = _post(server, "/completion", {"prompt": "The capital of France is", "n_predict": 1, "temperature": 0})
    assert mixed.status_code == 200 and mixed.json()["content"] == plain.json()["content"]
    for body, code in [({"prompt": ["a", "b"]}, "multiple_prompts_not_supported"),
                       ({"prompt": [[1, 2], [3]]}, "multiple_prompts_not_supported"),
                       ({"prompt": [49152]}, "invalid_prompt"),
                       ({"prompt": "x", "repeat_penalty": 1.1}, "repeat_penalty_not_supported"),
                       ({"prompt": "x", "mirostat": 2}, "mirostat_not_supported"),
                       ({"prompt": "x", "grammar": "root ::= a"}, "invalid_grammar")]:
        r = _post(server, "/completion", body)
        assert r.status_code == 400 and r.json()["error"]["code"] == code, (body, r.text)
    r = _post(server, "/v1/completions", {"prompt": "x", "suffix": "y"})
    assert r.json()["error"]["code"] == "suffix_not_supported"
    ok = _post(server, "/completion", {"prompt": "x", "n_predict": 1, "repeat_penalty": 1.0, "n_probs": 0})
    assert ok.status_code == 200
    r = _post(server, "/completion", {"prompt": [1] * 8200, "n_predict": 1})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert r.json()["error"]["param"] == "prompt"


def test_tokenize_detokenize_apply_template(server: Server) -> None:
    r = _post(server, "/tokenize", {"content": "Hello world<|im_end|>", "with_pieces": True})
    pieces = r.json()["tokens"]
    assert pieces[-1] == {"id": 2, "piece": "<|im_end|>"}
    ids = [p["id"] for p in pieces]
    assert _post(server, "/detokenize", {"tokens": ids}).json() == {"content": "Hello world<|im_end|>"}
    assert _post(server, "/tokenize", {"content": "é"}).json()["tokens"]
    prompt = _post(server, "/apply-template", {"messages": [{"role": "user", "content": "Hi"}]}).json()["prompt"]
    assert prompt.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert _post(server, "/detokenize", {"tokens": [-1]}).status_code == 400


def test_tokenize_parse_special_false(server: Server) -> None:
    text = "Hello world<|im_end|>"
    special = _post(server, "/tokenize", {"content": text}).json()["tokens"]
    r = _post(server, "/tokenize", {"content": text, "parse_special": False})
    assert r.status_code == 200
    plain = r.json()["tokens"]
    assert special[-1] == 2 and 2 not in plain and len(plain) > len(special)
    assert plain[:len(special) - 1] == special[:-1]  # only the special-token text tokenizes differently
    assert _post(server, "/detokenize", {"tokens": plain}).json() == {"content": text}
    assert _post(server, "/tokenize", {"content": text, "parse_special": "no"}).json()["error"]["param"] == "parse_special"


def _sse(server: Server, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", server.url + path, json=body, headers=AUTH, timeout=120) as r:
        assert r.status_code == 200, r.read()
        return [json.loads(line[6:]) for line in r.iter_lines()
                if line.startswith("data: ") and line != "data: [DONE]"]


def _check_progress(progress: list[dict], with_timings: bool) -> None:
    """The spec's prompt-progress records: processed == cache first, == total last, never backwards."""
    records = [p["prompt_progress"] for p in progress]
    assert records[0]["processed"] == records[0]["cache"] and records[-1]["processed"] == records[-1]["total"]
    assert [r["processed"] for r in records] == sorted(r["processed"] for r in records)
    assert all(isinstance(r["time_ms"], int) for r in records)
    for p in progress:
        assert ("timings" in p) == with_timings
        if with_timings:
            t = p["timings"]
            assert t["predicted_n"] == 0 and t["predicted_ms"] == 0.0
            assert t["cache_n"] == p["prompt_progress"]["cache"]
            assert t["cache_n"] + t["prompt_n"] == p["prompt_progress"]["total"]


def test_chat_stream_return_progress_and_timings_per_token(server: Server) -> None:
    body = {**CHAT, "messages": [{"role": "user", "content": "Count from one to ten."}], "max_tokens": 5}
    chunks = list(client(server).chat.completions.create(
        **body, stream=True, extra_body={"return_progress": True, "timings_per_token": True, "ignore_eos": True}))
    extras = [ch.model_extra or {} for ch in chunks]
    progress_at = [i for i, e in enumerate(extras) if "prompt_progress" in e]
    content_at = [i for i, ch in enumerate(chunks) if ch.choices and ch.choices[0].delta.content]
    assert progress_at and content_at and progress_at[-1] < content_at[0]  # progress precedes the output
    assert chunks[0].choices[0].delta.role == "assistant" and progress_at[0] > 0
    assert all(chunks[i].choices == [] for i in progress_at)
    _check_progress([extras[i] for i in progress_at], with_timings=True)
    predicted = [extras[i]["timings"]["predicted_n"] for i in content_at]  # a snapshot on each visible chunk
    assert predicted == sorted(predicted) and predicted[0] >= 1
    final = extras[-1]
    assert chunks[-1].choices[0].finish_reason == "length" and final["timings"]["predicted_n"] == 5
    total = extras[progress_at[-1]]["prompt_progress"]["total"]
    assert final["timings"]["cache_n"] + final["timings"]["prompt_n"] == total
    assert final["id_slot"] in (0, 1) and len(final["session_digest"]) == 16

    chunks = list(client(server).chat.completions.create(**body, stream=True, extra_body={"return_progress": True}))
    extras = [ch.model_extra or {} for ch in chunks]
    _check_progress([e for e in extras if "prompt_progress" in e], with_timings=False)
    assert all("timings" not in e for e in extras[:-1]) and "timings" in extras[-1]  # terminal timings always


def test_completion_stream_return_progress_and_timings_per_token(server: Server) -> None:
    body = {"prompt": "The capital of France is", "n_predict": 3, "temperature": 0, "stream": True,
            "return_progress": True, "timings_per_token": True}
    events = _sse(server, "/completion", body)
    progress_at = [i for i, e in enumerate(events) if "prompt_progress" in e]
    content_at = [i for i, e in enumerate(events) if e.get("content")]
    assert progress_at and content_at and progress_at[-1] < content_at[0]
    _check_progress([events[i] for i in progress_at], with_timings=True)
    assert all("timings" in events[i] for i in content_at)
    assert events[-1]["stop"] is True and events[-1]["id_slot"] in (0, 1)


def _poll(fetch, ok, deadline_s: float = 30.0):
    end = time.monotonic() + deadline_s
    while True:
        value = fetch()
        if ok(value):
            return value
        assert time.monotonic() < end, f"not reached before the deadline: {value}"
        time.sleep(0.01)


def test_id_slot_reports_the_retained_slot(server: Server) -> None:
    from ninfer.server.generate import session_digest

    prompt = "Slots are cells of the context cache:"
    r = _post(server, "/completion", {"prompt": prompt, "n_predict": 3, "temperature": 0, "return_tokens": True,
                                      "ignore_eos": True, "id_slot": 1})
    assert r.status_code == 200
    obj = r.json()
    session = _post(server, "/tokenize", {"content": prompt}).json()["tokens"] + obj["tokens"]
    # the engine publishes the cell at the end of the step that retained it: poll /slots for it
    slots = _poll(lambda: _get(server, "/slots").json(),
                  lambda s: any(c["id"] == obj["id_slot"] and c["n_prompt_tokens"] == len(session) for c in s))
    cell = next(c for c in slots if c["id"] == obj["id_slot"])
    assert cell["session_digest"] == session_digest(session) and cell["retained"] is True
    # the last sampled token is not executed yet: the endpoint checkpoint is one short
    assert cell["checkpoints"] == [{"frontier": len(session) - 1, "session_digest": session_digest(session[:-1])}]

    resp = client(server).chat.completions.create(**{**CHAT, "max_tokens": 2}, extra_body={"id_slot": -1})
    extra = resp.model_extra
    slots = _poll(lambda: _get(server, "/slots").json(),
                  lambda s: any(c["session_digest"] == extra["session_digest"] for c in s))
    assert next(c for c in slots if c["session_digest"] == extra["session_digest"])["id"] == extra["id_slot"]

    for path, body in (("/v1/chat/completions", {**CHAT, "id_slot": 2}), ("/completion", {"prompt": "x", "id_slot": 9}),
                       ("/completion", {"prompt": "x", "id_slot": -2})):
        r = _post(server, path, body)
        assert r.status_code == 400 and r.json()["error"]["param"] == "id_slot", r.text
        assert r.json()["error"]["code"] == "invalid_slot" or body["id_slot"] < 0
    r = _post(server, "/v1/chat/completions", {**CHAT, "id_slot": "zero"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "id_slot"


def test_slot_actions_need_slot_save_path(server: Server) -> None:
    r = _post(server, "/slots/0?action=save", {"filename": "x"})
    assert r.status_code == 501 and r.json()["error"]["code"] == "slot_persistence_disabled", r.text


# ---- ops endpoints ---------------------------------------------------------------------------

def _get(server: Server, path: str, **kw) -> httpx.Response:
    return httpx.get(server.url + path, headers=kw.pop("headers", AUTH), timeout=30, **kw)


def test_props_load_stats_slots_index(server: Server) -> None:
    props = _get(server, "/props").json()
    assert props["model_alias"] == MODEL and props["total_slots"] == 1
    assert props["default_generation_settings"]["n_ctx"] == 8192
    assert props["default_generation_settings"]["params"]["n_predict"] == -1
    assert props["build_info"].startswith("ninfer ") and props["modalities"] == {"vision": False, "audio": False}
    load = _get(server, "/v1/load").json()
    assert load["object"] == "ninfer.load" and load["model"] == MODEL
    assert load["capacity"]["max_admitted_requests"] == 3 and load["capacity"]["kv_page_tokens"] > 0
    assert load["counters"]["computed_prefill_tokens"] > 0 and load["uptime_seconds"] > 0
    stats = _get(server, "/stats").json()
    assert stats["object"] == "ninfer.stats" and stats["requests"]["peak_admitted"] >= 1
    assert stats["queue"]["depth"] == 0 and stats["queue"]["entries"] == []
    slots = _get(server, "/slots").json()  # one entry per cell (2 a lane), idle ones included
    assert [s["id"] for s in slots] == [0, 1] and all("params" in s for s in slots)
    assert any(s["retained"] and s["n_prompt_tokens"] > 0 for s in slots)
    index = _get(server, "/v1").json()
    assert index["model"] == MODEL
    assert any(e["method"] == "POST" and e["path"] == "/v1/chat/completions" for e in index["endpoints"])


def _parse_prometheus(text: str) -> dict[str, float]:
    values: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("# HELP ") or line.startswith("# TYPE "):
            continue
        name, value = line.rsplit(" ", 1)
        values[name] = float(value)
    return values


def test_metrics_prometheus(server: Server) -> None:
    before = _parse_prometheus(_get(server, "/metrics").text)
    _post(server, "/completion", {"prompt": "Once upon a time", "n_predict": 2, "temperature": 0})
    r = _get(server, "/metrics")
    assert r.headers["content-type"].startswith("text/plain")
    after = _parse_prometheus(r.text)
    for name in ("prompt_tokens_total", "prompt_seconds_total", "tokens_predicted_total",
                 "tokens_predicted_seconds_total", "prompt_tokens_seconds", "predicted_tokens_seconds",
                 "n_decode_total", "n_busy_slots_per_decode", "kv_cache_usage_ratio", "kv_cache_tokens",
                 "requests_processing", "requests_deferred"):
        assert f"llamacpp:{name}" in after
    for name in ("requests_total", "requests_failed_total", "requests_rejected_total", "requests_admitted",
                 "prefix_cache_hit_tokens_total", "reused_prompt_tokens_total", "uptime_seconds"):
        assert f"ninfer:{name}" in after
    assert after["ninfer:requests_total"] == before["ninfer:requests_total"] + 1
    assert after["llamacpp:n_decode_total"] > before["llamacpp:n_decode_total"]
    assert 0 < after["llamacpp:kv_cache_usage_ratio"] <= 1


# ---- transport: auth, CORS, limits, errors -----------------------------------------------------

@pytest.mark.parametrize("path", ["/v1/models", "/metrics", "/v1/load", "/stats", "/slots", "/props", "/v1"])
def test_auth_required_except_health(server: Server, path: str) -> None:
    r = httpx.get(server.url + path)
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert r.headers["x-ninfer-version"] and r.headers["x-request-id"]
    assert httpx.get(server.url + path, headers={"Authorization": "Bearer nope"}).status_code == 401
    assert httpx.get(server.url + path, headers={"x-api-key": KEY}).status_code == 200
    assert httpx.get(server.url + "/health").status_code == 200


def test_stats_port_serves_ops_only(server: Server) -> None:
    assert httpx.get(server.stats_url + "/health").json()["status"] == "ok"
    assert httpx.get(server.stats_url + "/metrics").status_code == 401
    r = httpx.get(server.stats_url + "/metrics", headers=AUTH)
    assert r.status_code == 200 and "llamacpp:n_decode_total" in r.text
    assert httpx.get(server.stats_url + "/v1/load", headers=AUTH).json()["object"] == "ninfer.load"
    assert httpx.get(server.stats_url + "/v1/models", headers=AUTH).status_code == 404


def test_cors_preflight_needs_no_key(server: Server) -> None:
    r = httpx.options(server.url + "/v1/chat/completions",
                      headers={"Origin": "http://localhost:3000", "Access-Control-Request-Method": "POST",
                               "Access-Control-Request-Headers": "x-conversation-id"})
    assert r.status_code == 200  # as llama-server answers a preflight
    assert r.headers["access-control-allow-origin"] == "http://localhost:3000"
    assert "DELETE" in r.headers["access-control-allow-methods"]
    assert "x-conversation-id" in r.headers["access-control-allow-headers"]
    assert "authorization" in r.headers["access-control-allow-headers"]


def test_request_too_large_before_parsing(server: Server) -> None:
    big = b"{" + b" " * (2 * 1024 * 1024) + b"}"
    r = httpx.post(server.url + "/v1/chat/completions", content=big, headers=AUTH)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

    def chunks():
        for _ in range(40):
            yield b" " * 65536

    r = httpx.post(server.url + "/completion", content=chunks(), headers=AUTH)  # chunked, no length
    assert r.status_code == 413


def test_routes_and_unsupported_protocols(server: Server) -> None:
    r = _get(server, "/nope")
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    assert _get(server, "/v1/chat/completions").status_code == 405
    r = _post(server, "/v1/messages", {"model": MODEL, "max_tokens": 5, "messages": []})
    body = r.json()
    assert r.status_code == 400 and body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert body["request_id"] == r.headers["request-id"] and "x-request-id" not in r.headers
    r = _post(server, "/v1/messages/batches", {"requests": []})
    assert r.status_code == 400 and "Message Batches are not supported" in r.json()["error"]["message"]


# ---- operational records ---------------------------------------------------------------------

def test_request_log_records_the_lifecycle(server: Server) -> None:
    def records() -> list[dict]:
        return [json.loads(line) for line in server.request_log.read_text().splitlines()]

    seen = len(records())
    assert records()[0]["event"] == "server_start" and records()[0]["model"] == MODEL
    ok = _post(server, "/v1/chat/completions", {**CHAT, "max_tokens": 3})
    assert ok.status_code == 200
    assert _post(server, "/v1/chat/completions", {**CHAT, "max_tokens": "x"}).status_code == 400
    time.sleep(0.5)  # a throughput interval passes
    new = records()[seen:]
    start = next(r for r in new if r["event"] == "request_start")
    done = next(r for r in new if r["event"] == "request_done" and r["request_id"] == start["request_id"])
    assert start["protocol"] == "chat" and start["prompt_tokens"] == ok.json()["usage"]["prompt_tokens"]
    assert done["result"]["completion_tokens"] == 3 and done["result"]["finish_reason"] == "length"
    rejected = next(r for r in new if r["event"] == "request_rejected")
    assert (rejected["status"], rejected["param"]) == (400, "max_tokens") and "message" not in rejected
    assert any(r["event"] == "throughput" and r["tokens"]["decode"] >= 1 for r in new)
    assert all(r["schema"] == "ninfer_serve_request_log" and r["server_instance_id"] == new[0]["server_instance_id"]
               for r in new)
    text = server.log.read_text()
    assert f"req#{start['request_id']} done chat length prompt=" in text and "throughput: prefill" in text
    assert "Say hi" not in text and "Say hi" not in server.request_log.read_text()  # no prompt text


# ---- structured output (the server runs with --structured-output) ----------------------------

CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}, "temp": {"type": "integer"}},
        "required": ["city", "temp"], "additionalProperties": False}
ASK_JSON = [{"role": "user", "content": "Give the city Paris and the temperature 20 as JSON."}]


def test_structured_output_chat_schema_object_and_stream(server: Server) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    c = client(server)
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY, "strict": True}}
    r = c.chat.completions.create(model=MODEL, messages=ASK_JSON, max_tokens=60, temperature=0, response_format=fmt)
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), CITY)
    # sampled (seeded) at a temperature where the object closes well within max_tokens: at 0.8 whether
    # this seed's path closes by 200 tokens turned on float32 rounding of the decode kernels
    r = c.chat.completions.create(model=MODEL, messages=ASK_JSON, max_tokens=200, temperature=0.3, seed=3,
                                  response_format={"type": "json_object"})
    assert r.choices[0].finish_reason == "stop" and isinstance(json.loads(r.choices[0].message.content), dict)
    stream = c.chat.completions.create(model=MODEL, messages=ASK_JSON, max_tokens=60, temperature=0,
                                       response_format=fmt, stream=True)
    text = "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
    jsonschema.validate(json.loads(text), CITY)
    bad_stop = _post(server, "/v1/chat/completions", {**CHAT, "response_format": fmt, "stop": ["}"]})
    assert bad_stop.status_code == 400 and bad_stop.json()["error"]["code"] == "stop_not_supported"
    bad_schema = _post(server, "/v1/chat/completions",
                       {**CHAT, "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "strin"}}}})
    err = bad_schema.json()["error"]
    assert bad_schema.status_code == 400 and err["code"] == "invalid_json_schema"
    assert err["param"] == "response_format.json_schema.schema" and "strin" in err["message"]


def test_structured_output_other_protocols(server: Server) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    r = client(server).responses.create(model=MODEL, input=ASK_JSON, max_output_tokens=60, temperature=0,
                                        text={"format": {"type": "json_schema", "name": "city", "schema": CITY}})
    assert r.status == "completed" and r.text.format.type == "json_schema"
    jsonschema.validate(json.loads(r.output_text), CITY)
    msg = anthropic_client(server).messages.create(
        model=MODEL, max_tokens=60, messages=ASK_JSON, extra_body=GREEDY,
        output_config={"format": {"type": "json_schema", "schema": CITY}})
    assert msg.stop_reason == "end_turn"
    jsonschema.validate(json.loads(msg.content[0].text), CITY)
    raw = _post(server, "/completion", {"prompt": "A JSON object describing a cat: ", "json_schema": {},
                                        "n_predict": 60, "temperature": 0}).json()
    assert raw["stop_type"] == "eos" and isinstance(json.loads(raw["content"]), dict)


# ---- OpenAI Responses ------------------------------------------------------------------------

def test_responses_create_store_continue_and_count(server: Server) -> None:
    c = client(server)
    first = c.responses.create(model=MODEL, input="What is the capital of France?", max_output_tokens=12,
                               temperature=0)
    assert first.id.startswith("resp_") and first.object == "response" and first.model == MODEL
    assert first.status in ("completed", "incomplete") and first.output_text
    assert [item.type for item in first.output] == ["message"] and first.output[0].role == "assistant"
    if first.status == "incomplete":
        assert first.incomplete_details.reason == "max_output_tokens" and first.usage.output_tokens == 12
    count = c.responses.input_tokens.count(model=MODEL, input="What is the capital of France?")
    assert first.usage.input_tokens == count.input_tokens
    assert c.responses.retrieve(first.id).output_text == first.output_text

    follow = {"previous_response_id": first.id, "input": [{"role": "user", "content": "And of Germany?"}]}
    second = c.responses.create(model=MODEL, max_output_tokens=8, temperature=0, **follow)
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens == c.responses.input_tokens.count(model=MODEL, **follow).input_tokens
    assert second.usage.input_tokens_details.cached_tokens > 0  # the chain's rendered prefix is reused
    items = c.responses.input_items.list(second.id)
    assert [(i.role, i.content[0].text) for i in items.data] == [("user", "And of Germany?")]

    c.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(first.id)
    r = _post(server, "/v1/responses", {"model": MODEL, "input": "x", "previous_response_id": first.id})
    assert r.status_code == 404 and r.json()["error"]["param"] == "previous_response_id"
    unstored = c.responses.create(model=MODEL, input="Hi", max_output_tokens=2, store=False)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(unstored.id)


def test_responses_stream_lifecycle(server: Server) -> None:
    body = {"model": MODEL, "input": "Say hello.", "max_output_tokens": 6, "temperature": 0, "stream": True}
    events = []
    with httpx.stream("POST", server.url + "/v1/responses", json=body, headers=AUTH, timeout=120) as r:
        assert r.status_code == 200 and r.headers["x-request-id"]
        name = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                data = json.loads(line[6:])
                assert data["type"] == name
                events.append(data)
    types = [e["type"] for e in events]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    n = types.count("response.output_text.delta")
    assert types == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added"] + ["response.output_text.delta"] * n + [
        "response.output_text.done", "response.content_part.done", "response.output_item.done", types[-1]]
    final = events[-1]["response"]
    assert types[-1] == f"response.{final['status']}" and final["status"] in ("completed", "incomplete")
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert text == final["output"][0]["content"][0]["text"] == events[-4]["text"]
    assert final["usage"]["output_tokens"] >= 1 and "[DONE]" not in json.dumps(events)
    stored = _get(server, f"/v1/responses/{final['id']}").json()
    assert stored["output"][0]["content"][0]["text"] == text


@pytest.mark.parametrize("body, param, code", [
    ({"foo": 1}, "foo", "unknown_parameter"),
    ({"tools": [{"type": "web_search"}]}, "tools", "tools_not_supported"),
    ({"tools": [{"type": "function", "name": "f", "parameters": {"type": "string"}}]}, "tools[0].parameters", None),
    ({"tool_choice": {"type": "function", "name": "g"}, "tools": [{"type": "function", "name": "f"}]},
     "tool_choice.name", None),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema", None),
    ({"background": True}, "background", "background_not_supported"),
    ({"truncation": "auto"}, "truncation", "truncation_not_supported"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "[]"}]}, "input[0].arguments",
     None),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input[0].content", "reasoning_not_supported"),
    ({"input": [{"role": "user", "content": "hi"}, {"type": "function_call", "call_id": "c", "name": "f",
                                                     "arguments": "{}"},
                {"type": "function_call_output", "call_id": "other", "output": "x"}]}, "input", "invalid_tool_history"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "data:,"}]}]},
     "input[0].content[0]", "vision_disabled"),
    ({"metadata": {str(i): "v" for i in range(17)}}, "metadata", None),
    ({"max_output_tokens": -1}, "max_output_tokens", None), ({"temperature": 3}, "temperature", None),
    ({"include": ["file_search_call.results"]}, "include", None),
    ({"input": [{"role": "user", "content": "a", "id": "x"}, {"role": "user", "content": "b", "id": "x"}]},
     "input[1].id", None),
    ({"input": [{"role": "assistant", "content": "only me"}]}, "input", None),
    ({"graft": "g"}, "graft", "unknown_graft"),
])
def test_responses_errors_name_the_field(server: Server, body: dict, param: str, code: str | None) -> None:
    r = _post(server, "/v1/responses", {"model": MODEL, "input": "hi", **body})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == param, err
    assert code is None or err["code"] == code


def test_responses_resources(server: Server) -> None:
    other = _post(server, "/v1/responses", {"model": "other", "input": "hi", "max_output_tokens": 1})
    assert other.status_code == 200 and other.json()["model"] == MODEL  # any name: the one model answers
    assert _post(server, "/v1/responses/compact", {}).json()["error"]["code"] == "compaction_not_supported"
    assert _post(server, "/v1/responses/resp_x/cancel", {}).json()["error"]["code"] == "background_not_supported"
    assert _get(server, "/v1/responses/resp_missing").json()["error"]["code"] == "response_not_found"
    assert httpx.delete(server.url + "/v1/responses/resp_missing", headers=AUTH).status_code == 404
    assert _post(server, "/v1/responses/resp_x", {}).status_code == 405
    items = [{"role": "user", "content": f"turn {i}"} for i in range(5)]
    created = _post(server, "/v1/responses", {"model": MODEL, "input": items, "max_output_tokens": 1}).json()
    page = _get(server, f"/v1/responses/{created['id']}/input_items", params={"limit": 2, "order": "asc"}).json()
    assert [i["content"][0]["text"] for i in page["data"]] == ["turn 0", "turn 1"] and page["has_more"]
    rest = _get(server, f"/v1/responses/{created['id']}/input_items",
                params={"after": page["last_id"], "order": "asc"}).json()
    assert [i["content"][0]["text"] for i in rest["data"]] == ["turn 2", "turn 3", "turn 4"] and not rest["has_more"]
    assert _get(server, f"/v1/responses/{created['id']}/input_items", params={"limit": 0}).status_code == 400


# ---- Anthropic Messages ----------------------------------------------------------------------

GREEDY = {"temperature": 0}  # the 2026 SDK no longer types temperature; the API still takes it


def anthropic_client(server: Server):
    anthropic = pytest.importorskip("anthropic")
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0)


def test_anthropic_messages_aggregate_stream_and_count(server: Server) -> None:
    c = anthropic_client(server)
    request = {"model": "any-local-label", "max_tokens": 12, "system": "Answer briefly.",
               "messages": [{"role": "user", "content": "Name three colors."}]}
    count = c.messages.count_tokens(model=request["model"], system=request["system"], messages=request["messages"])
    c.messages.create(**request, extra_body=GREEDY)  # warm the prefix cache: both compared runs reuse it
    raw = c.messages.with_raw_response.create(**request, extra_body=GREEDY)
    msg = raw.parse()
    assert raw.headers["request-id"].startswith("req_") and raw.headers["x-ninfer-version"]
    assert msg.id.startswith("msg_") and msg.model == "any-local-label" and msg.role == "assistant"
    assert [b.type for b in msg.content] == ["text"] and msg.content[0].text
    assert msg.stop_reason in ("end_turn", "max_tokens") and msg.stop_sequence is None
    u = msg.usage
    assert u.input_tokens + u.cache_read_input_tokens == count.input_tokens
    assert u.cache_read_input_tokens > 0 and 1 <= u.output_tokens <= 12

    with c.messages.stream(**request, extra_body=GREEDY) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == msg.content[0].text and final.content[0].text == text
    assert final.stop_reason == msg.stop_reason and final.usage.output_tokens == u.output_tokens
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == count.input_tokens

    names = []
    with httpx.stream("POST", server.url + "/v1/messages", headers={"x-api-key": KEY}, timeout=120,
                      json={**request, **GREEDY, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["request-id"].startswith("req_")
        for line in r.iter_lines():
            if line.startswith("event: "):
                names.append(line[7:])
    deltas = names.count("content_block_delta")
    assert names == ["message_start", "content_block_start"] + ["content_block_delta"] * deltas + [
        "content_block_stop", "message_delta", "message_stop"]


def test_anthropic_prefill_stop_sequence_and_max_tokens(server: Server) -> None:
    c = anthropic_client(server)
    ask = [{"role": "user", "content": "What is the capital of France?"}]
    msg = c.messages.create(model=MODEL, max_tokens=30, messages=ask, stop_sequences=["Paris"], extra_body=GREEDY)
    assert msg.stop_reason == "stop_sequence" and msg.stop_sequence == "Paris"
    assert "Paris" not in msg.content[0].text
    # a final assistant turn is continued in place: the prompt is the chat prompt plus that text
    prefill = "The capital of France is"
    tpl = _post(server, "/apply-template", {"messages": ask}).json()["prompt"]
    want = _post(server, "/tokenize", {"content": tpl + prefill, "add_special": False}).json()["tokens"]
    turns = ask + [{"role": "assistant", "content": prefill}]
    assert c.messages.count_tokens(model=MODEL, messages=turns).input_tokens == len(want)
    msg = c.messages.create(model=MODEL, max_tokens=3, messages=turns, extra_body=GREEDY)
    assert "Paris" in msg.content[0].text and prefill not in msg.content[0].text  # the continuation only
    assert (msg.stop_reason, msg.usage.output_tokens) in (("max_tokens", 3), ("end_turn", 2), ("end_turn", 3))
    # consecutive user turns are one turn; a system turn keeps its place
    split = [{"role": "user", "content": "What is the capital "}, {"role": "user", "content": "of France?"}]
    assert c.messages.count_tokens(model=MODEL, messages=split).input_tokens == \
        c.messages.count_tokens(model=MODEL, messages=ask).input_tokens


@pytest.mark.parametrize("body, param", [
    ({"max_tokens": 0}, "max_tokens"), ({"max_tokens": "5"}, "max_tokens"),
    ({"tools": [{"type": "bash_20250124", "name": "bash"}]}, "tools"),
    ({"tools": [{"name": "f", "input_schema": {"type": "object"}, "strict": True}]}, "strict"),
    ({"tool_choice": {"type": "any"}}, "tool_choice"),
    ({"thinking": {"type": "enabled", "budget_tokens": 100}}, "thinking.budget_tokens"),
    ({"tools": [{"name": "f", "input_schema": {"type": "object"}}], "tool_choice": {"type": "tool", "name": "g"}},
     "tool_choice.name"),
    ({"output_config": {"format": {"type": "json_schema"}}}, "output_config.format.schema"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "base64"}}]}]}, "image"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result"}]}]}, "tool_use_id"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "t1", "name": "f", "input": {}}]}, {"role": "user", "content": "no result"}]},
     "tool_result"),
    ({"messages": [{"role": "user", "content": [{"type": "nope"}]}]}, "nope"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "role"),
    ({"messages": "hi"}, "messages"), ({"model": ""}, "model"), ({"stop_sequences": [""]}, "stop_sequences"),
    ({"stream": "yes"}, "stream"), ({"temperature": "hot"}, "temperature"),
])
def test_anthropic_errors_name_the_field(server: Server, body: dict, param: str) -> None:
    base = {"model": MODEL, "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}
    r = httpx.post(server.url + "/v1/messages", json={**base, **body}, headers={"x-api-key": KEY}, timeout=60)
    err = r.json()
    assert r.status_code == 400, err
    assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
    assert param in err["error"]["message"] and err["request_id"] == r.headers["request-id"]


def test_anthropic_auth_error_shape(server: Server) -> None:
    anthropic = pytest.importorskip("anthropic")
    c = anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as e:
        c.messages.count_tokens(model=MODEL, messages=[{"role": "user", "content": "hi"}])
    assert e.value.body["error"]["type"] == "authentication_error"


def test_overload_queue_timeout_keepalive_and_disconnect(server: Server) -> None:
    """One long stream holds the lane; a streamed and a plain request wait in the queue; a fourth
    is refused 429; both waiting requests time out with 503 request_queue_timeout (the stream's
    response waits for a lane, so it is a status, not an in-stream error); closing the long stream
    cancels it and frees the lane."""
    long_body = {**CHAT, "max_tokens": 4000, "ignore_eos": True, "stream": True}
    cancelled_before = _get(server, "/stats").json()["scheduler"]["requests_cancelled"]
    holder = httpx.Client(timeout=120, headers=AUTH)
    long_stream = holder.stream("POST", server.url + "/v1/chat/completions", json=long_body)
    resp = long_stream.__enter__()
    lines = resp.iter_lines()
    assert next(line for line in lines if line.startswith("data: "))  # it is running
    results: dict[str, object] = {}

    def queued_stream() -> None:
        with httpx.stream("POST", server.url + "/v1/chat/completions", json={**CHAT, "stream": True},
                          headers=AUTH, timeout=120) as r:
            results["stream_status"] = r.status_code
            results["stream_lines"] = list(r.iter_lines())

    def queued_plain() -> None:
        results["plain"] = _post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 2})

    threads = [threading.Thread(target=queued_stream), threading.Thread(target=queued_plain)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 30
    while _get(server, "/v1/load").json()["requests"]["waiting"] < 2:
        assert time.monotonic() < deadline, "the two requests never queued"
        time.sleep(0.05)
    over = _post(server, "/v1/chat/completions", CHAT)
    assert over.status_code == 429 and over.json()["error"]["code"] == "server_overloaded"
    for t in threads:
        t.join(timeout=120)
    plain = results["plain"]
    assert plain.status_code == 503 and plain.json()["error"]["code"] == "request_queue_timeout"
    # a queued stream holds its response until it gets a lane, so its timeout is the spec's 503 too
    assert results["stream_status"] == 503
    body = json.loads("".join(results["stream_lines"]))
    assert body["error"]["code"] == "request_queue_timeout"

    long_stream.__exit__(None, None, None)  # the client goes away mid-generation
    holder.close()
    deadline = time.monotonic() + 30
    while True:
        load = _get(server, "/v1/load").json()["requests"]
        if load["running"] == 0 and load["admitted"] == 0:
            break
        assert time.monotonic() < deadline, f"the abandoned request still holds the lane: {load}"
        time.sleep(0.05)
    assert _get(server, "/stats").json()["scheduler"]["requests_cancelled"] == cancelled_before + 1
    metrics = _parse_prometheus(_get(server, "/metrics").text)
    assert metrics["ninfer:requests_rejected_total"] >= 1 and metrics["ninfer:requests_failed_total"] >= 2


# ---- hostile bodies --------------------------------------------------------------------------

def _hostile_bodies() -> list[tuple[str, bytes]]:
    """(path, body) pairs that must each be answered 4xx: a valid body with one field broken,
    invalid JSON and UTF-8, deep nesting, huge numbers, wrong roots."""
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    raw = {"prompt": "hi", "n_predict": 1}
    wrong = [None, True, -1, 1.5, 1e308, -1e308, 2**63, "x", "", [], {}, [1, "a"], {"a": {"b": []}}]
    chat_fields = {
        "messages": wrong, "max_tokens": [True, -2, 1.5, "5", [], {}, 1e300],
        "max_completion_tokens": [-5, "x", 2.5], "temperature": ["hot", [], {}, True, 1e300],
        "top_p": [2, -0.5, "x", True], "top_k": [1.5, "x", True, []], "min_p": [1.1, -1, "x"],
        "presence_penalty": [3, -3, "x"], "frequency_penalty": [9, "x"], "seed": ["x", 1.5, 2**64, []],
        "stop": [5, [1], ["a", "b", "c", "d", "e"], [""], {"a": 1}], "n": [2, 0, "x"],
        "logprobs": ["yes", 1], "top_logprobs": [21, -1, "x"], "stream": ["true", 1],
        "stream_options": ["x", [], {"include_usage": "yes"}], "logit_bias": [{"1": 5}, "x", [[1, 2]]],
        "response_format": [{"type": "json_schema"}, "x", {}, {"type": "json_schema", "json_schema": {"schema": 5}},
                            {"type": "json_schema", "json_schema": {"schema": {"type": "strin"}}}], "tools": ["x", [{"type": "function"}]],
        "tool_choice": ["required", {"type": "function"}], "ignore_eos": ["x", 1],
        "model": [5, [], {}], "chat_template_kwargs": ["x", {"messages": 1}],
        "guided_json": [{"type": "object"}], "grammar": ["x"], "audio": [{"voice": "a"}],
    }
    bodies: list[tuple[str, bytes]] = []
    for field, values in chat_fields.items():
        for v in values:
            bodies.append(("/v1/chat/completions", json.dumps({**chat, field: v}).encode()))
    for v in wrong + [[{"role": "user"}], [{"role": "user", "content": 5}],
                      [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
                      [{"role": "user", "content": [{"type": "nope"}]}], [{"content": "x"}], ["x"]]:
        bodies.append(("/v1/chat/completions", json.dumps({**chat, "messages": v}).encode()))
    raw_fields = {"prompt": [None, 5, 1.5, [], [[1], [2]], ["a", "b"], [49152], [-1], {"a": 1}, True],
                  "n_predict": ["x", 1.5, []], "typical_p": [0.5, "x"], "tfs_z": [0.9], "xtc_probability": [0.5],
                  "top_n_sigma": [1.0], "n_indent": [2], "lora": [[{"id": 0, "scale": 1}]],
                  "logit_bias": [[[5, False]]], "json_schema": ["x", {"type": 5}], "stop": [7, [1]],
                  "cache_prompt": ["no"], "response_fields": ["x", [1]]}
    for field, values in raw_fields.items():
        for v in values:
            bodies.append(("/completion", json.dumps({**raw, field: v}).encode()))
            if field not in ("n_predict", "response_fields"):  # /completion's own fields
                bodies.append(("/v1/completions", json.dumps({**raw, "max_tokens": 1, field: v}).encode()))
    msg = {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}
    msg_fields = {"messages": wrong + [[{"role": "user"}], [{"role": "user", "content": 5}],
                                       [{"role": "user", "content": [{"type": "text"}]}], [None],
                                       [{"role": "user", "content": [{"type": [None], "text": "hi"}]}]],
                  "max_tokens": [0, -1, "x", 1.5, True], "system": [5, [{"type": "image"}], [1]],
                  "stop_sequences": [5, [1], [""]], "tools": [[{"type": [1]}]], "top_k": ["x", 1.5], "top_p": [2, "x"], "stream": ["x"],
                  "thinking": ["x", {"type": "x"}], "tool_choice": ["auto", {"type": "x"}],
                  "output_config": ["x"], "model": [5, ""], "chat_template_kwargs": ["x"]}
    resp = {"model": MODEL, "input": "hi", "max_output_tokens": 1}
    resp_fields = {"input": [5, True, [5], [{"role": "x", "content": "a"}], [{"type": "x"}],
                             [{"role": "user", "content": [{"type": "input_text"}]}], [{"role": "user", "content": 5}]],
                   "max_output_tokens": [-1, "x", 1.5], "temperature": [3, "x"], "top_p": [2, "x"],
                   "instructions": [5, []], "previous_response_id": [5, "", "nope"], "stream": ["x"],
                   "store": ["x"], "metadata": ["x", {"a": 5}], "reasoning": ["x", {"summary": "x"}],
                   "text": ["x", {"format": {"type": "json_schema"}}], "tool_choice": ["required"],
                   "top_logprobs": [21, "x"], "include": ["x", ["x"]], "service_tier": ["flex"],
                   "model": [None, "", 5], "user": [5], "nonsense": [1]}
    for field, values in resp_fields.items():
        for v in values:
            bodies.append(("/v1/responses", json.dumps({**resp, field: v}).encode()))
            count = {k: resp[k] for k in ("model", "input")}  # the fields input_tokens takes
            bodies.append(("/v1/responses/input_tokens", json.dumps({**count, field: v}).encode()))
    prompt_fields = ("messages", "system", "model", "thinking", "tool_choice", "output_config", "chat_template_kwargs")
    for field, values in msg_fields.items():
        for v in values:
            bodies.append(("/v1/messages", json.dumps({**msg, field: v}).encode()))
            if field in prompt_fields:  # count_tokens validates the prompt, not the sampling fields
                bodies.append(("/v1/messages/count_tokens", json.dumps({**msg, field: v}).encode()))
    deep = b"[" * 5000 + b"]" * 5000
    obj_deep = b'{"a":' * 3000 + b"1" + b"}" * 3000
    broken = [b"", b"{", b"}", b"null", b"[]", b"42", b'"str"', b"{'a': 1}", b'{"a": NaN}', b'{"a": Infinity}',
              b"\xff\xfe\x00{", b'{"messages": "\xc3\x28"}', b'{"prompt": "\xed\xa0\x80"}', deep, obj_deep,
              b'{"max_tokens": 1' + b"0" * 400 + b"}", b'{"temperature": 1e999}', b"\x00" * 64,
              b'{"prompt": "a"' + b', "x": 1' * 10 + b"", b'{"a":1}{"b":2}']
    for path in ("/v1/chat/completions", "/v1/completions", "/completion", "/tokenize", "/detokenize",
                 "/apply-template", "/v1/messages", "/v1/messages/count_tokens", "/v1/responses",
                 "/v1/responses/input_tokens"):
        for b in broken:
            bodies.append((path, b))
    for path, body in [("/tokenize", {"content": 5}), ("/tokenize", {"content": "a", "parse_special": "no"}),
                       ("/detokenize", {"tokens": "x"}), ("/detokenize", {"tokens": [1.5]}),
                       ("/detokenize", {"tokens": [2**40]}), ("/apply-template", {"messages": []}),
                       ("/apply-template", {"messages": [{"role": "x", "content": "y"}]})]:
        bodies.append((path, json.dumps(body).encode()))
    return bodies


def test_hostile_bodies_answer_4xx(server: Server) -> None:
    bodies = _hostile_bodies()
    assert len(bodies) >= 200
    failures = []
    with httpx.Client(timeout=60, headers={**AUTH, "content-type": "application/json"}) as c:
        for path, body in bodies:
            r = c.post(server.url + path, content=body)
            ok = 400 <= r.status_code < 500 and isinstance(r.json().get("error"), dict)
            if not ok:
                failures.append((path, body[:120], r.status_code, r.text[:200]))
        assert not failures, failures[:10]
        assert c.get(server.url + "/health").status_code == 200
        load = c.get(server.url + "/v1/load").json()["requests"]
        assert load["admitted"] == 0 and load["running"] == 0
