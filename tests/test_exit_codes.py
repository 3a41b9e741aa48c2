"""Exit statuses a supervisor can trust, each read from a real `ninfer serve` process: 2 after an
Engine-wide failure of a single-model server (its request ends with an error, /health turns 503
first), 130 for a Ctrl+C during the stop, 0 for a clean stop of a router; while a router instead
unloads a model whose Engine failed and loads it again on its next request."""
from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from test_reliability_startup import _free_port, _wait_exit, _wait_for

CHAT = {"messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 4}


def _serve(args: list[str], tmp: Path, env: dict[str, str] | None = None) -> tuple[subprocess.Popen, Path, str]:
    import os

    port = _free_port()
    log = tmp / f"serve-{time.monotonic_ns()}.log"
    cmd = [sys.executable, "-m", "ninfer.cli.main", "serve", *args, "--port", str(port), "--log-stats-interval-ms", "0"]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
    _wait_for(proc, log, "serving")
    return proc, log, f"http://127.0.0.1:{port}"


def test_engine_wide_failure_of_a_single_model_server_exits_2(smollm2_artifact: Path, tmp_path: Path) -> None:
    proc, log, url = _serve([str(smollm2_artifact)], tmp_path, {"NINFER_INJECT_ENGINE_FAULT": "0"})
    r = httpx.post(url + "/v1/chat/completions", json=CHAT, timeout=60)
    assert r.status_code == 500  # the request in flight ends with an error, never hangs
    assert _wait_exit(proc, 60) == 2
    text = log.read_text()
    assert "the engine failed" in text and "injected Engine failure" in text


def test_router_reloads_a_model_whose_engine_failed_and_stops_with_0(smollm2_artifact: Path, tmp_path: Path) -> None:
    preset = tmp_path / "models.ini"
    preset.write_text(f"[smol]\nmodel = {smollm2_artifact}\n")
    # a request of 4 output tokens is 4 batches (one prefill, three decode rounds): the second fails
    proc, log, url = _serve(["--models-preset", str(preset)], tmp_path, {"NINFER_INJECT_ENGINE_FAULT": "4"})
    try:
        body = {**CHAT, "model": "smol", "temperature": 0, "ignore_eos": True}
        assert httpx.post(url + "/v1/chat/completions", json=body, timeout=120).status_code == 200
        assert httpx.post(url + "/v1/chat/completions", json=body, timeout=120).status_code == 500  # fails
        deadline = time.monotonic() + 30
        while True:
            entry = httpx.get(url + "/models").json()["data"][0]
            if entry["status"]["value"] == "unloaded":
                break
            assert time.monotonic() < deadline, entry
            time.sleep(0.1)
        assert entry["status"]["failed"] is True and "injected Engine failure" in entry["status"]["error"]
        assert proc.poll() is None  # a router keeps serving
        assert httpx.post(url + "/v1/chat/completions", json=body, timeout=120).status_code == 200  # reloaded
        assert httpx.get(url + "/models").json()["data"][0]["loads"] == 2
    finally:
        proc.send_signal(signal.SIGTERM)
    assert _wait_exit(proc, 60) == 0
    text = log.read_text()
    assert "server stopped" in text and "\x1b" not in text  # redirected: plain records, no control sequences


def test_ctrl_c_during_the_stop_exits_130(smollm2_artifact: Path, tmp_path: Path) -> None:
    """The stop waits for the step in progress (a whole-prompt prefill here); a Ctrl+C meanwhile
    exits at once with 130."""
    proc, log, url = _serve([str(smollm2_artifact), "--prefill-chunk", "8192", "--max-context", "8192"], tmp_path)
    long_prompt = {"messages": [{"role": "user", "content": "lighthouse keeper " * 600}], "max_tokens": 4}
    def ask() -> None:
        try:
            httpx.post(url + "/v1/chat/completions", json=long_prompt, timeout=300)
        except httpx.TransportError:  # the process exits under it
            pass

    asker = threading.Thread(target=ask, daemon=True)
    asker.start()
    _wait_for(proc, log, "req#1 start", 60)  # submitted: its one prefill step starts now
    time.sleep(0.3)
    proc.send_signal(signal.SIGTERM)  # stop: it waits for the prefill step to end
    time.sleep(0.2)
    if proc.poll() is not None:
        pytest.skip(f"the stop finished within 0.2 s (status {proc.returncode}): no window for a second signal")
    proc.send_signal(signal.SIGINT)
    assert _wait_exit(proc, 60) == 130
    asker.join(30)
