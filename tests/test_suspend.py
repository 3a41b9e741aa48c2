"""Model suspend on the torch backend (engine/suspend.py): in-process on the default model, the
retained conversation's prefix is reused exactly after a resume; then `ninfer serve --model-suspend`
as a real process (--suspend-snapshot pinned --suspend-weights host): the
/v1/models/{id}/suspend|resume|residency routes, auto_resume, 409 model_busy while a stream runs, and
a router's sleep under --models-max; the suspend options and --spec mtp in process."""
from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from engine_helpers import assert_as_never_suspended, generate
from test_server_http import free_port
from test_speculative import q35_mtp  # noqa: F401 - the tiny Qwen3.5 with an MTP head (a fixture)

openai = pytest.importorskip("openai")


def test_suspend_keeps_retained_prefixes_exactly(smollm2_artifact: Path) -> None:
    from ninfer.engine.config import SchedulerConfig
    from ninfer.engine.errors import EngineSuspended
    from ninfer.engine.loader import load_engine
    from ninfer.engine.request import PreparedRequest, SamplingParams

    def load():
        return load_engine(str(smollm2_artifact), backend="torch", scheduler=SchedulerConfig(max_context=1024),
                           announce=False)

    m = load()
    engine = m.engine
    prompt = m.tokenizer.encode("The lighthouse keeper climbed the stairs and looked out at the sea. " * 6)
    first, _ = generate(engine, "a", prompt, 12)
    try:
        r = engine.suspend().result(60)
        assert r.state == "suspended" and r.host_snapshot_bytes > 0 and r.last_suspend.weight_bytes > 0
        with pytest.raises(EngineSuspended):
            engine.submit(PreparedRequest("x", prompt, SamplingParams(temperature=0.0), max_tokens=2))
        r = engine.resume().result(120)
        assert r.state == "resident" and (r.suspends, r.resumes) == (1, 1)
        assert r.last_resume.state_bytes == r.last_suspend.state_bytes and r.last_resume.artifact_read_bytes > 0
        second, final = generate(engine, "b", prompt + first, 12)
        assert final.usage.cached_tokens >= len(prompt)  # the retained conversation's prefix is reused
    finally:
        engine.shutdown()
    # the same two turns on an Engine that was never suspended
    assert_as_never_suspended(load, prompt, 12, first, second, final)


def test_pinned_snapshot_and_host_weights_keep_prefixes_exactly(smollm2_artifact: Path) -> None:
    """--suspend-snapshot pinned (a block for the whole state reserved at load and kept) and
    --suspend-weights host (the stored weights copied to host memory at suspend, read back instead of
    the file): two suspend cycles, then the same two turns as an Engine never suspended."""
    from ninfer.engine.config import SchedulerConfig
    from ninfer.engine.loader import load_engine
    from ninfer.engine.suspend import SuspendOptions

    def load():
        return load_engine(str(smollm2_artifact), backend="torch", scheduler=SchedulerConfig(max_context=1024),
                           announce=False)

    m = load()
    engine = m.engine
    prompt = m.tokenizer.encode("The lighthouse keeper climbed the stairs and looked out at the sea. " * 6)
    try:
        r = engine.configure_suspend(SuspendOptions("pinned", "host")).result(60)
        reserved = r.host_reserved_bytes
        pool = engine.runner.kv.k[0]
        assert reserved == sum(t.numel() * t.element_size() for ts in engine.runner.suspend_caches().values()
                               for t in ts) and reserved >= pool.numel() * pool.element_size()
        first, _ = generate(engine, "a", prompt, 12)
        for cycle in range(2):
            r = engine.suspend().result(60)
            assert r.state == "suspended" and r.host_reserved_bytes == reserved
            state = r.last_suspend.state_bytes
            assert 0 < state < reserved  # only the live pages, into the front of the block
            assert r.last_suspend.artifact_read_bytes > 0  # the weights were copied to host memory
            assert r.host_snapshot_bytes == state + r.last_suspend.artifact_read_bytes  # state + stored weights
            r = engine.resume().result(120)
            assert r.state == "resident" and r.host_snapshot_bytes == 0 and r.host_reserved_bytes == reserved
            assert r.last_resume.state_bytes == state and r.last_resume.artifact_read_bytes == 0  # no file read
        second, final = generate(engine, "b", prompt + first, 12)
        assert final.usage.cached_tokens >= len(prompt)
    finally:
        engine.shutdown()
    assert_as_never_suspended(load, prompt, 12, first, second, final)


