"""Pipeline stages end to end on the default model: `ninfer run --devices cpu,cpu` gives the tokens
of one device, bad --devices / --stage-layers values fail in one line, and a served model on two
CPU stages answers the openai client and reports per-device memory in /props, /slots and /metrics."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.test_server_http import free_port, wait_for_health

openai = pytest.importorskip("openai")
PROMPT = "List three colours of the rainbow."


def ninfer(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ninfer.cli.main", *args], capture_output=True, text=True,
                          timeout=300)


def run_json(model: Path, *extra: str) -> dict:
    out = ninfer("run", str(model), "--json", "--temperature", "0", "--max-tokens", "24", *extra, PROMPT)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_run_on_two_cpu_stages_gives_one_device_tokens(smollm2_artifact: Path) -> None:
    one = run_json(smollm2_artifact)
    two = run_json(smollm2_artifact, "--devices", "cpu,cpu", "--stage-layers", "11,19")
    assert two["token_ids"] == one["token_ids"] and len(one["token_ids"]) > 4
    assert two["text"] == one["text"]


@pytest.mark.parametrize("args, message", [
    (("--devices", "cpu"), "--devices takes 2 to 8 devices, got 1"),
    (("--devices", "cpu,cpu", "--stage-layers", "10,10"), "--stage-layers 10,10 sums to 20, but the model has 30"),
    (("--devices", "cpu,cpu", "--stage-layers", "0,30"), "every stage needs at least one layer"),
    (("--devices", "cpu,cpu", "--stage-layers", "10,10,10"), "--stage-layers lists 3 stages for 2 --devices"),
    (("--stage-layers", "15,15"), "--stage-layers needs --devices"),
    (("--devices", "cpu,tpu"), "'tpu' is not a CUDA device index"),
])
def test_bad_split_is_one_line(smollm2_artifact: Path, args: tuple[str, ...], message: str) -> None:
    out = ninfer("run", str(smollm2_artifact), *args, "hi")
    assert out.returncode == 1
    assert message in out.stderr
    assert "Traceback" not in out.stderr + out.stdout


def props_pages(props: dict) -> int:
    return props["kv_cache"]["capacity_tokens"] // props["kv_cache"]["page_tokens"]


def test_serve_on_two_cpu_stages_reports_memory_per_device(smollm2_artifact: Path, tmp_path: Path) -> None:
    port = free_port()
    log = tmp_path / "serve.log"
    cmd = [sys.executable, "-m", "ninfer.cli.main", "serve", str(smollm2_artifact), "--port", str(port),
           "--model-id", "smol", "--devices", "cpu,cpu", "--stage-layers", "12,18", "--max-context", "512"]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for_health(proc, url, log)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
        chat = client.chat.completions.create(model="smol", messages=[{"role": "user", "content": PROMPT}],
                                              max_tokens=8, temperature=0)
        assert chat.choices[0].message.content
        props = httpx.get(f"{url}/props").json()
        stages = props["devices"]
        assert [(s["stage"], s["device"], s["layers"]) for s in stages] == [(0, "cpu", [0, 11]), (1, "cpu", [12, 29])]
        assert all(s["weights_bytes"] > 0 and s["kv_bytes"] > 0 and s["state_bytes"] == 0 for s in stages)
        # K/V pages split as the attention layers do: 12 and 18 of 30
        assert stages[0]["kv_bytes"] * 18 == stages[1]["kv_bytes"] * 12
        assert stages[0]["kv_bytes"] + stages[1]["kv_bytes"] == \
            props["kv_cache"]["bytes_per_token"] * props["kv_cache"]["capacity_tokens"]
        # the retained conversation's pages, on each device (both stages are on "cpu": their sum)
        cells = [c for c in httpx.get(f"{url}/slots").json() if c.get("n_pages")]
        per_page = (stages[0]["kv_bytes"] + stages[1]["kv_bytes"]) // props_pages(props)
        assert cells and all(c["device_kv_bytes"] == {"cpu": c["n_pages"] * per_page} for c in cells)
        metrics = httpx.get(f"{url}/metrics").text
        weights = sum(s["weights_bytes"] for s in stages)
        assert f'ninfer:device_memory_bytes{{device="cpu",kind="weights"}} {weights}' in metrics
        kv = sum(s["kv_bytes"] for s in stages)
        assert f'ninfer:device_memory_bytes{{device="cpu",kind="kv"}} {kv}' in metrics
    finally:
        proc.send_signal(signal.SIGINT)
        time.sleep(0.3)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0, log.read_text()
