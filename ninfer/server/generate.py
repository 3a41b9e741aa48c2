"""Running one PreparedRequest for a protocol adapter: ingress accounting, submission and the
event pump, req#N records, error mapping, and the pieces every protocol encodes (usage, logprob records, session digest)."""
from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from ninfer.engine.digest import session_digest  # noqa: F401 - re-exported for the protocol encoders
from ninfer.engine.errors import EngineError
from ninfer.engine.request import OutputEvent, PreparedRequest, SamplingParams, TokenLogprob, Usage
from ninfer.errors import RequestError
from ninfer.server.errors import http_error
from ninfer.server.http import Call
from ninfer.server.sse import TIMEOUT, EventPump, Timeout
from ninfer.version import version_string


def system_fingerprint() -> str:
    """OpenAI's system_fingerprint: the backend build (llama-server reports its build the same way)."""
    return f"ninfer-{version_string()}"


def new_request_id() -> str:
    return uuid.uuid4().hex[:24]


def sampler_params(s: SamplingParams, max_tokens: int | None = None, stop: list[str] | None = None,
                   ignore_eos: bool = False) -> dict[str, Any]:
    """llama.cpp's generation settings of a request (or, with the process sampler, of the server):
    /completion's generation_settings and each /slots entry's params."""
    return {"n_predict": -1 if max_tokens is None else max_tokens,
            "temperature": s.temperature, "top_k": s.top_k, "top_p": s.top_p, "min_p": s.min_p,
            "presence_penalty": s.presence_penalty, "frequency_penalty": s.frequency_penalty,
            "seed": -1 if s.seed is None else s.seed, "n_probs": s.top_logprobs,
            "stop": list(stop or []), "ignore_eos": ignore_eos}


def request_params(req: PreparedRequest) -> dict[str, Any]:
    return sampler_params(req.sampling, req.max_tokens, req.stop, req.ignore_eos)


def event_error(event: OutputEvent) -> RequestError:
    """The HTTP error for a final event with finish_reason "error"."""
    if event.error == "request_queue_timeout":
        return RequestError("the request was not admitted within --pending-timeout-ms", status=503,
                            code="request_queue_timeout", type="service_unavailable")
    if event.error == "engine_shutdown":
        return RequestError("the server is stopping", status=503, code="service_unavailable",
                            type="service_unavailable")
    return RequestError(f"generation failed: {event.error}", status=500, code="internal_error",
                        type="server_error")


def usage_dict(usage: Usage | None) -> dict[str, Any]:
    u = usage or Usage(0, 0, 0)
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.prompt_tokens + u.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
            "completion_tokens_details": {"reasoning_tokens": u.reasoning_tokens}}


def logprob_records(tokenizer: Any, records: tuple[TokenLogprob, ...] | list[TokenLogprob],
                    top_n: int) -> list[dict[str, Any]]:
    """OpenAI's content logprob records: token text (U+FFFD for partial UTF-8), logprob, bytes, top."""
    out = []
    for r in records:
        raw = tokenizer.token_bytes(r.token_id)
        top = []
        for tid, lp in r.top[:top_n]:
            tb = tokenizer.token_bytes(tid)
            top.append({"token": tb.decode("utf-8", "replace"), "logprob": lp, "bytes": list(tb)})
        out.append({"token": raw.decode("utf-8", "replace"), "logprob": r.logprob, "bytes": list(raw),
                    "top_logprobs": top})
    return out