def test_suspend_under_spec_mtp_keeps_the_heads_cache(q35_mtp) -> None:
    """--spec mtp: the MTP head's pages are part of the snapshot, so after a resume the next step
    samples and drafts exactly as on a runner that was never suspended (also with an int8 KV cache,
    whose scales travel with the pages, into a reserved block and with host weights)."""
    import torch

    from ninfer.engine.backends.torch_runner import TorchModelRunner
    from ninfer.engine.batch import ScheduledBatch, SequenceWork
    from ninfer.engine.request import SamplingParams
    from ninfer.engine.suspend import HostWeights, reserve

    greedy = SamplingParams(temperature=0.0)
    prompt = [1, 504, 3458, 282, 4649, 314, 253, 1345, 30, 216, 11, 3012, 1183, 77, 301, 19, 2]
    pages = [5, 9, 2, 7]

    def runner(kv_dtype: str) -> TorchModelRunner:
        return TorchModelRunner(q35_mtp[0], num_pages=32, page_size=16, dtype=torch.float32, num_state_slots=2,
                                mtp_draft_tokens=3, kv_dtype=kv_dtype)

    def step(r: TorchModelRunner, tokens: list[int], start: int):
        out = r.run(ScheduledBatch([SequenceWork(seq_id=0, token_ids=tokens, start_pos=start, block_table=pages,
                                                 sample=True, sampling=greedy, state_slot=1)]))
        return out.sampled[0], out.drafts[0]

    for reserved, weights, kv_dtype in ((False, False, "auto"), (True, True, "int8")):
        a, b = runner(kv_dtype), runner(kv_dtype)
        token_a, drafts_a = step(a, prompt, 0)
        assert (token_a, drafts_a) == step(b, prompt, 0)
        block = reserve(a.suspend_caches(), a.device) if reserved else None
        assert block is None or {"mtp_k", "k_scale", "conv"} <= set(block)  # head K/V, int8 scales, state
        host = HostWeights(a.weights_artifact, a.device) if weights else None
        snapshot, state_bytes, weight_bytes = a.release_memory(pages, [1], block)
        assert a.mtp is None and weight_bytes > 0 and state_bytes > 0
        assert a.restore_memory(snapshot, host)[0] == state_bytes
        tokens = [token_a]
        for _ in range(3):  # decode steps read the restored target and head caches
            got, want = step(a, tokens[-1:], len(prompt) + len(tokens) - 1), step(b, tokens[-1:],
                                                                                 len(prompt) + len(tokens) - 1)
            assert got == want
            tokens.append(got[0])


def test_suspend_options_are_checked() -> None:
    from ninfer.errors import ConfigError
    from ninfer.server.config import ServerConfig

    with pytest.raises(ConfigError, match="--suspend-snapshot must be pageable or pinned"):
        ServerConfig(model_suspend=True, suspend_snapshot="locked")
    with pytest.raises(ConfigError, match="--suspend-weights must be artifact or host"):
        ServerConfig(model_suspend=True, suspend_weights="disk")
    with pytest.raises(ConfigError, match="need --model-suspend"):
        ServerConfig(suspend_weights="host")


