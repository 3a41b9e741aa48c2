"""Engine counters: a mutable accumulator the worker thread owns, and the immutable snapshot it
publishes at every step boundary (one reference swap). /v1/load, /stats, /metrics, /slots and
the panel read snapshots only, so they never wait on the engine."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True, frozen=True)
class LaneInfo:
    """One occupied execution lane."""

    lane: int
    request_id: str
    prefilling: bool
    n_prompt_tokens: int
    n_cached_tokens: int  # prompt tokens reused from the context cache
    n_computed_tokens: int
    n_output_tokens: int
    reuse_path: str


@dataclass(slots=True, frozen=True)
class ContinuationInfo:
    """One retained private continuation (a /slots cell)."""

    entry_id: int
    n_tokens: int  # tokens whose KV it holds (its executed frontier)
    n_pages: int
    slot: int  # its stable cell, 0..max_private_continuations-1
    session: tuple[int, ...] = ()  # the retained session's token ids (the entry's own tuple, not a copy)
    state_slot: int = -1  # hybrid models: the state slot of its checkpoint at n_tokens; -1 without recurrent state
    # hybrid models: (position, state slot) of its page checkpoints below n_tokens, ascending
    page_checkpoints: tuple[tuple[int, int], ...] = ()


@dataclass(slots=True, frozen=True)
class QueueEntry:
    request_id: str
    position: int
    submitted_at: float  # time.monotonic() at submit; wait = now - submitted_at


@dataclass(slots=True, frozen=True)
class EngineSnapshot:
    """Everything the ops endpoints report, as of one step boundary. Counters are monotonic
    since the engine started; derive rates by differencing two snapshots."""

    published_at: float  # time.monotonic()
    # capacity (fixed)
    max_concurrency: int
    max_pending_requests: int
    max_context: int
    kv_capacity_tokens: int
    kv_capacity_pages: int
    kv_page_tokens: int
    max_private_continuations: int
    # requests
    admitted: int  # submitted, final event not yet emitted
    peak_admitted: int
    running: int
    prefilling: int
    decode_ready: int
    waiting: int
    # occupancy (retained continuations included)
    kv_pages_used: int
    kv_tokens_used: int
    retained_continuations: int
    # counters
    computed_prefill_tokens: int = 0  # prefix-reused tokens excluded
    committed_decode_tokens: int = 0  # tokens sampled by decode rounds (first tokens excluded)
    reused_prompt_tokens: int = 0
    decode_rounds: int = 0
    decode_row_rounds: int = 0
    prefill_units: int = 0
    prompt_tokens_total: int = 0  # llamacpp:prompt_tokens_total
    prompt_seconds_total: float = 0.0
    predicted_tokens_total: int = 0  # llamacpp:tokens_predicted_total: every generated token
    max_sequence_tokens: int = 0  # llamacpp:n_tokens_max: the most tokens one sequence held in the KV cache
    predicted_seconds_total: float = 0.0
    requests_finished: int = 0  # ended with stop or length
    requests_cancelled: int = 0
    requests_failed: int = 0  # ended with an error (queue timeout included)
    requests_rejected: int = 0  # refused at submit: overload or a prompt over the context
    waiting_expired: int = 0  # reached --pending-timeout-ms before admission
    waiting_cancelled: int = 0  # cancelled by the client while waiting for admission
    waiting_abandoned_seconds: float = 0.0  # how long those cancelled and expired requests had waited
    cancelled_prefills: int = 0  # cancelled while their prompt prefilled
    cancelled_prefill_computed_tokens: int = 0  # prompt tokens those had computed
    cancelled_prefills_salvaged: int = 0  # cancelled prefills the context cache kept (none yet: never retained)
    engine_recoveries: int = 0  # runner failures that failed only the lanes while the engine kept serving
    context_cache_exhausted: int = 0  # failed for want of a context-cache placement (none: admission waits)
    prefix_cache_hit_tokens: int = 0  # cached tokens of completed requests
    context_selections: dict[str, int] = field(default_factory=dict)  # reuse path -> admissions
    # recurrent-state slots (hybrid models; both 0 for a pure-attention model): working slots of
    # admitted requests plus checkpoints of retained continuations
    state_slots_total: int = 0
    state_slots_used: int = 0
    # speculative decoding (--spec): the backend, verify rounds (rows that carried drafts), drafts
    # verified and accepted, and decode steps a request took without drafts while backing off
    spec_method: str | None = None
    spec_rounds: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    spec_fallback_steps: int = 0
    completed_drafted_tokens: int = 0
    completed_accepted_tokens: int = 0
    completed_drafted_tokens: int = 0  # the same two counts over requests that have finished
    completed_accepted_tokens: int = 0
    tiers: Any = None  # tiers.TierGauges: pages, bytes, sessions, hits and misses per tier
    lanes: tuple[LaneInfo, ...] = ()
    continuations: tuple[ContinuationInfo, ...] = ()
    queue: tuple[QueueEntry, ...] = ()  # the first 16 waiting, in submission order


@dataclass(slots=True)
class EngineCounters:
    """The worker thread's running totals (mutated only on that thread)."""

    computed_prefill_tokens: int = 0
    committed_decode_tokens: int = 0
    predicted_tokens: int = 0  # every generated token (first tokens included)
    max_sequence_tokens: int = 0
    reused_prompt_tokens: int = 0
    decode_rounds: int = 0
    decode_row_rounds: int = 0
    prefill_units: int = 0
    prompt_seconds_total: float = 0.0
    predicted_seconds_total: float = 0.0
    requests_finished: int = 0
    requests_cancelled: int = 0
    requests_failed: int = 0
    waiting_expired: int = 0
    waiting_cancelled: int = 0
    waiting_abandoned_seconds: float = 0.0
    cancelled_prefills: int = 0
    cancelled_prefill_computed_tokens: int = 0
    cancelled_prefills_salvaged: int = 0
    engine_recoveries: int = 0
    context_cache_exhausted: int = 0
    prefix_cache_hit_tokens: int = 0
    context_selections: dict[str, int] = field(default_factory=dict)
    spec_rounds: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    spec_fallback_steps: int = 0
    completed_drafted_tokens: int = 0
    completed_accepted_tokens: int = 0