@dataclass(slots=True)
class Outcome:
    """The aggregate of a finished request."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    final: OutputEvent | None = None


class Generation:
    """One request through the engine. Use as an async context manager: entering takes an
    ingress place (429 when full), leaving releases it and cancels an unfinished request."""

    def __init__(self, call: Call, req: PreparedRequest, stream: bool = False, ingress: bool = True,
                 observe: Callable[[OutputEvent], Any] | None = None,
                 result_fields: Callable[[], dict[str, Any]] | None = None) -> None:
        self.call = call
        self.req = req
        self.stream = stream
        self.ingress = ingress  # False: one of several engine requests of one HTTP request (fanout.py)
        # observe: sees each event before it is logged (its return value is `observed` while the
        # event is yielded), so result_fields (the request_done.result additions) can describe the final one
        self.observe = observe
        self.observed: Any = None
        self.result_fields = result_fields
        self.protocol = str(req.hints.get("protocol", ""))
        self.created = int(time.time())
        self._pump: EventPump | None = None
        self._entered = False
        self._n = 0  # req#N once submitted
        self._t0 = time.monotonic()

    async def __aenter__(self) -> Generation:
        if self.ingress:
            self.call.state.enter(self.protocol)
            self._entered = True
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._pump is not None and not self._pump.done:  # the client went away first
            self._pump.close()
            state = self.call.state
            state.requests_total += 1  # it ended, in an error: 499 client_closed
            state.requests_failed += 1
            state.reqlog.request_error(
                self._n, self.protocol, RequestError("the client disconnected", status=499, code="client_closed"),
                time.monotonic() - self._t0, model=state.log_name)
        self.call.state.running_params.pop(self.req.request_id, None)
        if self._entered:
            self.call.state.leave()

    async def events(self, keepalive: float | None) -> AsyncIterator[OutputEvent | Timeout]:
        """Yield events (TIMEOUT after `keepalive` s without one). A final error event raises
        RequestError; submission errors (429, context_length_exceeded) raise too, mapped."""
        state = self.call.state
        assert state.loaded is not None
        engine = state.loaded.engine
        pump = EventPump(engine, self.req.request_id)
        try:
            handle = engine.submit(self.req, pump.sink)
        except EngineError as e:
            err = http_error(e)
            state.reject(self.protocol, err)
            raise err
        self._pump = pump
        state.running_params[self.req.request_id] = request_params(self.req)  # /slots of its lane
        self._n = state.reqlog.next_id()
        self._t0 = time.monotonic()  # submission: ttft and total count from here
        prepare = self._t0 - self.call.received_at
        state.reqlog.request_start(self._n, self.protocol, self.req, self.stream, model=state.log_name,
                                   max_output_tokens=handle.max_output_tokens, seed=handle.seed,
                                   prepare_seconds=prepare)
        heard = False  # an engine event arrived: the request was admitted
        ttft: float | None = None
        while (item := await pump.next(keepalive)) is not None:
            if item is TIMEOUT and not heard and not self._in_a_lane():
                # Queued: no keep-alive yet, so the response has not started and a queue timeout is
                # still answered with its status (503, 504 on Messages), as the spec writes it. A
                # dead peer meanwhile is found by TCP keepalive (server/runner.py).
                continue
            if item is not TIMEOUT:
                heard = True
                assert isinstance(item, OutputEvent)
                if self.observe is not None and item.finish_reason != "error":
                    self.observed = self.observe(item)
                if ttft is None and item.token_ids:
                    ttft = time.monotonic() - self._t0
                if item.finish_reason is not None:
                    state.requests_total += 1
                    params = state.running_params.pop(self.req.request_id, None)
                    if item.slot_id is not None and params is not None:  # the cell its session went to
                        state.slot_params[item.slot_id] = params
                    elapsed = time.monotonic() - self._t0
                    if item.finish_reason == "error":
                        state.requests_failed += 1
                        err = event_error(item)
                        state.reqlog.request_error(self._n, self.protocol, err, elapsed, model=state.log_name)
                        raise err
                    state.reqlog.request_done(self._n, self.protocol, item, elapsed, model=state.log_name,
                                              prepare_seconds=prepare, ttft_seconds=ttft,
                                              result=self.result_fields() if self.result_fields else None)
            yield item

    def _in_a_lane(self) -> bool:
        """Whether the engine's latest snapshot shows this request admitted to a lane."""
        snap = self.call.state.loaded.engine.snapshot()
        return any(lane.request_id == self.req.request_id for lane in snap.lanes)

    async def collect(self) -> Outcome:
        """Run to the end without streaming."""
        out = Outcome()
        async for event in self.events(None):
            assert isinstance(event, OutputEvent)
            out.text += event.text
            out.token_ids.extend(event.token_ids)
            out.logprobs.extend(event.logprobs)
            if event.finish_reason is not None:
                out.final = event
        return out


def prompt_progress(event: OutputEvent, with_timings: bool) -> dict[str, Any] | None:
    """The spec's prompt-processing record for a progress event (None for any other event):
    prompt_progress with integral time_ms, plus the prompt-only timings when asked."""
    p = event.progress
    if p is None:
        return None
    piece: dict[str, Any] = {"prompt_progress": {"total": p.total, "cache": p.cache, "processed": p.processed,
                                                 "time_ms": int(p.elapsed_ms)}}
    if with_timings and event.timings is not None:
        piece["timings"] = event.timings.to_dict()
    return piece


def slot_extras(event: OutputEvent, session: list[int]) -> dict[str, Any]:
    """id_slot and session_digest of a final event whose session the context cache retained
    (empty when it retained none: no slot holds it, so no digest identifies one)."""
    if event.slot_id is None:
        return {}
    return {"id_slot": event.slot_id, "session_digest": session_digest(session)}
