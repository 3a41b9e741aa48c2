"""The Engine: one worker thread per model that owns the runner, the scheduler and the pages.

submit() and cancel() are safe from any thread: they hand work to the worker through a locked
inbox and return at once. The worker loop is schedule -> runner.run -> scheduler.update ->
output processing; each request's events go to its sink (a blocking RequestHandle, or an
asyncio queue fed with loop.call_soon_threadsafe). Counters are published as an immutable
EngineSnapshot at every step boundary.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import random
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from itertools import count
from typing import TYPE_CHECKING, Any

from ninfer.engine.batch import ModelRunner, ScheduledBatch, StepOutput
from ninfer.engine.config import MemoryConfig, SchedulerConfig, SpecConfig
from ninfer.engine.counters import (ContinuationInfo, EngineCounters, EngineSnapshot, LaneInfo,
                                    QueueEntry)
from ninfer.engine.kv_cache import PagePool, StatePool
from ninfer.engine.lookup import LookupDrafter, LookupState
from ninfer.engine.mtp_drafter import RunnerDrafter, RunnerDraftState
from ninfer.engine.output import OutputProcessor
from ninfer.engine.reasoning import ReasoningSplitter, effective_budget
from ninfer.engine.sampler import mask_words, single_token_mask
from ninfer.engine.request import OutputEvent, PreparedRequest, PromptProgress, Timings, TokenLogprob, Usage
from ninfer.engine.scheduler import Scheduler, Sequence, SeqStatus, derive_output_limit
from ninfer.engine import suspend as suspend_mod
from ninfer.engine.errors import (ContextLengthExceeded, DuplicateRequest, EngineNotRunning, EngineOverloaded,
                                  EngineSuspended)
from ninfer.errors import ConfigError
from ninfer.engine.tiers import ContextTiers
from ninfer.engine.transfer import TensorMover

if TYPE_CHECKING:
    from ninfer.engine.tokenizer import Tokenizer

Sink = Callable[[OutputEvent], None]
log = logging.getLogger("ninfer.engine")
QUEUE_REPORT = 16  # waiting requests listed in a snapshot


@dataclass(slots=True, eq=False)
class _Live:
    """Engine-side state of one submitted request (touched only by the worker after submit)."""

    req: PreparedRequest
    seq: Sequence
    proc: OutputProcessor
    sink: Sink
    submitted_at: float
    deadline: float | None
    admitted_at: float | None = None  # when admission committed its reuse choice: prompt time starts
    first_token_at: float | None = None
    last_token_at: float | None = None
    logprobs: list[TokenLogprob | None] = field(default_factory=list)  # per published-able token
    logprobs_sent: int = 0
    matcher: Any = None  # structured output: the request's grammar.Matcher
    splitter: ReasoningSplitter | None = None  # a chat request's <think> channel split
    reasoning_tokens: int = 0
    undecided_tokens: int = 0  # leading tokens that may still open <think>
    thinking_budget: int | None = None  # the effective cap (None: none, or not enforceable)
    forced: deque[int] = field(default_factory=deque)  # tokens committed without sampling (early close)
    post_thinking: bool = False  # the sampler switched after the reasoning closed
    tokens_seen: int = 0  # output tokens handed to the output processor
    spec: SpecStats | None = None  # speculative decoding (--spec)
    pooled: Any = None  # an embedding: the pooled hidden state so far (a sum for mean), float32 [hidden]
    reuse_tier: str | None = None  # the tier its reused prefix came from (device, host, disk)


@dataclass(slots=True, eq=False)
class SpecStats:
    """One request's speculative decoding: its drafter state and its counts (request log, timings)."""

    state: LookupState | RunnerDraftState  # the drafter's per-request state
    rounds: int = 0  # verify rounds (decode steps that carried drafts)
    drafted: int = 0
    accepted: int = 0
    accepted_per_position: list[int] = field(default_factory=list)  # [i]: rounds whose draft i+1 survived

    def record(self, drafted: int, accepted: int) -> None:
        self.rounds += 1
        self.drafted += drafted
        self.accepted += accepted
        if len(self.accepted_per_position) < drafted:
            self.accepted_per_position.extend([0] * (drafted - len(self.accepted_per_position)))
        for i in range(accepted):
            self.accepted_per_position[i] += 1

    def to_dict(self, method: str, draft_window: int) -> dict[str, Any]:
        """The request log's `speculative` object."""
        return {"backend": method, "draft_window": draft_window, "rounds": self.rounds,
                "drafted_tokens": self.drafted, "accepted_tokens": self.accepted,
                "fallback_steps": self.state.fallback_steps,
                "accepted_per_position": list(self.accepted_per_position)}


class RequestHandle:
    """A submitted request. Iterating blocks and yields its OutputEvents, the last one with
    `finish_reason` set."""

    __slots__ = ("request_id", "_engine", "_events", "_done", "max_output_tokens", "seed")

    def __init__(self, request_id: str, engine: Engine) -> None:
        self.request_id = request_id
        self.max_output_tokens = 0  # the output budget as resolved at submission (the request log's)
        self.seed = 0  # the sampling seed as resolved (the request's, or a fresh one)
        self._engine = engine
        self._events: queue.SimpleQueue[OutputEvent] = queue.SimpleQueue()
        self._done = False

    def _put(self, event: OutputEvent) -> None:
        self._events.put(event)

    def __iter__(self) -> Iterator[OutputEvent]:
        while not self._done:
            event = self._events.get()
            if event.finish_reason is not None:
                self._done = True
            yield event

    def cancel(self) -> None:
        """Cancel this request (its final event has finish_reason "cancelled")."""
        self._engine.cancel(self.request_id)


