"""Operational records: the request lifecycle and the fixed-interval throughput line on stderr
(through `logging`, so --log-level filters them), and the same events at full precision in the
JSONL measurement log (--request-log-jsonl). No record holds prompts, generated text, request
bodies, credentials or client-supplied error text: a rejection is logged by status, code and field.
"""
from __future__ import annotations

import itertools
import logging
import threading
import time
import uuid
from pathlib import Path
from typing import IO, Any

import orjson

from ninfer.engine.request import OutputEvent, PreparedRequest
from ninfer.errors import RequestError
from ninfer.server.panel import SessionStats
from ninfer.version import version_string

log = logging.getLogger("ninfer.server")
SCHEMA = "ninfer_serve_request_log"
SCHEMA_VERSION = 2


class RequestLog:
    """Numbers requests (req#N) and writes their records; safe from any thread.

    path: the JSONL file (None: stderr records only), appended and flushed per event. max_bytes:
    rotate once the file reaches this size (0: never): FILE -> FILE.1 -> ... -> FILE.<keep>, the
    oldest dropped, and the new file starts with the server_start record(s) of the running models."""

    def __init__(self, path: Path | None = None, max_bytes: int = 0, keep: int = 4) -> None:
        self.instance_id = uuid.uuid4().hex
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._path = path
        self._max_bytes = max_bytes
        self._keep = keep
        self._file: IO[bytes] | None = path.open("ab") if path is not None else None
        self._size = self._file.tell() if self._file is not None else 0
        self._starts: dict[str, bytes] = {}  # model -> its latest server_start line (repeated after a rotation)
        self.stats = SessionStats()  # what the statistics panel shows

    def next_id(self) -> int:
        return next(self._ids)

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None

    def _write(self, event: str, **fields: Any) -> None:
        if self._file is None:
            return
        record = {"schema": SCHEMA, "schema_version": SCHEMA_VERSION, "event": event,
                  "timestamp_unix_ms": int(time.time() * 1000), "server_instance_id": self.instance_id, **fields}
        line = orjson.dumps(record) + b"\n"
        with self._lock:
            if self._file is None:
                return
            if event == "server_start":
                self._starts[str(fields.get("model"))] = line
            elif self._max_bytes and self._size + len(line) > self._max_bytes and self._size > 0:
                self._rotate()
            self._file.write(line)
            self._file.flush()
            self._size += len(line)

    def _rotate(self) -> None:
        """FILE -> FILE.1, FILE.n -> FILE.n+1 up to --request-log-keep (the oldest dropped); a new
        FILE starts with the server_start records. Called with the lock held."""
        assert self._file is not None and self._path is not None
        self._file.close()
        path = self._path
        if self._keep <= 0:
            path.unlink(missing_ok=True)
        else:
            Path(f"{path}.{self._keep}").unlink(missing_ok=True)
            for n in range(self._keep - 1, 0, -1):
                older = Path(f"{path}.{n}")
                if older.exists():
                    older.rename(f"{path}.{n + 1}")
            path.rename(f"{path}.1")
        self._file = path.open("ab")
        self._size = 0
        for line in self._starts.values():
            self._file.write(line)
            self._size += len(line)

    # ---- events ----------------------------------------------------------------------------

    def server_start(self, **facts: Any) -> None:
        self._write("server_start", version=version_string(), **facts)

    def forget_model(self, model: str) -> None:
        """A model was unloaded: a rotated file no longer repeats its server_start."""
        with self._lock:
            self._starts.pop(model, None)

    def request_start(self, n: int, protocol: str, req: PreparedRequest, stream: bool, *,
                      model: str | None = None, max_output_tokens: int | None = None, seed: int | None = None,
                      prepare_seconds: float | None = None) -> None:
        """The request was submitted: its sampler and output budget as the engine resolved them
        (the seed drawn when the request named none; the default budget when it named no limit)."""
        s = req.sampling
        budget = req.max_tokens if max_output_tokens is None else max_output_tokens
        log.info("req#%d start %s%s prompt=%d max_tokens=%s%s", n, protocol, f" {model}" if model else "",
                 len(req.prompt_token_ids), budget, " stream" if stream else "")
        self._write("request_start", request_id=n, **({"model": model} if model else {}), protocol=protocol,
                    stream=stream, prompt_tokens=len(req.prompt_token_ids),
                    requested_output_tokens=budget, requested_max_tokens=req.max_tokens,
                    structured_output=req.grammar is not None, prepare_seconds=prepare_seconds,
                    requested_reasoning_effort=req.hints.get("requested_reasoning_effort"),
                    enable_thinking=req.hints.get("thinking"),
                    sampler={"temperature": s.temperature, "top_k": s.top_k, "top_p": s.top_p, "min_p": s.min_p,
                             "presence_penalty": s.presence_penalty, "frequency_penalty": s.frequency_penalty,
                             "seed": s.seed if seed is None else seed, "seed_requested": s.seed is not None})

    def request_done(self, n: int, protocol: str, final: OutputEvent, total_seconds: float, *,
                     model: str | None = None, prepare_seconds: float | None = None,
                     ttft_seconds: float | None = None, result: dict[str, Any] | None = None) -> None:
        """`result`: protocol fields added to the result (a chat request's tool_call_parse).
        timings_seconds: prepare (arrival to submission), ttft (submission to the first token),
        prefill (admission to the first token), decode (first to last token), total (submission
        to the end); engine_timing.queue_wait_seconds: submission to admission."""
        self.stats.done(final, model)
        u, t = final.usage, final.timings
        prompt, out, cached = (u.prompt_tokens, u.completion_tokens, u.cached_tokens) if u else (0, 0, 0)
        rates = ""
        if t is not None:
            rates = (f" ttft={t.prompt_ms:.0f}ms prefill={t.prompt_per_second:.1f}tok/s"
                     f" decode={t.predicted_per_second:.1f}tok/s")
        spec = final.speculative
        if spec is not None and spec["drafted_tokens"]:
            rates += f" {spec['backend']}={spec['accepted_tokens']}/{spec['drafted_tokens']}"
        # the reuse path and, when a prefix was reused, the tier it came from (device, host, disk)
        reuse = f" reuse={final.reuse_path}" + (f"@{final.reuse_tier}" if final.reuse_tier else "") \
            if final.reuse_path else ""
        log.info("req#%d done %s%s %s prompt=%d cached=%d%s out=%d%s total=%.2fs", n, protocol,
                 f" {model}" if model else "", final.finish_reason, prompt, cached, reuse, out, rates, total_seconds)
        extra = {"speculative": spec} if spec is not None else {}
        self._write("request_done", request_id=n, **({"model": model} if model else {}), protocol=protocol, **extra,
                    result={"finish_reason": final.finish_reason, "prompt_tokens": prompt, "completion_tokens": out,
                            "cached_tokens": cached, "computed_prefill_tokens": prompt - cached,
                            "reasoning_tokens": u.reasoning_tokens if u else 0,
                            "post_thinking_sampling": final.post_thinking_sampling, **(result or {})},
                    prefix_reuse_path=final.reuse_path, prefix_reuse_tier=final.reuse_tier,
                    timings_seconds={"prepare": prepare_seconds, "ttft": ttft_seconds,
                                     "prefill": t.prompt_ms / 1e3 if t else None,
                                     "decode": t.predicted_ms / 1e3 if t else None, "total": total_seconds},
                    engine_timing={"queue_wait_seconds": final.queue_wait_seconds})

    def request_rejected(self, protocol: str, err: RequestError) -> None:
        self.stats.reject()
        log.info("request rejected %s: %d %s%s", protocol, err.status, err.code or err.type,
                 f" ({err.param})" if err.param else "")
        self._write("request_rejected", protocol=protocol, phase="prepare", status=err.status, type=err.type,
                    code=err.code, param=err.param)

    def request_error(self, n: int, protocol: str, err: RequestError, total_seconds: float, *,
                      model: str | None = None) -> None:
        self.stats.error(cancelled=err.code == "client_closed")
        log.warning("req#%d error %s%s: %d %s after %.2fs", n, protocol, f" {model}" if model else "", err.status,
                    err.code or err.type, total_seconds)
        self._write("request_error", request_id=n, **({"model": model} if model else {}), protocol=protocol,
                    status=err.status, code=err.code, type=err.type, total_seconds=total_seconds)

    def throughput(self, before: Any, after: Any, seconds: float, model: str | None = None) -> None:
        """One reporting interval of `seconds` between two engine snapshots (of `model`, on a
        router); idle ones are omitted."""
        prefill = after.computed_prefill_tokens - before.computed_prefill_tokens
        decode = after.committed_decode_tokens - before.committed_decode_tokens
        rounds = after.decode_rounds - before.decode_rounds
        row_rounds = after.decode_row_rounds - before.decode_row_rounds
        if seconds <= 0 or not (prefill or decode or after.running or after.waiting):
            return
        batch = row_rounds / rounds if rounds else 0.0
        log.info("throughput%s: prefill %d tok (%.1f tok/s) decode %d tok (%.1f tok/s) batch %.2f running %d waiting %d",
                 f" {model}" if model else "", prefill, prefill / seconds, decode, decode / seconds, batch,
                 after.running, after.waiting)
        self._write("throughput", **({"model": model} if model else {}), interval_seconds=seconds,
                    tokens={"prefill": prefill, "decode": decode},
                    decode_batch={"rounds": rounds, "row_rounds": row_rounds,
                                  "average_size": batch if rounds else None},
                    scheduler={"running": after.running, "prefilling": after.prefilling,
                               "decode_ready": after.decode_ready, "waiting": after.waiting})
