"""What the server knows at runtime: the loaded model once warm, ingress and outcome counters.

Everything here is touched only from the asyncio thread (the engine publishes its own counters
as snapshots), so plain ints need no lock.
"""
from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ninfer.engine.request import SamplingParams
from ninfer.errors import RequestError
from ninfer.server.config import ServerConfig
from ninfer.server.reqlog import RequestLog
from ninfer.server.response_store import ResponseStore

if TYPE_CHECKING:
    from ninfer.engine.loader import LoadedModel


@dataclass(slots=True)
class ServerState:
    """Readiness, the loaded model and the HTTP-side counters /v1/load, /stats and /metrics read."""

    config: ServerConfig
    names: tuple[str, ...] = ()  # the names a router resolves to this model (its id and aliases)
    log_name: str | None = None  # a router's model: named in its request records
    started_at: float = field(default_factory=time.monotonic)
    loaded: LoadedModel | None = None
    ready_at: float | None = None  # monotonic time warm-up ended
    ready_unix: float = 0.0
    base_sampling: SamplingParams = field(default_factory=SamplingParams)  # preset + process flags
    # ingress: generation requests from preparation until their response is released
    admitted: int = 0
    peak_admitted: int = 0
    requests_total: int = 0  # completed with an outcome
    requests_failed: int = 0  # accepted, then ended in an error
    requests_rejected: int = 0  # rejected during preparation
    token_counts: int = 0  # token-count requests (count_tokens, input_tokens) running now
    responses: ResponseStore = field(default_factory=ResponseStore)  # stored OpenAI Responses
    grammars: Any = None  # grammar.JsonGrammars with --structured-output
    _tool_grammars: Any = None  # grammar.JsonGrammars for forced tool calls, built on first use
    reqlog: RequestLog = field(default_factory=RequestLog)  # req#N records (and the JSONL log when asked)
    # /slots digests by cache entry id (an entry's tokens never change): (session, then one per
    # checkpoint: its page checkpoints, ascending, then the endpoint)
    slot_digests: dict[int, tuple[str, ...]] = field(default_factory=dict)
    # /slots params: of each request in the engine (by request id), and of the last request whose
    # session each cell retained
    running_params: dict[str, dict[str, Any]] = field(default_factory=dict)
    slot_params: dict[int, dict[str, Any]] = field(default_factory=dict)
    slot_lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # one POST /slots/{id} action at a time

    @property
    def ready(self) -> bool:
        return self.loaded is not None

    @property
    def model_id(self) -> str:
        assert self.loaded is not None
        return self.config.model_id or self.loaded.model_id

    def resolve_model(self, name: str) -> str:
        """The public model id a request's (non-empty) model name selects. A single-model server
        answers any name with its one model, as llama-server does (clients configured for a hosted
        API send names such as gpt-4o); --strict-model-name answers another name 404
        model_not_found. A router's pool resolved the name before (ModelPool.resolve: 404 for an
        unknown one), so there it is one of this model's names."""
        served = self.model_id
        if name != served and name not in self.names and self.config.strict_model_name:
            raise RequestError(f"The model {name!r} does not exist; this server serves {served!r}",
                               param="model", code="model_not_found", status=404)
        return served

    @property
    def max_admitted(self) -> int:
        snap = self.loaded.engine.snapshot() if self.loaded is not None else None
        return (snap.max_concurrency + snap.max_pending_requests) if snap is not None else 0

    def uptime(self) -> float:
        return time.monotonic() - self.ready_at if self.ready_at is not None else 0.0

    def set_ready(self, loaded: LoadedModel) -> None:
        """Publish the warm model; from here on every route serves."""
        self.base_sampling = base_sampling(loaded, self.config)
        if self.config.model_suspend:  # --suspend-snapshot pinned reserves its block now
            from ninfer.engine.suspend import SuspendOptions

            loaded.engine.configure_suspend(SuspendOptions(self.config.suspend_snapshot,
                                                           self.config.suspend_weights)).result()
        if self.config.structured_output:
            from ninfer.engine.grammar import JsonGrammars  # xgrammar loads only when asked for
            self.grammars = JsonGrammars(loaded.tokenizer, loaded.facts.logits_size)
        self.ready_unix = time.time()
        self.ready_at = time.monotonic()
        self.loaded = loaded

    def tool_grammars(self) -> Any:
        """The grammar compiler forced tool calls use (the --structured-output one when there is one)."""
        if self.grammars is not None:
            return self.grammars
        if self._tool_grammars is None:
            from ninfer.engine.grammar import JsonGrammars  # xgrammar loads only when asked for
            self._tool_grammars = JsonGrammars(self.loaded.tokenizer, self.loaded.facts.logits_size)
        return self._tool_grammars

    def reject(self, protocol: str, err: RequestError) -> None:
        """Count and log a request refused before it reached the engine (or by its submit)."""
        self.requests_rejected += 1
        self.reqlog.request_rejected(protocol, err)

    def enter(self, protocol: str) -> None:
        """Take one ingress place for a generation request, or raise 429 server_overloaded."""
        if self.admitted >= self.max_admitted:
            err = RequestError("the server is at capacity; retry later", status=429,
                               code="server_overloaded", type="server_error")
            self.reject(protocol, err)
            raise err
        self.admitted += 1
        self.peak_admitted = max(self.peak_admitted, self.admitted)

    def leave(self) -> None:
        self.admitted -= 1

    @contextlib.contextmanager
    def counting_tokens(self) -> Iterator[None]:
        """One place of the token-count capacity (the same size as the generation ingress, kept
        apart from it), or 429 server_overloaded. Token counts are not measurement requests, so
        a refusal is not counted as a rejected generation request."""
        if self.token_counts >= self.max_admitted:
            raise RequestError("the server is at capacity for token counts; retry later", status=429,
                               code="server_overloaded", type="server_error")
        self.token_counts += 1
        try:
            yield
        finally:
            self.token_counts -= 1


def base_sampling(loaded: LoadedModel, config: ServerConfig) -> SamplingParams:
    """The model's preset under the process flags: what a request that names no sampler field gets."""
    presets = loaded.facts.sampler_presets
    preset = presets.get("non_thinking") or presets.get("default") or presets.get("thinking") or {}
    values: dict[str, Any] = {}
    for name in ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty"):
        if name in preset:
            values[name] = int(preset[name]) if name == "top_k" else float(preset[name])
    o = config.sampler
    for name in ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty", "seed"):
        value = getattr(o, name)
        if value is not None:
            values[name] = value
    if o.greedy:
        values["temperature"] = 0.0
    return SamplingParams(**values)
