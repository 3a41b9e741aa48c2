"""The one internal request type, its sampling parameters, and the events the engine emits.

A protocol adapter builds a `PreparedRequest` (token ids, sampling, stops, budget); the engine
never sees JSON. The engine answers with `OutputEvent`s, in order, the last one with
`finish_reason` set.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from ninfer.engine.errors import InvalidRequest

TOP_K_CAP = 20  # the sampler's candidate domain (spec: top_k above 20 is clamped to 20)
MAX_TOP_LOGPROBS = 20


@dataclass(slots=True)
class SamplingParams:
    """Per-request sampler settings. temperature <= 0 selects greedy argmax."""

    temperature: float = 1.0
    top_k: int = TOP_K_CAP  # 0 or below: the widest set, 20; above 20: clamped to 20
    top_p: float = 1.0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None  # None or negative: a random seed
    logprobs: bool = False
    top_logprobs: int = 0  # alternatives per position, 0..20

    def __post_init__(self) -> None:
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise InvalidRequest(f"{name} must be a finite number", field=name)
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int):
            raise InvalidRequest("top_k must be an integer", field="top_k")
        self.top_k = TOP_K_CAP if self.top_k <= 0 else min(self.top_k, TOP_K_CAP)
        if not 0.0 <= self.top_p <= 1.0:
            raise InvalidRequest("top_p must be in [0, 1]", field="top_p")
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidRequest("min_p must be in [0, 1]", field="min_p")
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidRequest(f"top_logprobs must be in 0..{MAX_TOP_LOGPROBS}", field="top_logprobs")
        if self.seed is not None and self.seed < 0:
            self.seed = None

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


POOLINGS = ("mean", "last", "cls")


@dataclass(slots=True)
class PreparedRequest:
    """What the engine runs. `max_tokens` None means the default output limit."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    max_tokens: int | None = None
    stop: list[str] = field(default_factory=list)  # stop strings, withheld from output
    stop_token_ids: list[int] = field(default_factory=list)  # extra stop tokens (model's EOS added by the engine)
    grammar: Any = None  # structured output: a grammar.Grammar the output must follow
    ignore_eos: bool = False
    cache_prompt: bool = True  # False keeps the request out of the context cache
    retain: bool = True  # False: it may reuse a cached prefix but its own KV is not retained (a rerank judgement)
    # a one-token request that may share a prefill unit with others like it (a rerank judgement;
    # embeddings always may)
    batch_prefill: bool = False
    raw_prompt: bool = False  # a raw (non-chat) prompt: long ones keep a one-short checkpoint
    hints: dict[str, Any] = field(default_factory=dict)  # protocol hints the engine passes through
    reasoning: Any = None  # a chat request's reasoning.ReasoningSpec: split <think> output (None: no split)
    # an embedding: the final normed hidden states of the prompt pooled "mean", "last" or "cls" (the
    # first position), handed back on the final event (the prompt runs whole: no prefix reuse)
    pooling: str | None = None

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise InvalidRequest("the prompt is empty", field="prompt")
        if self.max_tokens is not None and self.max_tokens < 0:
            raise InvalidRequest("max_tokens must be >= 0", field="max_tokens")
        if self.pooling not in (None, *POOLINGS):
            raise InvalidRequest(f"pooling must be one of {', '.join(POOLINGS)}", field="pooling")


@dataclass(slots=True, frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob), most likely first


@dataclass(slots=True, frozen=True)
class Timings:
    """The spec's `timings` object (llama.cpp's names).

    A prompt-phase snapshot (a prompt-progress event) sets `prompt_processed_n`, the suffix
    tokens computed so far: prompt_n stays the whole suffix while the prompt rates span only
    what was processed. Generation rates use max(predicted_n - 1, 0) intervals: the first token
    belongs to prompt latency."""

    cache_n: int
    prompt_n: int
    prompt_ms: float
    predicted_n: int
    predicted_ms: float
    prompt_processed_n: int | None = None  # None: the prompt is done (rates span prompt_n)
    draft_n: int = 0  # speculative decoding: draft tokens verified, and those accepted
    draft_n_accepted: int = 0

    @property
    def _prompt_rate_n(self) -> int:
        return self.prompt_n if self.prompt_processed_n is None else self.prompt_processed_n

    @property
    def prompt_per_second(self) -> float:
        return self._prompt_rate_n / (self.prompt_ms / 1e3) if self.prompt_ms > 0 else 0.0

    @property
    def predicted_per_second(self) -> float:
        intervals = max(self.predicted_n - 1, 0)
        return intervals / (self.predicted_ms / 1e3) if self.predicted_ms > 0 else 0.0

    def to_dict(self) -> dict[str, float | int]:
        n_prompt = self._prompt_rate_n
        intervals = max(self.predicted_n - 1, 0)
        drafts = {"draft_n": self.draft_n, "draft_n_accepted": self.draft_n_accepted} if self.draft_n else {}
        return {
            "cache_n": self.cache_n,
            "prompt_n": self.prompt_n,
            "prompt_ms": self.prompt_ms,
            "prompt_per_token_ms": self.prompt_ms / n_prompt if n_prompt else 0.0,
            "prompt_per_second": self.prompt_per_second,
            "predicted_n": self.predicted_n,
            "predicted_ms": self.predicted_ms,
            "predicted_per_token_ms": self.predicted_ms / intervals if intervals else 0.0,
            "predicted_per_second": self.predicted_per_second,
        } | drafts


@dataclass(slots=True, frozen=True)
class PromptProgress:
    """Where a request's prompt processing stands: `processed` counts the reused prefix
    (`cache`) plus the suffix tokens computed so far; elapsed_ms runs from committed admission."""

    total: int
    cache: int
    processed: int
    elapsed_ms: float


@dataclass(slots=True, frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    reasoning_tokens: int = 0  # output tokens accepted while the reasoning channel was open


@dataclass(slots=True, frozen=True)
class OutputEvent:
    """One step of a request's output. `text` is the newly committed text (stop strings withheld).

    finish_reason: None while running; "stop" (EOS, stop token or stop string), "length"
    (output budget or context capacity), "cancelled", or "error". A request submitted with
    hints["return_progress"] also gets token-less events with `progress` set: one at admission
    (processed == cache) and one after each prefill unit, the last (processed == total) just
    before the first output event.
    """

    request_id: str
    token_ids: tuple[int, ...] = ()
    text: str = ""  # the answer (content channel)
    reasoning: str = ""  # newly committed reasoning text (requests with a ReasoningSpec)
    logprobs: tuple[TokenLogprob, ...] = ()
    finish_reason: str | None = None
    stop_reason: str | int | None = None  # the matched stop string or stop token id
    usage: Usage | None = None  # on the final event
    timings: Timings | None = None  # final and first output events; every event with hints["timings_per_token"]
    speculative: dict[str, Any] | None = None  # final event under --spec: the request log's speculative object
    error: str | None = None
    progress: PromptProgress | None = None  # a prompt-progress event (hints["return_progress"]): no tokens
    slot_id: int | None = None  # final event: the context-cache slot the session was retained in
    post_thinking_sampling: bool = False  # final event: the sampler switched after the reasoning closed
    reuse_path: str | None = None  # final event: the context-cache path admission took (root, ...)
    queue_wait_seconds: float | None = None  # final event: submission to admission (None: never admitted)
    embedding: Any = None  # final event of a request with `pooling`: float32 [hidden] on the CPU
    reuse_tier: str | None = None  # final event: the tier its reused prefix came from (device, host, disk)
