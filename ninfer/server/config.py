"""Server-side configuration: transport, auth and the process sampler overrides.

Engine knobs (lanes, queue, prefill, context) live in `SchedulerConfig`; this holds only what
the HTTP layer decides. Validated on construction with the option's name in the message.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from ninfer.errors import ConfigError

LOG_LEVELS = ("trace", "debug", "info", "warning", "error", "critical", "off")


@dataclass(slots=True)
class SamplerOverrides:
    """Process-level sampler flags: preset < these < request fields; `greedy` forces temperature 0."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    greedy: bool = False

    def __post_init__(self) -> None:
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if value is not None and not math.isfinite(value):
                raise ConfigError(f"--{name.replace('_', '-')} must be a finite number")
        if self.temperature is not None and not 0.0 <= self.temperature <= 2.0:
            raise ConfigError("--temperature must be in [0, 2]")
        if self.top_p is not None and not 0.0 <= self.top_p <= 1.0:
            raise ConfigError("--top-p must be in [0, 1]")
        if self.min_p is not None and not 0.0 <= self.min_p <= 1.0:
            raise ConfigError("--min-p must be in [0, 1]")
        if self.top_k is not None and not 0 <= self.top_k <= 20:
            raise ConfigError("--top-k must be in 0..20 (0 selects the top-20 cap)")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if value is not None and not -2.0 <= value <= 2.0:
                raise ConfigError(f"--{name.replace('_', '-')} must be in [-2, 2]")


@dataclass(slots=True)
class ServerConfig:
    """What `ninfer serve` decides beyond the engine: listener, auth, CORS, limits, sampler flags."""

    host: str = "127.0.0.1"
    port: int = 8080
    api_key: str | None = None
    model_id: str | None = None  # None: the artifact's identity.model_id
    strict_model_name: bool = False  # a request naming another model: 404 model_not_found (else served anyway)
    max_request_mib: int = 384
    cors: bool = False
    cors_origins: tuple[str, ...] = ()  # --cors-origin: the origins CORS answers (empty: any)
    usage_chunk_choice: bool = False
    stats_port: int | None = None
    log_level: str = "info"
    default_max_tokens: int | None = None  # reported by /props; the engine applies it
    sampler: SamplerOverrides = field(default_factory=SamplerOverrides)
    structured_output: bool = False  # enforce JSON response formats with a grammar
    unconstrained_response_format: bool = False  # without it: generate JSON-format requests unconstrained
    log_stats_interval_ms: int = 5000  # throughput record interval; 0: none
    log_stats_panel: bool = True  # the statistics panel beneath the log, on an interactive terminal
    request_log_jsonl: str | None = None  # the JSONL measurement log, appended
    request_log_max_mib: int = 0  # rotate the JSONL log at this size (0: one unbounded file)
    request_log_keep: int = 4  # rotated copies kept
    model_suspend: bool = False  # the model may give its memory back while idle (suspend, sleep)
    auto_resume: bool = True  # a request to a suspended model resumes it (else 503)
    suspend_snapshot: str = "pageable"  # where a suspend keeps the retained state: pageable | pinned
    suspend_weights: str = "artifact"  # where a resume reads the weights: artifact | host
    keepalive_seconds: float = 5.0  # SSE ": keep-alive" comment after this long without an event
    model_path: str = ""  # the model argument as given, for /props model_path
    assistant_prefill: bool = False  # a final assistant Chat message is continued in place
    no_thinking: bool = False  # requests that do not decide start without thinking
    default_reasoning_effort: str | None = None  # the effort of requests that name none (none: thinking off)
    preserve_thinking: bool = False  # closed-turn reasoning kept in the prompt by default
    default_thinking_budget: int | None = None  # the cap of a thinking request that names none
    thinking_budget_message: str | None = None  # the early-close guidance instead of the built-in one
    post_thinking: dict[str, float | int] | None = None  # None: off; else the preset overrides (may be {})
    slot_save_path: str | None = None  # --slot-save-path: POST /slots/{id} files live here (None: 501)
    prefix_cache_file: str | None = None  # --prefix-cache-file: saved at stop

    def __post_init__(self) -> None:
        if not self.host:
            raise ConfigError("--host must not be empty")
        if not 1 <= self.port <= 65535:
            raise ConfigError("--port must be in 1..65535")
        if self.stats_port is not None and not 1 <= self.stats_port <= 65535:
            raise ConfigError("--stats-port must be in 1..65535")
        if self.stats_port is not None and self.stats_port == self.port:
            raise ConfigError("--stats-port must differ from --port")
        if self.api_key is not None and not self.api_key.strip():
            raise ConfigError("--api-key must not be empty")
        if self.model_id is not None and not self.model_id.strip():
            raise ConfigError("--model-id must not be empty")
        for origin in self.cors_origins:
            if not re.fullmatch(r"https?://[^/\s]+", origin):
                raise ConfigError(f"--cors-origin {origin!r} must be an origin: scheme://host[:port], no path")
        if not 1 <= self.max_request_mib <= 65536:
            raise ConfigError("--max-request-mib must be in 1..65536")
        if self.log_level not in LOG_LEVELS:
            raise ConfigError(f"--log-level must be one of {', '.join(LOG_LEVELS)}")
        if self.default_max_tokens is not None and self.default_max_tokens < 1:
            raise ConfigError("--default-max-tokens must be >= 1")
        if self.log_stats_interval_ms < 0:
            raise ConfigError("--log-stats-interval-ms must be >= 0 (0 disables the throughput record)")
        if self.request_log_max_mib < 0:
            raise ConfigError("--request-log-max-mib must be >= 0 (0: one unbounded file)")
        if self.request_log_max_mib and self.request_log_jsonl is None:
            raise ConfigError("--request-log-max-mib requires --request-log-jsonl")
        if self.request_log_keep < 0:
            raise ConfigError("--request-log-keep must be >= 0")
        if self.default_thinking_budget is not None and self.default_thinking_budget < 1:
            raise ConfigError("--default-thinking-budget must be a positive integer")
        if self.default_reasoning_effort is not None:
            from ninfer.engine.chat import EFFORTS

            if self.default_reasoning_effort not in EFFORTS:
                raise ConfigError(f"--default-reasoning-effort must be one of {', '.join(EFFORTS)}, "
                                  f"got {self.default_reasoning_effort!r}")
            if self.no_thinking and self.default_reasoning_effort != "none":
                raise ConfigError(f"--default-reasoning-effort {self.default_reasoning_effort} conflicts with "
                                  "--no-thinking (an effort asks for thinking; none is the only effort without it)")
        if self.suspend_snapshot not in ("pageable", "pinned"):
            raise ConfigError(f"--suspend-snapshot must be pageable or pinned, got {self.suspend_snapshot!r}")
        if self.suspend_weights not in ("artifact", "host"):
            raise ConfigError(f"--suspend-weights must be artifact or host, got {self.suspend_weights!r}")
        if (self.suspend_snapshot, self.suspend_weights) != ("pageable", "artifact") and not self.model_suspend:
            raise ConfigError("--suspend-snapshot and --suspend-weights need --model-suspend")
        if self.thinking_budget_message is not None and not self.thinking_budget_message.strip():
            raise ConfigError("--thinking-budget-message must not be empty")
        if not self.keepalive_seconds > 0:
            raise ConfigError("keepalive_seconds must be positive")

    @property
    def max_request_bytes(self) -> int:
        return self.max_request_mib * 1024 * 1024