@pytest.fixture(scope="module")
def suspending(smollm2_artifact: Path, tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("suspend")
    port = free_port()
    log = tmp / "serve.log"
    cmd = [sys.executable, "-m", "ninfer.cli.main", "serve", str(smollm2_artifact), "--model-id", "smol",
           "--model-suspend", "--suspend-snapshot", "pinned", "--suspend-weights", "host", "--max-context", "2048",
           "--port", str(port), "--log-stats-interval-ms", "0"]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 240
    try:
        while "serving" not in log.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
    except BaseException:
        proc.kill()
        raise
    yield url
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0, log.read_text()


CHAT = {"model": "smol", "messages": [{"role": "user", "content": "Tell me about lighthouses."}], "max_tokens": 8,
        "temperature": 0}


def test_suspend_resume_routes_and_auto_resume(suspending: str) -> None:
    url = suspending
    c = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    c.chat.completions.create(**CHAT)
    # the same request again, its prompt from the prefix cache: what a resume must reproduce (a cold
    # prefill and a prefix hit compute the last prompt row on different matmul routes)
    first = c.chat.completions.create(**CHAT)
    assert first.usage.prompt_tokens_details.cached_tokens > 0
    r = httpx.get(url + "/v1/models/smol/residency").json()
    assert r["state"] == "resident" and r["releasable_device_bytes"] > 0 and r["suspend_count"] == 0
    assert r["host_reserved_bytes"] > 0  # --suspend-snapshot pinned: reserved at load
    r = httpx.post(url + "/v1/models/smol/suspend", json={}, timeout=60).json()
    assert r["state"] == "suspended" and r["auto_resume"] is True and r["host_snapshot_bytes"] > 0
    assert r["last_suspend"]["weight_bytes"] > 0
    assert httpx.get(url + "/models").json()["data"][0]["status"]["value"] == "sleeping"
    assert httpx.post(url + "/tokenize", json={"content": "hi"}).status_code == 200  # host work: no wake
    assert httpx.get(url + "/v1/models/smol/residency").json()["state"] == "suspended"
    again = c.chat.completions.create(**CHAT)  # auto_resume: resumed, then run, prefix reused
    assert again.choices[0].message.content == first.choices[0].message.content
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    r = httpx.get(url + "/v1/models/smol/residency").json()
    assert r["state"] == "resident" and r["resume_count"] == 1
    # --suspend-weights host: the suspend read the stored weights into host memory, the resume no file
    assert r["last_suspend"]["artifact_read_bytes"] > 0 and r["last_resume"]["artifact_read_bytes"] == 0
    # auto_resume off: requests fail with 503 and /health reports the server unavailable
    r = httpx.post(url + "/v1/models/smol/suspend", json={"auto_resume": False}, timeout=60).json()
    assert r["state"] == "suspended" and r["auto_resume"] is False
    with pytest.raises(openai.APIStatusError) as e:
        c.chat.completions.create(**CHAT)
    assert e.value.status_code == 503 and e.value.body["code"] == "model_suspended"
    assert httpx.get(url + "/health").status_code == 503
    r = httpx.post(url + "/v1/models/smol/resume", json={}, timeout=120).json()
    assert r["state"] == "resident"
    assert httpx.get(url + "/health").status_code == 200
    assert c.chat.completions.create(**CHAT).choices[0].message.content == first.choices[0].message.content
    r = httpx.post(url + "/v1/models/other/suspend", json={})
    assert r.status_code == 404


def test_suspend_while_a_stream_runs_is_409_model_busy(suspending: str) -> None:
    url = suspending
    c = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    stream = c.chat.completions.create(**{**CHAT, "max_tokens": 64}, stream=True, extra_body={"ignore_eos": True})
    next(iter(stream))
    r = httpx.post(url + "/v1/models/smol/suspend", json={})
    assert r.status_code == 409 and r.json()["error"]["code"] == "model_busy"
    r = httpx.post(url + "/models/sleep", json={"model": "smol"})
    assert r.status_code == 409
    chunks = list(stream)  # never cut
    assert chunks[-1].choices[0].finish_reason == "length"
    assert httpx.get(url + "/v1/models/smol/residency").json()["state"] == "resident"
