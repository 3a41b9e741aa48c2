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
SCHEMA_VERSION = 1


class RequestLog:
    """Numbers requests (req#N) and writes their records; safe from any thread."""

    def __init__(self, path: Path | None = None) -> None:
        self.instance_id = uuid.uuid4().hex
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._file: IO[bytes] | None = path.open("ab") if path is not None else None
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
            if self._file is not None:
                self._file.write(line)
                self._file.flush()

    # ---- events ----------------------------------------------------------------------------

    def server_start(self, **facts: Any) -> None:
        self._write("server_start", version=version_string(), **facts)

    def request_start(self, n: int, protocol: str, req: PreparedRequest, stream: bool) -> None:
        s = req.sampling
        log.info("req#%d start %s prompt=%d%s%s", n, protocol, len(req.prompt_token_ids),
                 f" max_tokens={req.max_tokens}" if req.max_tokens is not None else "", " stream" if stream else "")
        self._write("request_start", request_id=n, protocol=protocol, stream=stream,
                    prompt_tokens=len(req.prompt_token_ids), requested_output_tokens=req.max_tokens,
                    structured_output=req.grammar is not None,
                    sampler={"temperature": s.temperature, "top_k": s.top_k, "top_p": s.top_p, "min_p": s.min_p,
                             "presence_penalty": s.presence_penalty, "frequency_penalty": s.frequency_penalty,
                             "seed": s.seed})

    def request_done(self, n: int, protocol: str, final: OutputEvent, total_seconds: float) -> None:
        self.stats.done(final)
        u, t = final.usage, final.timings
        prompt, out, cached = (u.prompt_tokens, u.completion_tokens, u.cached_tokens) if u else (0, 0, 0)
        rates = ""
        if t is not None:
            rates = (f" ttft={t.prompt_ms:.0f}ms prefill={t.prompt_per_second:.1f}tok/s"
                     f" decode={t.predicted_per_second:.1f}tok/s")
        spec = final.speculative
        if spec is not None and spec["drafted_tokens"]:
            rates += f" {spec['backend']}={spec['accepted_tokens']}/{spec['drafted_tokens']}"
        log.info("req#%d done %s %s prompt=%d cached=%d out=%d%s total=%.2fs", n, protocol, final.finish_reason,
                 prompt, cached, out, rates, total_seconds)
        extra = {"speculative": spec} if spec is not None else {}
        self._write("request_done", request_id=n, protocol=protocol, **extra,
                    result={"finish_reason": final.finish_reason, "prompt_tokens": prompt, "completion_tokens": out,
                            "cached_tokens": cached, "computed_prefill_tokens": prompt - cached,
                            "reasoning_tokens": u.reasoning_tokens if u else 0,
                            "post_thinking_sampling": final.post_thinking_sampling},
                    timings_seconds={"ttft": t.prompt_ms / 1e3 if t else None,
                                     "decode": t.predicted_ms / 1e3 if t else None, "total": total_seconds})

    def request_rejected(self, protocol: str, err: RequestError) -> None:
        self.stats.reject()
        log.info("request rejected %s: %d %s%s", protocol, err.status, err.code or err.type,
                 f" ({err.param})" if err.param else "")
        self._write("request_rejected", protocol=protocol, phase="prepare", status=err.status, type=err.type,
                    code=err.code, param=err.param)

    def request_error(self, n: int, protocol: str, err: RequestError, total_seconds: float) -> None:
        self.stats.error(cancelled=err.code == "client_closed")
        log.warning("req#%d error %s: %d %s after %.2fs", n, protocol, err.status, err.code or err.type, total_seconds)
        self._write("request_error", request_id=n, protocol=protocol, status=err.status, code=err.code,
                    total_seconds=total_seconds)

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