class Engine:
    """Continuous batching over `runner` with 1..8 lanes, a paged KV pool and a prefix cache."""

    def __init__(self, runner: ModelRunner, tokenizer: Tokenizer, config: SchedulerConfig, *,
                 model_max_context: int, spec: SpecConfig | None = None, memory: MemoryConfig | None = None,
                 profile: dict[str, Any] | None = None, model_name: str = "") -> None:
        self.runner = runner
        self.spec = spec if spec is not None and spec.enabled else None
        self.drafter: LookupDrafter | RunnerDrafter | None = None
        if self.spec is not None and self.spec.method == "mtp":
            if getattr(runner, "mtp_draft_tokens", 0) < spec.draft_tokens:
                raise ConfigError("--spec mtp needs a runner built with its MTP head (mtp_draft_tokens)")
            self.drafter = RunnerDrafter(spec.draft_tokens)
        elif self.spec is not None:
            self.drafter = LookupDrafter(spec.draft_tokens, spec.ngram_min, spec.ngram_max)
        self.tokenizer = tokenizer
        self.config = config
        self.max_context = config.max_context or model_max_context
        self.pool = PagePool(runner.num_pages, runner.page_size)
        self.kv_capacity_tokens = runner.num_pages * runner.page_size
        # a sequence can never hold more tokens than the pool
        self.context_limit = min(self.max_context, self.kv_capacity_tokens)
        self._copy_pages = getattr(runner, "copy_pages", None)
        # a hybrid model's recurrent-state slots: working slots and page-checkpoint captures of the
        # lanes + the retained entries' checkpoints (the runner sizes them, see
        # loader.resolve_state_slots; 0 or absent: pure attention)
        num_state_slots = getattr(runner, "num_state_slots", 0)
        self.state_pool = StatePool(num_state_slots) if num_state_slots > 0 else None
        self.scheduler = Scheduler(config, self.pool, copy_on_write=callable(self._copy_pages),
                                   state_pool=self.state_pool)
        # the host and disk tiers, slot files and the prefix-cache file (engine/tiers.py); profile:
        # what a session file must match to be restored here (artifact, weight formats, state kinds)
        memory = memory or MemoryConfig()
        wants_mover = bool(memory.host_kv_bytes or memory.disk_path or memory.slot_save_path)
        self.tiers = ContextTiers(memory, profile or {}, TensorMover.for_runner(runner) if wants_mover else None,
                                  self.scheduler.prefix_cache, self.pool, self.state_pool, model_name,
                                  reserved_pages=self.scheduler.outstanding_pages)
        if memory.prefix_cache_file:
            from pathlib import Path
            self.tiers.load_prefix_cache_file(Path(memory.prefix_cache_file))
        self._cv = threading.Condition()
        self._inbox: deque[_Live] = deque()
        self._cancels: list[str] = []
        self._live: dict[str, _Live] = {}  # request_id -> submitted and not finished (under _cv)
        self._by_seq: dict[int, _Live] = {}  # worker thread only
        self._seq_ids = count()
        self._admitted = 0
        self._peak_admitted = 0
        self._rejected = 0
        self._counters = EngineCounters()
        self._rng = random.SystemRandom()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._failed: str | None = None
        self._calls: deque[tuple[Callable[[], Any], concurrent.futures.Future]] = deque()  # run on the worker
        # Events wait in the outbox until `_flush` hands them on: while the runner's next step runs on
        # the device where it can (`run_overlapped`), else before it; at the latest before idling.
        self._outbox: list[tuple[_Live, OutputEvent]] = []
        resident = getattr(runner, "resident_bytes", None)
        self.residency = suspend_mod.Residency(releasable_bytes=resident() if resident is not None else 0)
        self._snapshot = self._make_snapshot()

    # ---- lifecycle ------------------------------------------------------------------------

    @classmethod
    def spawn(cls, build_runner: Callable[[], ModelRunner], tokenizer: Tokenizer, config: SchedulerConfig, *,
              model_max_context: int, **kwargs: Any) -> Engine:
        """Build the runner on the engine's own worker thread, then run the engine there.

        All torch work of a model belongs on one thread: on CPU, torch's OpenMP kernels ran ~2x
        slower on a thread other than the one that ran the first parallel op (measured: 26 vs
        63 tok/s decode on the default model), and CUDA streams are per thread. Raises what the
        build raised."""
        built: queue.SimpleQueue[Engine | BaseException] = queue.SimpleQueue()

        def main() -> None:
            try:
                engine = cls(build_runner(), tokenizer, config, model_max_context=model_max_context, **kwargs)
            except BaseException as exc:  # handed to the caller, which re-raises it
                built.put(exc)
                return
            engine._thread = threading.current_thread()
            built.put(engine)
            engine._loop()

        threading.Thread(target=main, name="ninfer-engine", daemon=True).start()
        result = built.get()
        if isinstance(result, BaseException):
            raise result
        return result

    def start(self) -> None:
        """Start the worker thread (an engine made by `spawn` is already running)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="ninfer-engine", daemon=True)
            self._thread.start()

    def shutdown(self) -> None:
        """Stop the worker; requests still in flight end with finish_reason "error"."""
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join()
        for _, future in self._calls:
            future.set_exception(EngineNotRunning("engine_shutdown"))
        self._calls.clear()
        for live in list(self._live.values()):
            self._finalize(live, "error", error="engine_shutdown")
        self._flush()
        self.tiers.close()

    def save_prefix_cache(self, cancel: threading.Event | None = None) -> int:
        """After shutdown: write the retained sessions to --prefix-cache-file (0 without one).
        Raises SaveCancelled when `cancel` is set mid-write (the previous file is kept)."""
        path = self.tiers.config.prefix_cache_file
        if not path:
            return 0
        from pathlib import Path
        resident = self.residency.state == "resident"  # asleep: the device entries' pools are released
        if not resident:
            log.warning("the model is suspended: the prefix-cache file keeps the host tier only")
        return self.tiers.save_prefix_cache_file(Path(path), cancel, include_device=resident)

    # ---- submission (any thread) -----------------------------------------------------------

    def derived_max_tokens(self, prompt_len: int) -> int:
        """The output limit derived from the prompt and the lane share (ignores --default-max-tokens)."""
        limit = derive_output_limit(prompt_len, max_context=self.max_context, num_pages=self.pool.num_pages,
                                    page_size=self.pool.page_size, max_concurrency=self.config.max_concurrency)
        return max(0, min(limit, self.context_limit - prompt_len))

    def default_max_tokens(self, prompt_len: int) -> int:
        """The spec's default output limit for a request that omits one: --default-max-tokens
        when set, else the derived budget; never past the remaining context."""
        if self.config.default_max_tokens is not None:
            return max(0, min(self.config.default_max_tokens, self.context_limit - prompt_len))
        return self.derived_max_tokens(prompt_len)

    def submit(self, req: PreparedRequest, sink: Sink | None = None) -> RequestHandle:
        """Queue a request. Events go to `sink` when given (called on the engine thread; it must
        not block), else to the returned handle. Raises ContextLengthExceeded for a prompt the
        context cannot hold, EngineOverloaded at capacity, DuplicateRequest for an id in flight,
        EngineNotRunning after shutdown or a worker failure (ninfer/engine/errors.py)."""
        prompt_len = len(req.prompt_token_ids)
        if prompt_len >= self.context_limit:
            with self._cv:
                self._rejected += 1
            raise ContextLengthExceeded(prompt_len, self.context_limit)
        max_out = self.default_max_tokens(prompt_len) if req.max_tokens is None \
            else min(req.max_tokens, self.context_limit - prompt_len)
        proc = OutputProcessor(self.tokenizer, req.stop, frozenset(req.stop_token_ids), req.ignore_eos,
                               skip_special_tokens=bool(req.hints.get("skip_special_tokens", False)))
        seed = req.sampling.seed if req.sampling.seed is not None else self._rng.randrange(1 << 63)
        seq = Sequence(seq_id=-1, request_id=req.request_id, prompt_token_ids=list(req.prompt_token_ids),
                       max_output_tokens=max_out, sampling=req.sampling, seed=seed,
                       stop_token_ids=proc.stop_token_ids,
                       cache_prompt=req.cache_prompt and req.pooling is None,  # every row computed: no reuse
                       raw_prompt=req.raw_prompt, return_hidden=req.pooling is not None, retain=req.retain,
                       packable=max_out == 1 and (req.pooling is not None or req.batch_prefill))
        handle = RequestHandle(req.request_id, self)
        handle.max_output_tokens, handle.seed = max_out, seed
        now = time.monotonic()
        timeout = self.config.pending_timeout_ms
        live = _Live(req, seq, proc, sink or handle._put, now, now + timeout / 1e3 if timeout > 0 else None,
                     matcher=req.grammar.matcher() if req.grammar is not None else None,
                     spec=SpecStats(self.drafter.new_state())
                     if self.drafter is not None and req.hints.get("speculative", True) else None)
        reasoning = req.reasoning
        if reasoning is not None:
            live.splitter = ReasoningSplitter(reasoning.starts_open)
            if reasoning.budget is not None and reasoning.close_ids:
                live.thinking_budget = effective_budget(reasoning.budget, max_out, len(reasoning.close_ids))
        with self._cv:
            if self._stopping or self._thread is None:
                raise EngineNotRunning(self._failed)
            if self.residency.state != "resident":
                raise EngineSuspended()
            capacity = self.config.max_concurrency + self.config.max_pending_requests
            if self._admitted >= capacity:
                self._rejected += 1
                raise EngineOverloaded(capacity)
            if req.request_id in self._live:
                raise DuplicateRequest(req.request_id)
            seq.seq_id = next(self._seq_ids)
            self._admitted += 1
            self._peak_admitted = max(self._peak_admitted, self._admitted)
            self._live[req.request_id] = live
            self._inbox.append(live)
            self._cv.notify_all()
        return handle

    def call_on_worker(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        """Run `fn` on the worker thread between steps (where every torch call of the model runs);
        the future holds its result or exception."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._cv:
            if self._stopping or self._thread is None:
                future.set_exception(EngineNotRunning(self._failed))
                return future
            self._calls.append((fn, future))
            self._cv.notify_all()
        return future

    def suspend(self) -> concurrent.futures.Future:
        """Give the model's memory back while idle (engine/suspend.py); -> Future[Residency].
        Raises (through the future) EngineBusy with work in flight, SuspendNotSupported."""
        return self.call_on_worker(lambda: suspend_mod.suspend(self))

    def configure_suspend(self, options: suspend_mod.SuspendOptions) -> concurrent.futures.Future:
        """Adopt --suspend-snapshot / --suspend-weights (pinned reserves its block now); -> Future[Residency]."""
        return self.call_on_worker(lambda: suspend_mod.configure(self, options))

    def resume(self) -> concurrent.futures.Future:
        """Take the memory again and restore the retained state; -> Future[Residency]."""
        return self.call_on_worker(lambda: suspend_mod.resume(self))

    def cancel(self, request_id: str) -> None:
        """Cancel a request at the next step boundary; unknown or finished ids are ignored."""
        with self._cv:
            self._cancels.append(request_id)
            self._cv.notify_all()

    async def stream(self, req: PreparedRequest) -> AsyncIterator[OutputEvent]:
        """Submit and yield events on the running asyncio loop; closing the iterator early
        cancels the request. Submission errors raise at the first iteration."""
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[OutputEvent] = asyncio.Queue()

        def sink(event: OutputEvent) -> None:
            try:
                loop.call_soon_threadsafe(events.put_nowait, event)
            except RuntimeError:  # the loop is closed: nobody is listening any more
                self.cancel(req.request_id)

        self.submit(req, sink)
        done = False
        try:
            while not done:
                event = await events.get()
                done = event.finish_reason is not None
                yield event
        finally:
            if not done:
                self.cancel(req.request_id)

    def snapshot(self) -> EngineSnapshot:
        """The counters as of the last step boundary, or the last request finished since."""
        return self._snapshot

    # ---- the worker -----------------------------------------------------------------------

    @property
    def failed(self) -> str | None:
        """Why the worker stopped on an unexpected error (then /health should report it), else None."""
        return self._failed

    def _loop(self) -> None:
        try:
            self._run_loop()
        except Exception as exc:  # a broken invariant: fail what is in flight, refuse new work
            self._failed = f"{type(exc).__name__}: {exc}"
            with self._cv:
                self._stopping = True
            for live in list(self._live.values()):
                self._counters.requests_failed += 1
                self._finalize(live, "error", error=f"engine failure: {self._failed}")
            self._flush()
            raise

    def _run_loop(self) -> None:
        while True:
            with self._cv:
                stopping = self._stopping
                arrived = list(self._inbox)
                self._inbox.clear()
                cancels, self._cancels = self._cancels, []
                calls, self._calls = list(self._calls), deque()
            if stopping:
                self._flush()
                return
            if calls:  # a call may take long (a suspend): what earlier steps produced goes first
                self._flush()
            for live in arrived:
                self._by_seq[live.seq.seq_id] = live
                if live.seq.max_output_tokens <= 0:
                    live.seq.status = SeqStatus.FINISHED
                    self._finish(live, "length", None, "")
                else:
                    self.scheduler.add(live.seq)
            for request_id in cancels:
                self._cancel_now(request_id)
            for fn, future in calls:
                try:
                    future.set_result(fn())
                except BaseException as exc:  # noqa: BLE001 - the caller gets it
                    future.set_exception(exc)
            self._expire_waiting()
            self.tiers.promote(self.scheduler)
            batch = self.scheduler.schedule()
            admitted_at = time.monotonic()
            for seq in self.scheduler.newly_admitted:
                c = self._counters
                c.reused_prompt_tokens += seq.num_cached_tokens
                c.context_selections[seq.reuse_path] = c.context_selections.get(seq.reuse_path, 0) + 1
                live = self._by_seq[seq.seq_id]
                live.reuse_tier = self.tiers.admitted(seq.reuse_entry_id, seq.num_cached_tokens, seq.cache_prompt)
                live.admitted_at = admitted_at
                self._progress(live, admitted_at)  # processed == cache
            if batch is None:
                self._flush()
                with self._cv:
                    if not self._inbox and not self._cancels and not self._calls and not self._stopping:
                        self._cv.wait(self._idle_wait())
                continue
            self._step(batch)

    def _idle_wait(self) -> float | None:
        deadlines = [self._by_seq[s.seq_id].deadline for s in self.scheduler.waiting]
        deadlines = [d for d in deadlines if d is not None]
        return max(0.0, min(deadlines) - time.monotonic()) if deadlines else None

    def _step(self, batch: ScheduledBatch) -> None:
        first = self._by_seq[batch.seqs[0].seq_id]
        is_prefill = first.seq.status is SeqStatus.PREFILLING
        if (self.config.decode_ahead and not is_prefill and getattr(self.runner, "launch", None) is not None
                and self._may_look_ahead(batch)):
            self._decode_ahead(batch)
            return
        t0 = time.monotonic()
        try:
            if batch.page_copies:
                self._copy_pages(batch.page_copies)
            for work in batch.seqs:  # the grammar's (or a forced token's) mask for this sample
                if work.sample:
                    work.token_mask = self._mask(self._by_seq[work.seq_id])
            if self.drafter is not None and not is_prefill:
                self._draft(batch)
            run_overlapped = getattr(self.runner, "run_overlapped", None)
            if run_overlapped is not None:  # the last step's events go out while this one runs
                output = run_overlapped(batch, self._flush)
            else:
                self._flush()
                output = self.runner.run(batch)
        except Exception as exc:  # fail the lanes, keep serving the queue: a recovery
            self._recover(exc)
            return
        self._commit(batch, output, is_prefill, time.monotonic() - t0)

    def _recover(self, exc: Exception) -> None:
        """A step failed: fail the lanes, keep serving the queue."""
        self._counters.engine_recoveries += 1
        for seq in list(self.scheduler.running):
            self.scheduler.abort(seq)
            live = self._by_seq[seq.seq_id]
            self._counters.requests_failed += 1
            self._finalize(live, "error", error=f"{type(exc).__name__}: {exc}")

    def _may_look_ahead(self, batch: ScheduledBatch) -> bool:
        """Whether `batch` may be launched, and the decode step after it launched before `batch`'s
        tokens are read: nothing waits to be taken in, the model keeps no recurrent state (its
        checkpoints follow each step), the batch copies no pages or states, and no row's next sample
        depends on its last token beyond its input (a grammar or forced token, penalties, a thinking
        budget or a sampler that switches when reasoning closes), or needs this step's logits
        (logprobs) or drafts."""
        if self.drafter is not None or self.state_pool is not None or self._inbox or self._cancels or self._calls:
            return False
        if batch.page_copies or batch.state_copies:
            return False
        for work in batch.seqs:
            live = self._by_seq.get(work.seq_id)
            if live is None or live.matcher is not None or live.forced or live.thinking_budget is not None:
                return False
            reasoning = live.req.reasoning
            if reasoning is not None and reasoning.post_thinking is not None and not live.post_thinking:
                return False
            sp = work.sampling
            if sp.logprobs or sp.presence_penalty or sp.frequency_penalty or work.return_hidden:
                return False
        return True

    def _decode_ahead(self, batch: ScheduledBatch) -> None:
        """Decode steps back to back: the step after `batch` (Scheduler.lookahead: each row's input
        is the token `batch` samples for it, taken on the device) is launched before `batch`'s
        tokens are read, so the host's work on one step runs while the next computes. Stops where
        the next step could differ from what `schedule` would build (a sequence ended, a request or
        a call arrived, a page or the output budget is reached): that step's rows of sequences
        that ended are dropped by `update`, and the main loop takes over."""
        t0 = time.monotonic()
        try:
            launched = self.runner.launch(batch)
        except Exception as exc:
            self._recover(exc)
            return
        while True:
            after = self.scheduler.lookahead(batch) if self._may_look_ahead(batch) else None
            try:
                launched_after = self.runner.launch(after) if after is not None else None
                self._flush()  # the last step's events go out while these steps run
                output = self.runner.collect(launched)
            except Exception as exc:
                self._recover(exc)
                return
            now = time.monotonic()
            self._commit(batch, output, False, now - t0)
            if after is None:
                return
            batch, launched, t0 = after, launched_after, now

    def _commit(self, batch: ScheduledBatch, output: StepOutput, is_prefill: bool, dt: float) -> None:
        """Count a step, advance its sequences by its output and hand their tokens on."""
        first = self._by_seq.get(batch.seqs[0].seq_id)
        c = self._counters
        if is_prefill:
            c.prefill_units += 1
            c.computed_prefill_tokens += batch.num_tokens
            c.prompt_seconds_total += dt
        else:
            c.decode_rounds += 1
            c.decode_row_rounds += len(batch.seqs)
            c.predicted_seconds_total += dt
            self._count_drafts(batch, output)
        now = time.monotonic()
        if output.drafts and isinstance(self.drafter, RunnerDrafter):  # the MTP head's next proposals
            for seq_id, drafts in output.drafts.items():
                live = self._by_seq.get(seq_id)
                if live is not None and live.spec is not None:
                    self.drafter.offer(live.spec.state, drafts)
        if output.hidden:
            self._pool(batch, output)
        sampled = self.scheduler.update(batch, output)
        c.predicted_tokens += len(sampled)  # every generated token, a prefill's first token included
        if not is_prefill:
            c.committed_decode_tokens += len(sampled)
        for work in batch.seqs:  # llama.cpp's n_tokens_max: the longest sequence seen in the KV cache
            live = self._by_seq.get(work.seq_id)
            if live is not None:
                c.max_sequence_tokens = max(c.max_sequence_tokens, live.seq.num_computed_tokens)
        if is_prefill and first is not None:  # the unit committed: its progress precedes its first token
            self._progress(first, now)
        round_index: dict[int, int] = {}  # seq_id -> tokens of this step handed on so far
        for j, (seq, token) in enumerate(sampled):
            live = self._by_seq.get(seq.seq_id)
            if live is None:  # ended earlier in this verify round (stop string, grammar)
                continue
            i = round_index[seq.seq_id] = round_index.get(seq.seq_id, -1) + 1
            logprob = output.logprobs.get(seq.seq_id) if i == 0 else output.verified_logprobs[seq.seq_id][i - 1]
            last = j + 1 == len(sampled) or sampled[j + 1][0] is not seq  # the row's last token of this step
            self._on_token(live, token, logprob, now, last)

    def _pool(self, batch: ScheduledBatch, output: StepOutput) -> None:
        """Fold an embedding's rows of this step into its pooled state (mean: a running sum)."""
        for work in batch.seqs:
            rows = output.hidden.get(work.seq_id)
            live = self._by_seq.get(work.seq_id)
            if rows is None or live is None:
                continue
            pooling = live.req.pooling
            if pooling == "mean":
                total = rows.float().sum(0)
                live.pooled = total if live.pooled is None else live.pooled + total
            elif pooling == "last":
                live.pooled = rows[-1].float().clone()
            elif work.start_pos == 0:  # cls: the first position
                live.pooled = rows[0].float().clone()

    def _draft(self, batch: ScheduledBatch) -> None:
        """Speculative decoding: attach each decode row's drafts (and their grammar masks)."""
        for work in batch.seqs:
            live = self._by_seq[work.seq_id]
            if live.spec is None:  # the request opted out (hints["speculative"] False)
                continue
            seq = live.seq
            state = live.spec.state
            skipped = state.fallback_steps
            drafts = self.drafter.propose(state, seq.prompt_token_ids + seq.output_token_ids,
                                          self.scheduler.draft_limit(seq))
            self._counters.spec_fallback_steps += state.fallback_steps - skipped
            if drafts and live.matcher is not None:  # one mask per draft position; none past a refused draft
                work.draft_masks = live.matcher.draft_masks(drafts)
                drafts = drafts[:len(work.draft_masks)]
            self.scheduler.attach_drafts(seq, work, drafts)

    def _count_drafts(self, batch: ScheduledBatch, output) -> None:
        c = self._counters
        for work in batch.seqs:
            live = self._by_seq.get(work.seq_id)  # None: a lookahead row of a sequence that ended
            if live is None or live.spec is None:
                continue
            if work.num_drafts:
                accepted = len(output.verified.get(work.seq_id, ()))
                live.spec.record(work.num_drafts, accepted)
                self.drafter.observe(live.spec.state, work.num_drafts, accepted)
                c.spec_rounds += 1
                c.drafted_tokens += work.num_drafts
                c.accepted_tokens += accepted

    def _progress(self, live: _Live, now: float) -> None:
        """A prompt-progress event with its prompt-only timings, for a request that asked."""
        if not live.req.hints.get("return_progress") or live.admitted_at is None:
            return
        seq = live.seq
        cache, processed = seq.num_cached_tokens, min(seq.num_computed_tokens, seq.prompt_len)
        elapsed_ms = (now - live.admitted_at) * 1e3
        timings = Timings(cache_n=cache, prompt_n=seq.prompt_len - cache, prompt_ms=elapsed_ms,
                          predicted_n=0, predicted_ms=0.0, prompt_processed_n=processed - cache)
        self._emit(live, OutputEvent(request_id=seq.request_id, timings=timings,
                                     progress=PromptProgress(seq.prompt_len, cache, processed, elapsed_ms)))

    def _mask(self, live: _Live) -> Any:
        """The token mask of a request's next sample: a forced token's, the grammar's outside
        reasoning, or None."""
        if live.forced:
            return single_token_mask(live.forced[0], mask_words(self.runner.vocab_size))
        if live.matcher is not None and not (live.splitter is not None and live.splitter.in_reasoning):
            return live.matcher.next_mask()
        return None

    def _on_token(self, live: _Live, token: int, logprob: TokenLogprob | None, now: float,
                  last: bool = True) -> None:
        """Hand one committed token on; `last`: the final token its row committed this step (the
        scheduler has already ended a request whose budget or stop token this step reached)."""
        seq, proc, splitter = live.seq, live.proc, live.splitter
        reasoning_token = splitter is not None and splitter.in_reasoning
        if live.forced:
            live.forced.popleft()
        elif live.matcher is not None and not reasoning_token and not live.matcher.accept(token):
            self.scheduler.abort(seq)  # the mask should have excluded it
            self._counters.requests_failed += 1
            self._finalize(live, "error", error=f"structured output: the grammar does not admit sampled token {token}")
            return
        first = live.first_token_at is None
        if first:
            live.first_token_at = now
        live.last_token_at = now
        live.tokens_seen += 1
        step = proc.append(token)
        text = step.text
        ended = step.finished or (seq.finished and last)
        if ended and not step.finished:  # the output budget (which the context bounds)
            text += proc.finish()
        reasoning = ""
        if splitter is not None:
            undecided = splitter.state == "start"
            reasoning, text = splitter.feed(text, final=ended)
            reasoning_token = reasoning_token or splitter.in_reasoning
            if undecided and splitter.state == "start":
                live.undecided_tokens += 1  # counted as reasoning once the output opens <think>
            elif undecided and splitter.opened:
                live.reasoning_tokens += live.undecided_tokens
            live.reasoning_tokens += reasoning_token
            self._after_reasoning_step(live)
        if token not in proc.stop_token_ids:
            live.logprobs.append(None if reasoning_token else logprob)
        if step.finished:  # a stop token or a stop string
            self.scheduler.truncate_round(seq, live.tokens_seen)  # a stop string inside a verify round
            self.scheduler.finish(seq, "stop", step.stop_reason)
            self._finish(live, "stop", step.stop_reason, text, token, reasoning)
        elif seq.finished and last:  # the output budget (which the context bounds)
            reason = "stop" if proc.stop_reason is not None else "length"  # a final flush may complete a stop
            self._finish(live, reason, proc.stop_reason, text, token, reasoning)
        else:
            # the first event carries the finished prompt phase; every event does when asked
            timings = self._timings(live) if first or live.req.hints.get("timings_per_token") else None
            self._emit(live, OutputEvent(request_id=seq.request_id, token_ids=(token,), text=text, reasoning=reasoning,
                                         logprobs=self._take_logprobs(live, proc.tokens_published),
                                         timings=timings))

    def _after_reasoning_step(self, live: _Live) -> None:
        """At the thinking budget, queue the early close; once reasoning closed, switch to the
        post-thinking sampler (once)."""
        spec, splitter = live.req.reasoning, live.splitter
        if splitter.in_reasoning:
            if live.thinking_budget is not None and not live.forced and live.reasoning_tokens >= live.thinking_budget:
                live.forced.extend(spec.close_ids)
                live.thinking_budget = None  # once
        elif splitter.opened and spec.post_thinking is not None and not live.post_thinking:
            live.post_thinking = True
            live.seq.sampling = spec.post_thinking
            if spec.post_thinking.seed is not None:
                live.seq.seed = spec.post_thinking.seed

    def _take_logprobs(self, live: _Live, published: int) -> tuple[TokenLogprob, ...]:
        records = live.logprobs[live.logprobs_sent:published]
        live.logprobs_sent = max(live.logprobs_sent, published)
        return tuple(r for r in records if r is not None)

    def _finish(self, live: _Live, reason: str, stop_reason: str | int | None, text: str,
                token: int | None = None, reasoning: str = "") -> None:
        c = self._counters
        c.requests_finished += 1
        c.prefix_cache_hit_tokens += live.seq.num_cached_tokens
        self._finalize(live, reason, stop_reason=stop_reason, text=text, reasoning=reasoning,
                       token_ids=(token,) if token is not None else (),
                       logprobs=self._take_logprobs(live, live.proc.tokens_published))

    def _cancel_now(self, request_id: str) -> None:
        live = self._live.get(request_id)
        if live is None or live.seq.seq_id not in self._by_seq:
            return
        seq, c = live.seq, self._counters
        if seq.status is SeqStatus.WAITING:
            c.waiting_cancelled += 1
            c.waiting_abandoned_seconds += time.monotonic() - live.submitted_at
        elif seq.status is SeqStatus.PREFILLING:
            c.cancelled_prefills += 1
            c.cancelled_prefill_computed_tokens += max(0, seq.num_computed_tokens - seq.num_cached_tokens)
        self.scheduler.abort(seq)
        c.requests_cancelled += 1
        self._finalize(live, "cancelled")

    def _expire_waiting(self) -> None:
        now = time.monotonic()
        for seq in list(self.scheduler.waiting):
            live = self._by_seq[seq.seq_id]
            if live.deadline is not None and now >= live.deadline:
                self.scheduler.abort(seq)
                self._counters.requests_failed += 1
                self._counters.waiting_expired += 1
                self._counters.waiting_abandoned_seconds += now - live.submitted_at
                self._finalize(live, "error", error="request_queue_timeout")

    def _finalize(self, live: _Live, reason: str, *, stop_reason: str | int | None = None, text: str = "",
                  reasoning: str = "", token_ids: tuple[int, ...] = (), logprobs: tuple[TokenLogprob, ...] = (),
                  error: str | None = None) -> None:
        seq = live.seq
        self._by_seq.pop(seq.seq_id, None)
        with self._cv:
            if self._live.get(seq.request_id) is not live:
                return  # already finalized
            del self._live[seq.request_id]
            self._admitted -= 1
        if live.spec is not None:
            self._counters.completed_drafted_tokens += live.spec.drafted
            self._counters.completed_accepted_tokens += live.spec.accepted
        usage = Usage(prompt_tokens=seq.prompt_len, completion_tokens=len(seq.output_token_ids),
                      cached_tokens=seq.num_cached_tokens, reasoning_tokens=live.reasoning_tokens)
        if live.splitter is not None and reason in ("cancelled", "error"):  # release what the split held
            held_reasoning, held_text = live.splitter.feed("", final=True)
            reasoning, text = reasoning + held_reasoning, text + held_text
        self._emit(live, OutputEvent(request_id=seq.request_id, token_ids=token_ids, text=text, reasoning=reasoning,
                                     logprobs=logprobs, finish_reason=reason, stop_reason=stop_reason, usage=usage,
                                     timings=self._timings(live), error=error, slot_id=seq.slot,
                                     post_thinking_sampling=live.post_thinking, embedding=self._embedding(live),
                                     reuse_path=seq.reuse_path if live.admitted_at is not None else None,
                                     queue_wait_seconds=live.admitted_at - live.submitted_at
                                     if live.admitted_at is not None else None,
                                     reuse_tier=live.reuse_tier,
                                     speculative=live.spec.to_dict(self.spec.method, self.spec.draft_tokens)
                                     if live.spec is not None else None))

    def _embedding(self, live: _Live) -> Any:
        """An embedding request's pooled vector (None for any other request, or one that never ran)."""
        if live.pooled is None:
            return None
        pooled = live.pooled / live.seq.prompt_len if live.req.pooling == "mean" else live.pooled
        return pooled.cpu()

    def _emit(self, live: _Live, event: OutputEvent) -> None:
        self._outbox.append((live, event))

    def _flush(self) -> None:
        """Publish a snapshot, then hand the outbox's events on (a client that has its final event
        finds the request counted in /metrics and /stats)."""
        self._publish()
        events, self._outbox = self._outbox, []
        for live, event in events:
            try:
                live.sink(event)
            except Exception:  # a broken consumer must not stop the engine: drop its request
                if event.finish_reason is None:
                    self.cancel(live.seq.request_id)

    def _timings(self, live: _Live) -> Timings:
        seq = live.seq
        prompt_ms = predicted_ms = 0.0
        if live.admitted_at is not None and live.first_token_at is not None:
            prompt_ms = (live.first_token_at - live.admitted_at) * 1e3
        if live.first_token_at is not None and live.last_token_at is not None:
            predicted_ms = (live.last_token_at - live.first_token_at) * 1e3
        spec = live.spec
        return Timings(cache_n=seq.num_cached_tokens, prompt_n=seq.prompt_len - seq.num_cached_tokens,
                       prompt_ms=prompt_ms, predicted_n=len(seq.output_token_ids), predicted_ms=predicted_ms,
                       draft_n=spec.drafted if spec else 0, draft_n_accepted=spec.accepted if spec else 0)

    # ---- snapshots ------------------------------------------------------------------------

    def _publish(self) -> None:
        self._snapshot = self._make_snapshot()

    def _make_snapshot(self) -> EngineSnapshot:
        s, c, pool = self.scheduler, self._counters, self.pool
        cache = s.prefix_cache
        continuations = tuple(ContinuationInfo(e.entry_id, len(e.token_ids), len(e.pages), e.slot, e.session,
                                               e.state_slot, tuple(e.page_checkpoints))
                              for e in cache.entries()) if cache else ()
        state = self.state_pool
        lanes = tuple(LaneInfo(q.lane, q.request_id, q.status is SeqStatus.PREFILLING, q.prompt_len,
                               q.num_cached_tokens, q.num_computed_tokens, len(q.output_token_ids),
                               q.reuse_path) for q in s.running)
        waiting = list(s.waiting)
        queue_entries = tuple(QueueEntry(q.request_id, i, self._by_seq[q.seq_id].submitted_at)
                              for i, q in enumerate(waiting[:QUEUE_REPORT]) if q.seq_id in self._by_seq)
        return EngineSnapshot(
            published_at=time.monotonic(),
            max_concurrency=self.config.max_concurrency,
            max_pending_requests=self.config.max_pending_requests,
            max_context=self.max_context,
            kv_capacity_tokens=self.kv_capacity_tokens,
            kv_capacity_pages=pool.num_pages,
            kv_page_tokens=pool.page_size,
            max_private_continuations=cache.max_entries if cache is not None else 0,
            admitted=self._admitted,
            peak_admitted=self._peak_admitted,
            running=len(s.running),
            prefilling=s.num_prefilling,
            decode_ready=s.num_decode_ready,
            waiting=len(waiting) + len(self._inbox),
            kv_pages_used=pool.num_used,
            kv_tokens_used=pool.num_used * pool.page_size,
            retained_continuations=len(cache) if cache is not None else 0,
            computed_prefill_tokens=c.computed_prefill_tokens,
            committed_decode_tokens=c.committed_decode_tokens,
            reused_prompt_tokens=c.reused_prompt_tokens,
            decode_rounds=c.decode_rounds,
            decode_row_rounds=c.decode_row_rounds,
            prefill_units=c.prefill_units,
            prompt_tokens_total=c.computed_prefill_tokens,
            prompt_seconds_total=c.prompt_seconds_total,
            predicted_tokens_total=c.predicted_tokens,
            max_sequence_tokens=c.max_sequence_tokens,
            predicted_seconds_total=c.predicted_seconds_total,
            requests_finished=c.requests_finished,
            requests_cancelled=c.requests_cancelled,
            requests_failed=c.requests_failed,
            requests_rejected=self._rejected,
            waiting_expired=c.waiting_expired,
            waiting_cancelled=c.waiting_cancelled,
            waiting_abandoned_seconds=c.waiting_abandoned_seconds,
            cancelled_prefills=c.cancelled_prefills,
            cancelled_prefill_computed_tokens=c.cancelled_prefill_computed_tokens,
            cancelled_prefills_salvaged=c.cancelled_prefills_salvaged,
            engine_recoveries=c.engine_recoveries,
            context_cache_exhausted=c.context_cache_exhausted,
            prefix_cache_hit_tokens=c.prefix_cache_hit_tokens,
            context_selections=dict(c.context_selections),
            state_slots_total=state.num_slots if state else 0,
            state_slots_used=state.num_used if state else 0,
            spec_method=self.spec.method if self.spec else None,
            spec_rounds=c.spec_rounds,
            drafted_tokens=c.drafted_tokens,
            accepted_tokens=c.accepted_tokens,
            spec_fallback_steps=c.spec_fallback_steps,
            completed_drafted_tokens=c.completed_drafted_tokens,
            completed_accepted_tokens=c.completed_accepted_tokens,
            tiers=self.tiers.gauges(),
            lanes=lanes,
            continuations=continuations,
            queue=queue_entries,
        )
