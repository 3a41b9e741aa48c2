"""Admission, lanes, staged prefill and the decode batch; scheduling by tokens (no torch).

One step is either a prefill unit (one chunk of one staged lane) or a decode round (every
decode-ready lane, one token each, in one forward). A request carries `num_computed_tokens`;
a prefix hit, a chunked prefill and a decode step are just different token counts.

Admission is FIFO and reserves the request's whole page entitlement (prompt + effective output)
through completion; pages are allocated lazily as tokens are computed, and the reservation
counts against later admissions, so a running request never runs out of pages.

With recurrent state (a hybrid model, a StatePool) every admitted request also takes one working
state slot, which admission counts like pages (evicting retained entries when none is free);
a finished request's slot becomes its retained entry's frontier checkpoint. A request that may
be retained also captures a page checkpoint at its prompt's last page boundary
(`Sequence.checkpoint_at`): its prefill chunk ends there, and the next batch built, whatever it
holds, first copies the working slot into a spare slot (best effort: neither happens when no
slot is free beyond those the idle lanes could need). A prompt resumes from a retained entry
only at one of its checkpoints, through a state copy (ScheduledBatch.state_copies).
"""
from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass, field

from ninfer.engine.batch import FOLLOWS, ScheduledBatch, SequenceWork, StepOutput
from ninfer.engine.config import SchedulerConfig
from ninfer.engine.kv_cache import PagePool, StatePool, pages_for_tokens
from ninfer.engine.prefix_cache import PrefixCache, reuse_path
from ninfer.engine.request import SamplingParams
from ninfer.errors import ConfigError

MAX_PASSED_OVER = 8  # a staged lane passed over this many times runs next (spec)


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    PREFILLING = "prefilling"
    DECODING = "decoding"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Sequence:
    """Scheduling state of one request. Tokens are prompt + output; positions [0,
    num_computed_tokens) have KV in the pages of `block_table`."""

    seq_id: int
    request_id: str
    prompt_token_ids: list[int]
    max_output_tokens: int  # effective output budget (>= 1), already clamped to the context
    sampling: SamplingParams = field(default_factory=SamplingParams)
    seed: int = 0
    stop_token_ids: frozenset[int] = frozenset()
    cache_prompt: bool = True
    raw_prompt: bool = False
    return_hidden: bool = False  # an embedding: every prompt row's hidden states come back
    # a one-token request (an embedding, a rerank judgement): its whole prompt may share a prefill
    # unit with others like it, since none of them decodes
    packable: bool = False
    retain: bool = True  # False: reuse a cached prefix, but leave nothing retained at the end
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    entitlement_pages: int = 0
    num_cached_tokens: int = 0  # prompt tokens reused from the prefix cache (exact)
    reuse_path: str = "root"
    reuse_entry_id: int = -1  # the prefix-cache entry its reused tokens came from (-1: none)
    status: SeqStatus = SeqStatus.WAITING
    lane: int = -1
    passed_over: int = 0
    copy_src: int | None = None  # a page we hold a ref on until its copy has run
    state_slot: int = -1  # the working recurrent-state slot while admitted (-1: none)
    state_copy_src: int | None = None  # a checkpoint slot we hold a ref on until its copy has run
    checkpoint_at: int = 0  # hybrid: the page boundary whose state is captured while prefilling (0: none)
    checkpoint_slot: int = -1  # the slot holding (or, its copy pending, about to hold) that state
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    slot: int | None = None  # the context-cache cell it was retained in, once finished
    state_ahead: bool = False  # hybrid: a truncated verify round left the working state past the frontier

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def remaining_prompt(self) -> int:
        return max(0, self.prompt_len - self.num_computed_tokens)

    def token_at(self, pos: int) -> int:
        n = self.prompt_len
        return self.prompt_token_ids[pos] if pos < n else self.output_token_ids[pos - n]

    @property
    def finished(self) -> bool:
        return self.status is SeqStatus.FINISHED


