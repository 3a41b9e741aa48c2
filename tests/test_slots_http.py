"""Slot files and the prefix-cache file through real `ninfer serve` processes on the default model:
POST /slots/{id} save / restore / erase with their errors, a restored session reused by the next
request (tokens_cached), and a restart that finds its prefix again through --prefix-cache-file."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.test_cli import ninfer
from tests.test_server_http import free_port, wait_for_health

PROMPT = ("Persistent sessions let a long agent conversation survive evictions and restarts: the "
          "retained KV pages of its prefix are written to a file and read back later, so the next "
          "turn starts where the last one stopped instead of recomputing the whole history.")


@dataclass
class Serve:
    url: str
    proc: subprocess.Popen
    log: Path
    request_log: Path


def start(artifact: Path, folder: Path, *extra: str) -> Serve:
    port = free_port()
    log = folder / f"serve-{port}.log"
    request_log = folder / f"requests-{port}.jsonl"
    cmd = [sys.executable, "-m", "ninfer.cli.main", "serve", str(artifact), "--port", str(port),
           "--max-concurrency", "1", "--log-stats-interval-ms", "0", "--request-log-jsonl", str(request_log), *extra]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    wait_for_health(proc, url, log, 600)  # a loaded shared machine can take minutes to import and load
    return Serve(url, proc, log, request_log)


def stop(s: Serve) -> str:
    s.proc.send_signal(signal.SIGINT)  # Ctrl+C twice: the second within 5 s stops
    time.sleep(0.3)
    s.proc.send_signal(signal.SIGINT)
    assert s.proc.wait(timeout=120) == 0, s.log.read_text()
    return s.log.read_text()


def complete(s: Serve, prompt: str = PROMPT) -> dict:
    r = httpx.post(s.url + "/completion", json={"prompt": prompt, "n_predict": 3, "temperature": 0,
                                                "ignore_eos": True}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def slot_action(s: Serve, slot: int | str, action: str, body: dict | None = None) -> httpx.Response:
    return httpx.post(f"{s.url}/slots/{slot}", params={"action": action}, json=body if body is not None else {},
                      timeout=120)


def slots(s: Serve) -> list[dict]:
    return httpx.get(s.url + "/slots", timeout=30).json()


def wait_retained(s: Serve, digest: str | None = None) -> dict:
    end = time.monotonic() + 30
    while True:
        cells = [c for c in slots(s) if c.get("retained") and (digest is None or c["session_digest"] == digest)]
        if cells:
            return cells[0]
        assert time.monotonic() < end, slots(s)
        time.sleep(0.02)


@pytest.fixture(scope="module")
def served(smollm2_artifact: Path, tmp_path_factory: pytest.TempPathFactory):
    folder = tmp_path_factory.mktemp("slots")
    s = start(smollm2_artifact, folder, "--slot-save-path", str(folder / "saved"),
              "--prefix-cache-file", str(folder / "prefix.cache"), "--host-kv-mib", "256")
    yield s, folder
    if s.proc.poll() is None:
        s.proc.kill()
        s.proc.wait()


def test_save_erase_restore_and_reuse(served) -> None:
    s, folder = served
    first = complete(s)
    assert first["tokens_cached"] == 0
    cell = wait_retained(s)
    slot, digest = cell["id"], cell["session_digest"]
    r = slot_action(s, slot, "save", {"filename": "Agent-Conv.1"})
    assert r.status_code == 200, r.text
    saved = r.json()
    assert saved["filename"] == "agent-conv.1" and saved["id_slot"] == slot
    assert saved["session_digest"] == digest and saved["n_saved"] == cell["n_prompt_tokens"]
    path = folder / "saved" / "agent-conv.1"
    assert saved["n_written"] == path.stat().st_size and saved["timings"]["save_ms"] > 0
    assert not list((folder / "saved").glob(".*"))  # no temporary file left
    # a conditional erase of another session is refused; of this one it runs
    r = slot_action(s, slot, "erase", {"if_digest": "0123456789abcdef"})
    assert r.status_code == 409 and r.json()["error"]["code"] == "slot_session_mismatch"
    r = slot_action(s, slot, "erase", {"if_digest": digest})
    assert r.status_code == 200 and r.json() == {"id_slot": slot, "n_erased": cell["n_prompt_tokens"]}
    assert slot_action(s, slot, "erase").json()["n_erased"] == 0
    r = slot_action(s, slot, "save", {"filename": "x"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "slot_save_failed"
    # restore into the other cell: an ordinary cache entry the same prompt reuses
    other = 1 - slot
    r = slot_action(s, other, "restore", {"filename": "AGENT-CONV.1"})
    assert r.status_code == 200, r.text
    restored = r.json()
    assert restored["n_restored"] == saved["n_saved"] and restored["session_digest"] == digest
    assert restored["n_read"] == saved["n_written"] and restored["id_slot"] == other
    assert wait_retained(s, digest)["id"] == other
    again = complete(s)
    assert again["tokens_cached"] > 0 and again["content"] == first["content"]
    records = [json.loads(line) for line in s.request_log.read_text().splitlines()]
    done = [r for r in records if r["event"] == "request_done"]
    assert done[-1]["prefix_reuse_tier"] == "device"
    # the same through `ninfer slots` against the running server
    cell = {"id": again["id_slot"], "session_digest": digest}  # the same session, retained again
    out = ninfer("slots", "save", str(cell["id"]), "cli-copy", "--url", s.url, "--json", "--if-digest", digest)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["session_digest"] == digest
    assert (folder / "saved" / "cli-copy").exists()
    listed = json.loads(ninfer("slots", "list", str(folder / "saved"), "--json").stdout)
    assert {r["file"] for r in listed} >= {"agent-conv.1", "cli-copy"}
    out = ninfer("slots", "erase", str(cell["id"]), "--url", s.url, "--if-digest", "0123456789abcdef")
    assert out.returncode == 1 and "slot_session_mismatch" in out.stderr


def test_slot_action_errors(served) -> None:
    s, folder = served
    for slot, action, body, status, code in (
            (7, "save", {"filename": "a"}, 400, "invalid_slot"),
            ("x", "save", {"filename": "a"}, 400, "invalid_slot"),
            (0, "load", {"filename": "a"}, 400, "invalid_action"),
            (0, "save", {"filename": "../a"}, 400, "invalid_filename"),
            (0, "save", {"filename": ".hidden"}, 400, "invalid_filename"),
            (0, "save", {"filename": "end."}, 400, "invalid_filename"),
            (0, "save", {"filename": "CON.txt"}, 400, "invalid_filename"),
            (0, "save", {"filename": "a" * 129}, 400, "invalid_filename"),
            (0, "save", {"filename": ""}, 400, "invalid_filename"),
            (0, "save", {}, 400, "invalid_filename"),
            (0, "restore", {"filename": "missing"}, 400, "slot_restore_failed")):
        r = slot_action(s, slot, action, body)
        assert (r.status_code, r.json()["error"]["code"]) == (status, code), (slot, action, body, r.text)
    # a corrupt file: 400, and the slot is left empty
    complete(s, PROMPT + " Corrupt.")
    cell = wait_retained(s)
    assert slot_action(s, cell["id"], "save", {"filename": "c"}).status_code == 200
    data = bytearray((folder / "saved" / "c").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (folder / "saved" / "c").write_bytes(bytes(data))
    r = slot_action(s, cell["id"], "restore", {"filename": "c"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "slot_restore_failed"
    assert "checksum" in r.json()["error"]["message"]
    assert not any(c["id"] == cell["id"] and c.get("retained") for c in slots(s))


def test_props_reports_the_kv_pool(served) -> None:
    s, _ = served
    kv = httpx.get(s.url + "/props", timeout=30).json()["kv_cache"]
    # the default model on CPU: float32 K and V, 30 layers x 3 kv heads x 64 dims
    assert kv == {"dtype": "float32", "bytes_per_token": 30 * 2 * 3 * 64 * 4, "capacity_tokens": 8192,
                  "page_tokens": 64}


def test_restart_reuses_the_prefix_through_the_prefix_cache_file(served, smollm2_artifact: Path) -> None:
    s, folder = served
    prompt = PROMPT + " After a restart."
    first = complete(s, prompt)
    wait_retained(s)
    log = stop(s)
    assert "prefix cache saved" in log and (folder / "prefix.cache").exists()
    assert not (folder / ".prefix.cache.tmp").exists()
    s2 = start(smollm2_artifact, folder, "--slot-save-path", str(folder / "saved"),
               "--prefix-cache-file", str(folder / "prefix.cache"), "--host-kv-mib", "256")
    try:
        again = complete(s2, prompt)
        assert again["tokens_cached"] > 0 and again["content"] == first["content"]
        records = [json.loads(line) for line in s2.request_log.read_text().splitlines()]
        done = [r for r in records if r["event"] == "request_done"]
        assert done[-1]["prefix_reuse_tier"] == "host"
        metrics = httpx.get(s2.url + "/metrics", timeout=30).text
        assert 'ninfer:context_tier_hits_total{tier="host"} 1' in metrics
        # a slot file saved before the restart restores after it
        r = slot_action(s2, 0, "restore", {"filename": "agent-conv.1"})
        assert r.status_code == 200, r.text
    finally:
        stop(s2)
    # a corrupt prefix-cache file is ignored at start and replaced at stop
    (folder / "prefix.cache").write_bytes(b"garbage")
    s3 = start(smollm2_artifact, folder, "--prefix-cache-file", str(folder / "prefix.cache"), "--host-kv-mib", "256")
    assert complete(s3, prompt)["tokens_cached"] == 0
    log = stop(s3)
    assert "prefix cache file ignored" in log and "prefix cache saved" in log
    assert (folder / "prefix.cache").read_bytes().startswith(b"NINFSES1")

