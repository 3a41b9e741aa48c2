"""The JSONL request log (server/reqlog.py): the fields of each event, one flushed line per event,
and rotation under --request-log-max-mib / --request-log-keep."""
from __future__ import annotations

import json
from pathlib import Path

from ninfer.engine.request import OutputEvent, PreparedRequest, SamplingParams, Timings, Usage
from ninfer.errors import RequestError
from ninfer.server.reqlog import RequestLog


def lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_request_records_carry_resolved_budget_seed_timings_and_reuse_path(tmp_path: Path) -> None:
    path = tmp_path / "requests.jsonl"
    log = RequestLog(path)
    log.server_start(model="m", artifact="/m.ninfer")
    req = PreparedRequest("r1", [1, 2, 3, 4], SamplingParams(temperature=0.5), max_tokens=None)
    log.request_start(1, "chat", req, stream=True, model="m", max_output_tokens=4092, seed=77, prepare_seconds=0.01)
    # each event is on disk as soon as it is written (flushed), not at close
    assert [r["event"] for r in lines(path)] == ["server_start", "request_start"]
    final = OutputEvent("r1", finish_reason="length", usage=Usage(4, 5, 2),
                        timings=Timings(cache_n=2, prompt_n=2, prompt_ms=30.0, predicted_n=5, predicted_ms=80.0),
                        reuse_path="private_endpoint", queue_wait_seconds=0.25)
    log.request_done(1, "chat", final, 0.5, model="m", prepare_seconds=0.01, ttft_seconds=0.3,
                     result={"tool_call_parse": {"marker_seen": False, "call_count": 0}})
    log.request_error(2, "messages", RequestError("client text here", status=503, code="request_queue_timeout",
                                                  type="service_unavailable"), 1.5)
    log.close()
    records = lines(path)
    assert len({r["server_instance_id"] for r in records}) == 1
    assert all(isinstance(r["timestamp_unix_ms"], int) and r["schema_version"] == 2 for r in records)
    start, done, error = records[1:]
    assert start["requested_output_tokens"] == 4092 and start["requested_max_tokens"] is None
    assert start["sampler"]["seed"] == 77 and start["sampler"]["seed_requested"] is False
    assert start["model"] == "m" and start["prepare_seconds"] == 0.01
    assert done["prefix_reuse_path"] == "private_endpoint"
    assert done["result"]["tool_call_parse"] == {"marker_seen": False, "call_count": 0}
    assert done["timings_seconds"] == {"prepare": 0.01, "ttft": 0.3, "prefill": 0.03, "decode": 0.08, "total": 0.5}
    assert done["engine_timing"] == {"queue_wait_seconds": 0.25}
    assert done["result"]["computed_prefill_tokens"] == 2 and done["result"]["completion_tokens"] == 5
    assert (error["status"], error["code"]) == (503, "request_queue_timeout")
    assert "client text here" not in path.read_text()  # client-supplied messages are never recorded


def test_rotation_keeps_the_newest_files_each_starting_with_server_start(tmp_path: Path) -> None:
    path = tmp_path / "requests.jsonl"
    log = RequestLog(path, max_bytes=2000, keep=2)
    log.server_start(model="a")
    log.server_start(model="b")
    log.forget_model("b")  # unloaded: a rotated file repeats only a's start
    err = RequestError("x", status=400, code="invalid_value", param="max_tokens")
    for _ in range(60):
        log.request_rejected("chat", err)
    log.close()
    rotated = [path, Path(f"{path}.1"), Path(f"{path}.2")]
    assert all(p.exists() for p in rotated) and not Path(f"{path}.3").exists()
    for p in rotated:
        assert p.stat().st_size <= 2000
    for p in (path, Path(f"{path}.1")):  # files begun by a rotation
        records = lines(p)
        assert records[0]["event"] == "server_start" and records[0]["model"] == "a"
        assert [r["event"] for r in records[1:]] == ["request_rejected"] * (len(records) - 1)
    total = sum(sum(r["event"] == "request_rejected" for r in lines(p)) for p in rotated)
    assert total < 60  # the oldest file was dropped


def test_keep_zero_keeps_only_the_current_file(tmp_path: Path) -> None:
    path = tmp_path / "requests.jsonl"
    log = RequestLog(path, max_bytes=1000, keep=0)
    log.server_start(model="a")
    for _ in range(30):
        log.request_rejected("chat", RequestError("x", status=400, code="invalid_value"))
    log.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["requests.jsonl"]
    assert lines(path)[0]["event"] == "server_start"