def derive_output_limit(prompt_len: int, *, max_context: int, num_pages: int, page_size: int,
                        max_concurrency: int) -> int:
    """The spec's default output limit: the largest output whose prompt+output pages fit one
    lane's share of the pool, clamped to the remaining context. A prompt that alone overruns
    a lane's share keeps the whole remaining context."""
    remaining = max(0, max_context - prompt_len)
    share_tokens = (num_pages // max_concurrency) * page_size
    if share_tokens <= prompt_len:
        return remaining
    return min(remaining, share_tokens - prompt_len)


class Scheduler:
    """Lanes over a page pool and an optional prefix cache.

    copy_on_write: the runner can copy a page (ScheduledBatch.page_copies), so a prefix hit
    that ends inside a page reuses it exactly; without it the partial page is recomputed.
    state_pool: the recurrent-state slots of a hybrid model (None: pure attention). It needs at
    least max_concurrency slots (one working slot a lane); the rest hold page-checkpoint captures
    and checkpoints of retained entries (see StatePool for the sizing)."""

    def __init__(self, config: SchedulerConfig, pool: PagePool, *, copy_on_write: bool = False,
                 state_pool: StatePool | None = None) -> None:
        self.config = config
        self.pool = pool
        self.page_size = pool.page_size
        self.copy_on_write = copy_on_write
        if state_pool is not None and state_pool.num_slots < config.max_concurrency:
            raise ConfigError(f"{state_pool.num_slots} recurrent-state slots cannot serve {config.max_concurrency} "
                              "lanes: the runner needs at least max_concurrency slots")
        self.state_pool = state_pool
        max_entries = config.max_private_continuations
        if max_entries is None:
            max_entries = 2 * config.max_concurrency
        self.prefix_cache: PrefixCache | None = (
            PrefixCache(pool, max_entries, state_pool) if config.prefix_reuse and max_entries > 0 else None)
        rounds = config.decode_rounds_per_prefill or 0
        self.decode_rounds_per_prefill = rounds if rounds > 0 else max(1, config.prefill_chunk // 64)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # lanes in admission order
        self.newly_admitted: list[Sequence] = []  # admitted by the last schedule() call
        # page-checkpoint captures (working slot, checkpoint slot) for the next batch built
        self._captures: list[tuple[int, int]] = []
        self._rounds_since_prefill = 0

    # ---- requests in and out -------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        """Queue a request for admission (FIFO)."""
        assert seq.max_output_tokens >= 1 and seq.status is SeqStatus.WAITING
        self.waiting.append(seq)

    def abort(self, seq: Sequence) -> None:
        """Cancel at a step boundary: leave the queue or free the lane and every page it holds."""
        if seq.status is SeqStatus.WAITING:
            self.waiting.remove(seq)
        elif not seq.finished:
            self.running.remove(seq)
            self._release(seq, retain=False)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = seq.finish_reason or "cancelled"

    def finish(self, seq: Sequence, reason: str, stop_reason: str | int | None = None) -> None:
        """End a running request ("stop" or "length"); retains its KV as a continuation when the
        prefix cache is on and the request allows it. A second call is a no-op."""
        if seq.finished:
            return
        self.running.remove(seq)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason, seq.stop_reason = reason, stop_reason
        self._release(seq, retain=self.prefix_cache is not None and seq.cache_prompt and seq.retain)

    def _release(self, seq: Sequence, *, retain: bool) -> None:
        if seq.copy_src is not None:
            self.pool.decref([seq.copy_src])
            seq.copy_src = None
        state_slot, seq.state_slot = seq.state_slot, -1
        if seq.state_copy_src is not None:  # never ran: its working slot holds no state
            self.state_pool.decref([seq.state_copy_src])
            seq.state_copy_src = None
            retain = False
        table, seq.block_table = seq.block_table, []
        n = seq.num_computed_tokens
        retain = retain and n > 0 and not seq.state_ahead
        page_checkpoints = self._hand_over_capture(seq, state_slot, keep=retain)
        if retain:
            keep = pages_for_tokens(n, self.page_size)
            self.pool.decref(table[keep:])
            session = seq.prompt_token_ids + seq.output_token_ids
            assert self.prefix_cache is not None
            # the working slot holds the state after exactly n tokens: it becomes the frontier checkpoint
            self.prefix_cache.insert(session[:n], table[:keep], session, state_slot, page_checkpoints)
            seq.slot = self.prefix_cache.newest().slot
        else:
            self.pool.decref(table)
            if state_slot >= 0:
                self.state_pool.decref([state_slot])

    def _hand_over_capture(self, seq: Sequence, working_slot: int, *, keep: bool) -> list[tuple[int, int]]:
        # the sequence's page checkpoint as [(position, slot)] for its retained entry, or released
        slot, seq.checkpoint_slot = seq.checkpoint_slot, -1
        if slot < 0:
            return []
        if (working_slot, slot) in self._captures:  # its copy never ran: the slot holds nothing
            self._captures.remove((working_slot, slot))
            keep = False
        if keep:
            return [(seq.checkpoint_at, slot)]
        self.state_pool.decref([slot])
        return []

    # ---- admission ------------------------------------------------------------------------

    def _outstanding_pages(self) -> int:
        return sum(max(0, s.entitlement_pages - len(s.block_table)) for s in self.running)

    def outstanding_pages(self) -> int:
        """Pages the running requests' entitlements may still allocate (the context tiers size a
        promotion with it)."""
        return self._outstanding_pages()

    def _try_admit(self, seq: Sequence) -> bool:
        P = self.page_size
        entitlement = pages_for_tokens(seq.prompt_len + seq.max_output_tokens, P)
        cache, state = self.prefix_cache, self.state_pool
        match = None
        if cache and seq.cache_prompt:
            # recurrent state resumes only at one of an entry's checkpoints
            find = cache.match_checkpoint if state else cache.match
            match = find(seq.prompt_token_ids, seq.prompt_len - 1)
        matched = match.num_tokens if match else 0
        full, tail = divmod(matched, P)
        # Reuse plans, most first: the whole hit (its partial page copied), its full pages, nothing.
        # A plan pins what it reuses before eviction runs, so when the pool cannot hold the
        # entitlement beside the pinned pages (a request as large as the pool), reuse less.
        # With recurrent state a plan must reuse the whole hit: no state exists short of it.
        plans = [(full, True)] if tail and self.copy_on_write else []
        plans += [(full, False)] if full and not (state and tail) else []
        plans.append((0, False))
        need_slots = 1 if state else 0  # the working state slot
        for full_pages, copy in plans:
            shared: list[int] = []
            copy_src: int | None = None
            checkpoint: int | None = None
            if full_pages or copy:
                # hold the shared pages (and the copy sources) before any eviction can touch them
                pages = cache.entry_pages(match.entry_id)
                shared = pages[:full_pages]
                self.pool.incref(shared)
                if copy:
                    copy_src = pages[full_pages]
                    self.pool.incref([copy_src])
                if state:
                    checkpoint = match.state_slot
                    state.incref([checkpoint])
            need = entitlement - len(shared) + self._outstanding_pages()
            freeable = cache.freeable_pages() if cache else 0
            slots_fit = not state or state.num_free + (cache.freeable_slots() if cache else 0) >= need_slots
            if self.pool.num_free + freeable >= need and slots_fit:
                break
            self.pool.decref(shared + ([copy_src] if copy_src is not None else []))
            if checkpoint is not None:
                state.decref([checkpoint])
        else:
            return False
        reused = matched if copy else full_pages * P
        assert not state or reused in (0, matched), "recurrent state resumed off its checkpoint"
        if cache and (self.pool.num_free < need or (state and state.num_free < need_slots)):
            cache.evict(need, need_slots)
        assert self.pool.num_free >= need
        if match and reused:
            cache.touch(match.entry_id)
        seq.block_table = shared
        seq.entitlement_pages = entitlement
        if copy:
            seq.block_table.append(self.pool.allocate(1)[0])
            seq.copy_src = copy_src
        if state:
            seq.state_slot = state.allocate(1)[0]
            seq.state_copy_src = checkpoint
        seq.num_computed_tokens = reused
        seq.num_cached_tokens = reused
        seq.reuse_path = reuse_path(matched, match.entry_tokens, seq.prompt_len, seq.raw_prompt) \
            if match and reused else "root"
        seq.reuse_entry_id = match.entry_id if match and reused else -1
        if state and cache is not None and seq.cache_prompt and seq.retain:  # it may be retained: plan its page checkpoint
            boundary = (seq.prompt_len - 1) // P * P  # <= prompt_len - 1, below any frontier it retains
            seq.checkpoint_at = boundary if boundary >= P and boundary > reused else 0
        return True

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.config.max_concurrency:
            seq = self.waiting[0]
            staged = [s for s in self.running if s.status is SeqStatus.PREFILLING]
            # a staged prefill holds admission back until it finishes, except that packable requests
            # join staged packable ones: their whole prompts share one prefill unit (schedule)
            if not self.config.concurrent_prefill and staged and not (
                    seq.packable and all(s.packable for s in staged)):
                return
            if not self._try_admit(seq):
                return  # FIFO: the head waits until its entitlement fits
            self.waiting.popleft()
            used = {s.lane for s in self.running}
            seq.lane = next(i for i in range(self.config.max_concurrency) if i not in used)
            seq.status = SeqStatus.PREFILLING
            self.running.append(seq)
            self.newly_admitted.append(seq)

    # ---- the step -----------------------------------------------------------------------

    def _ensure_pages(self, seq: Sequence, num_tokens: int) -> None:
        need = pages_for_tokens(num_tokens, self.page_size) - len(seq.block_table)
        if need > 0:
            assert len(seq.block_table) + need <= seq.entitlement_pages, "sequence overran its entitlement"
            seq.block_table.extend(self.pool.allocate(need))

    def _work(self, seq: Sequence, start: int, end: int, sample: bool) -> SequenceWork:
        self._ensure_pages(seq, end)
        return SequenceWork(
            seq_id=seq.seq_id, token_ids=[seq.token_at(i) for i in range(start, end)], start_pos=start,
            block_table=list(seq.block_table), sample=sample, sampling=seq.sampling,
            output_token_ids=list(seq.output_token_ids), seed=seq.seed, state_slot=seq.state_slot,
            stop_token_ids=seq.stop_token_ids, return_hidden=seq.return_hidden and start < seq.prompt_len)

    def draft_limit(self, seq: Sequence) -> int:
        """The most drafts a decode row of `seq` may verify: its round must not pass the output
        budget (the drafts plus the token after them are at most the tokens it may still commit)."""
        return max(0, seq.max_output_tokens - len(seq.output_token_ids) - 1)

    def attach_drafts(self, seq: Sequence, work: SequenceWork, drafts: list[int]) -> None:
        """Make the decode row `work` of `seq` a speculative verify row over `drafts` (at most
        draft_limit), with pages for their positions (released again for rejected positions)."""
        assert work.num_drafts == 0 and len(work.token_ids) == 1 and len(drafts) <= self.draft_limit(seq)
        if not drafts:
            return
        self._ensure_pages(seq, work.start_pos + 1 + len(drafts))
        work.token_ids = work.token_ids + list(drafts)
        work.num_drafts = len(drafts)
        work.block_table = list(seq.block_table)

    def truncate_round(self, seq: Sequence, keep: int) -> None:
        """A stop string ended `seq` inside a verify round after its first `keep` output tokens:
        drop the round's later tokens (and their positions) before the caller finishes it."""
        drop = len(seq.output_token_ids) - keep
        if drop <= 0:
            return
        del seq.output_token_ids[keep:]
        seq.num_computed_tokens -= drop
        if seq.state_slot >= 0:  # the state advanced over the dropped inputs: retain no frontier
            seq.state_ahead = True

    def _pick_prefill(self, staged: list[Sequence]) -> Sequence:
        starved = [s for s in staged if s.passed_over >= MAX_PASSED_OVER]
        if starved:
            return starved[0]
        return min(staged, key=lambda s: s.remaining_prompt)  # ties: admission order

    def _rounds_before(self, unit_tokens: int) -> int:
        r = self.decode_rounds_per_prefill
        return max(1, -(-r * unit_tokens // self.config.prefill_chunk))

    def schedule(self) -> ScheduledBatch | None:
        """Admit what fits, then build the next step; None when there is nothing to run."""
        self.newly_admitted = []
        self._admit()
        staged = [s for s in self.running if s.status is SeqStatus.PREFILLING]
        decoding = [s for s in self.running if s.status is SeqStatus.DECODING]
        if staged:
            unit = self._pick_prefill(staged)
            n = min(self.config.prefill_chunk, unit.remaining_prompt)
            if unit.num_computed_tokens < unit.checkpoint_at < unit.num_computed_tokens + n and self._spare_slot():
                n = unit.checkpoint_at - unit.num_computed_tokens  # end the chunk at the checkpoint
            if not decoding or self._rounds_since_prefill >= self._rounds_before(n):
                self._rounds_since_prefill = 0
                for s in staged:
                    s.passed_over = 0 if s is unit else s.passed_over + 1
                start = unit.num_computed_tokens
                batch = ScheduledBatch([self._work(unit, start, start + n, start + n == unit.prompt_len)])
                if unit.packable and start + n == unit.prompt_len:
                    self._pack(batch, staged, unit, self.config.prefill_chunk - n)
                if unit.copy_src is not None:  # the partially reused page: copy before writing into it
                    batch.page_copies.append((unit.copy_src, unit.block_table[start // self.page_size]))
                if unit.state_copy_src is not None:  # resume from the entry's checkpoint
                    batch.state_copies.append((unit.state_copy_src, unit.state_slot))
                return self._with_captures(batch)
        if decoding:
            self._rounds_since_prefill += 1
            return self._with_captures(ScheduledBatch(
                [self._work(s, s.num_computed_tokens, s.num_computed_tokens + 1, True) for s in decoding]))
        return None

    def lookahead(self, batch: ScheduledBatch) -> ScheduledBatch | None:
        """The decode step after `batch` (the decode rows of every running sequence, launched and
        not yet updated), built before its tokens are known: each row's input is the token `batch`
        samples for it (ScheduledBatch.follows). None where that step could differ from what
        `schedule` builds after `update`: a request waits or prefills, a sequence ended, a row
        would reach its output budget or need a page, or the model keeps recurrent state."""
        if self.waiting or self.state_pool is not None or batch.page_copies or batch.state_copies:
            return None
        if len(batch.seqs) != len(self.running):
            return None
        by_id = {s.seq_id: s for s in self.running}
        rows = []
        for work in batch.seqs:
            seq = by_id.get(work.seq_id)
            if (seq is None or seq.status is not SeqStatus.DECODING or work.num_drafts or not work.sample
                    or len(work.token_ids) != 1 or work.start_pos != seq.num_computed_tokens):
                return None
            pos = seq.num_computed_tokens + 1  # the input of this row is the token `batch` samples
            if len(seq.output_token_ids) + 2 > seq.max_output_tokens or pos >= len(seq.block_table) * self.page_size:
                return None
            rows.append(SequenceWork(
                seq_id=seq.seq_id, token_ids=[FOLLOWS], start_pos=pos, block_table=list(seq.block_table),
                sample=True, sampling=seq.sampling, output_token_ids=[*seq.output_token_ids, FOLLOWS],
                seed=seq.seed, state_slot=seq.state_slot, stop_token_ids=seq.stop_token_ids))
        self._rounds_since_prefill += 1
        return ScheduledBatch(rows, follows=True)

    def _pack(self, batch: ScheduledBatch, staged: list[Sequence], unit: Sequence, budget: int) -> None:
        """Packable requests are prefill only (their one sampled token ends them): other staged
        ones whose whole remaining prompt fits the chunk's spare tokens run in the same forward,
        their copy-on-write page and checkpoint copies with it."""
        for s in staged:
            rest = s.remaining_prompt
            if s is unit or not s.packable or rest > budget or s.checkpoint_at:
                continue
            start = s.num_computed_tokens
            batch.seqs.append(self._work(s, start, s.prompt_len, True))
            if s.copy_src is not None:
                batch.page_copies.append((s.copy_src, s.block_table[start // self.page_size]))
            if s.state_copy_src is not None:
                batch.state_copies.append((s.state_copy_src, s.state_slot))
            s.passed_over = 0
            budget -= rest

    def _with_captures(self, batch: ScheduledBatch) -> ScheduledBatch:
        # pending page-checkpoint captures run first: they read working slots no row has advanced yet
        batch.state_copies[:0] = self._captures
        self._captures = []
        return batch

    def update(self, batch: ScheduledBatch, output: StepOutput) -> list[tuple[Sequence, int]]:
        """Advance every sequence of `batch` by the tokens it computed and append the sampled
        tokens. A stop token or the output budget finishes the request here; stop strings are
        the caller's (it calls `finish`). Returns (sequence, sampled token) pairs in batch order."""
        by_id = {s.seq_id: s for s in self.running}
        sampled: list[tuple[Sequence, int]] = []
        for work in batch.seqs:
            seq = by_id.get(work.seq_id)
            if seq is None:
                continue  # aborted between schedule and update
            verified = output.verified.get(work.seq_id, []) if work.num_drafts else []
            # a verify row computed its accepted inputs: its first token and the drafts reproduced
            seq.num_computed_tokens += len(work.token_ids) - work.num_drafts + len(verified)
            if work.num_drafts:  # release the pages of rejected positions
                keep = pages_for_tokens(seq.num_computed_tokens, self.page_size)
                self.pool.decref(seq.block_table[keep:])
                del seq.block_table[keep:]
            if seq.copy_src is not None:
                self.pool.decref([seq.copy_src])  # the copy ran with this batch
                seq.copy_src = None
            if seq.state_copy_src is not None:
                self.state_pool.decref([seq.state_copy_src])  # likewise the state copy
                seq.state_copy_src = None
            if seq.num_computed_tokens == seq.checkpoint_at:
                self._capture(seq)
            if not work.sample:
                continue
            seq.status = SeqStatus.DECODING
            for token in [output.sampled[work.seq_id], *verified]:
                seq.output_token_ids.append(token)
                sampled.append((seq, token))
                if token in seq.stop_token_ids:
                    self.finish(seq, "stop", token)
                elif len(seq.output_token_ids) >= seq.max_output_tokens:
                    self.finish(seq, "length")
                if seq.finished:
                    break
        return sampled

    def _spare_slot(self) -> bool:
        # a free state slot that the idle lanes could not need (counting what evicting unpinned
        # entries would give them): a page checkpoint takes only such a slot and evicts nothing
        state = self.state_pool
        idle_lanes = self.config.max_concurrency - len(self.running)
        freeable = self.prefix_cache.freeable_slots() if self.prefix_cache is not None else 0
        return state.num_free > 0 and state.num_free - 1 + freeable >= idle_lanes

    def _capture(self, seq: Sequence) -> None:
        # the working slot holds the state after exactly checkpoint_at tokens: copy it into a
        # spare slot with the next batch built (its copies run before any row advances a slot)
        if self._spare_slot():
            seq.checkpoint_slot = self.state_pool.allocate(1)[0]
            self._captures.append((seq.state_slot, seq.checkpoint_slot))

    # ---- gauges ---------------------------------------------------------------------------

    @property
    def num_prefilling(self) -> int:
        return sum(1 for s in self.running if s.status is SeqStatus.PREFILLING)

    @property
    def num_decode_ready(self) -> int:
        return sum(1 for s in self.running if s.status is SeqStatus.DECODING)
