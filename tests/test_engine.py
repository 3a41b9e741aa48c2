"""Engine: worker thread, submit/cancel from other threads, asyncio bridge, queue limits and
timeouts, stops, counters; then the real default model (batching faithfulness, cancellation,
prefix reuse, stop strings).

The fast tests run over a counting runner: each sampled token is the previous token + 1, and
token t reads as the letter chr(97 + t % 26); a runner gate lets a test hold the engine inside
a step without sleeping.
"""
from __future__ import annotations

import asyncio
import random
import threading
import time

import pytest

from ninfer.engine.batch import FOLLOWS, ScheduledBatch, StepOutput
from ninfer.engine.config import SchedulerConfig
from ninfer.engine.engine import Engine
from ninfer.engine.request import PreparedRequest, SamplingParams, Timings
from ninfer.engine.errors import ContextLengthExceeded, DuplicateRequest, EngineNotRunning, EngineOverloaded

EOS = 0
GREEDY = SamplingParams(temperature=0.0)


class LetterTokens:
    """token t <-> the letter chr(97 + t % 26); token 0 is the end of sequence."""

    stop_token_ids = frozenset({EOS})
    special_token_ids = frozenset({EOS})
    vocab_size = 26

    def token_bytes(self, token_id: int) -> bytes:
        return chr(97 + token_id % 26).encode()


class CountingRunner:
    """Samples last token + 1 (mod 26); records the batches; `gate` / `steps` (when set) hold run()."""

    def __init__(self, num_pages: int = 64, page_size: int = 64) -> None:
        self.num_pages, self.page_size, self.vocab_size = num_pages, page_size, 26
        self.batches: list[ScheduledBatch] = []
        self.gate: threading.Event | None = None
        self.steps: threading.Semaphore | None = None  # when set, each run() takes one permit
        self.entered = threading.Event()

    def run(self, batch: ScheduledBatch) -> StepOutput:
        self.entered.set()
        if self.gate is not None:
            assert self.gate.wait(30), "test never opened the runner gate"
        if self.steps is not None:
            assert self.steps.acquire(timeout=30), "test never released a step"
        self.batches.append(batch)
        return StepOutput({w.seq_id: (w.token_ids[-1] + 1) % 26 for w in batch.seqs if w.sample})


def engine_over(runner: CountingRunner, **kw: object) -> Engine:
    kw.setdefault("max_concurrency", 2)
    engine = Engine(runner, LetterTokens(), SchedulerConfig(**kw), model_max_context=4096)
    engine.start()
    return engine


def req(rid: str, prompt: list[int], **kw: object) -> PreparedRequest:
    kw.setdefault("sampling", GREEDY)
    return PreparedRequest(request_id=rid, prompt_token_ids=prompt, **kw)


def collect(handle) -> tuple[list[int], str, object]:
    ids: list[int] = []
    text = ""
    final = None
    for ev in handle:
        ids += ev.token_ids
        text += ev.text
        final = ev
    return ids, text, final


def wait_for(cond, deadline_s: float = 30.0) -> None:
    end = time.monotonic() + deadline_s
    while not cond():
        assert time.monotonic() < end, "condition not reached before the deadline"
        time.sleep(0.001)


def test_tokens_text_usage_and_length_finish() -> None:
    engine = engine_over(CountingRunner())
    try:
        ids, text, final = collect(engine.submit(req("a", [3, 4], max_tokens=5)))
        assert ids == [5, 6, 7, 8, 9] and text == "fghij"
        assert final.finish_reason == "length" and final.usage.completion_tokens == 5
        assert final.usage.prompt_tokens == 2 and final.timings.predicted_n == 5
        assert final.timings.prompt_n == 2 and final.timings.cache_n == 0
    finally:
        engine.shutdown()


def test_eos_and_stop_string_are_withheld() -> None:
    engine = engine_over(CountingRunner())
    try:
        ids, text, final = collect(engine.submit(req("a", [23], max_tokens=10)))  # x -> y, z, a(EOS)
        assert ids == [24, 25, 0] and text == "yz" and (final.finish_reason, final.stop_reason) == ("stop", EOS)
        ids, text, final = collect(engine.submit(req("b", [1], max_tokens=20, stop=["efg"])))
        assert ids == [2, 3, 4, 5, 6] and text == "cd"
        assert (final.finish_reason, final.stop_reason) == ("stop", "efg")
    finally:
        engine.shutdown()


def test_overload_and_context_errors() -> None:
    runner = CountingRunner()
    runner.gate = threading.Event()
    engine = engine_over(runner, max_concurrency=1, max_pending_requests=2)
    try:
        handles = [engine.submit(req("r0", [1], max_tokens=2))]
        with pytest.raises(DuplicateRequest) as dup:
            engine.submit(req("r0", [1], max_tokens=2))
        assert (dup.value.request_id, dup.value.field) == ("r0", "request_id")
        handles += [engine.submit(req(f"r{i}", [1], max_tokens=2)) for i in (1, 2)]
        with pytest.raises(EngineOverloaded) as over:
            engine.submit(req("r3", [1], max_tokens=2))
        assert over.value.capacity == 3
        with pytest.raises(ContextLengthExceeded) as long:
            engine.submit(req("long", [1] * 4096))
        assert (long.value.prompt_tokens, long.value.limit, long.value.field) == (4096, 4096, "prompt")
        runner.gate.set()
        assert [collect(h)[2].finish_reason for h in handles] == ["length"] * 3
        wait_for(lambda: engine.snapshot().admitted == 0)
        snap = engine.snapshot()
        assert snap.requests_rejected == 2 and snap.requests_finished == 3
        assert snap.prompt_tokens_total == 3 and snap.decode_rounds == 3 and snap.committed_decode_tokens == 3
    finally:
        engine.shutdown()
    with pytest.raises(EngineNotRunning):
        engine.submit(req("late", [1], max_tokens=2))


def test_pending_timeout_ends_a_waiting_request() -> None:
    runner = CountingRunner()
    runner.steps = threading.Semaphore(0)
    engine = engine_over(runner, max_concurrency=1, pending_timeout_ms=50)
    try:
        first = engine.submit(req("a", [1], max_tokens=4000, ignore_eos=True))
        # "a" holds the lane before "b" starts its 50 ms: a pause of the worker before it takes "a" in
        # (a garbage collection: ~100 ms seen) must not expire "a" instead
        wait_for(runner.entered.is_set)
        late = engine.submit(req("b", [1], max_tokens=2))

        def step_until_expired() -> bool:  # one engine step per poll: "a" holds the only lane
            runner.steps.release()
            return engine.snapshot().waiting_expired == 1
        wait_for(step_until_expired)
        ids, _, final = collect(late)
        assert ids == [] and (final.finish_reason, final.error) == ("error", "request_queue_timeout")
        assert final.usage.completion_tokens == 0
        first.cancel()
        runner.steps.release(10)
        assert collect(first)[2].finish_reason == "cancelled"
        assert engine.snapshot().requests_failed == 1
    finally:
        runner.steps.release(10_000)
        engine.shutdown()


def test_default_output_limit_follows_lane_share() -> None:
    engine = engine_over(CountingRunner(num_pages=32), max_concurrency=4)  # 2048 tokens, 512 a lane
    try:
        assert engine.max_context == 4096 and engine.context_limit == 2048
        assert engine.default_max_tokens(100) == 412
        assert engine.default_max_tokens(600) == 2048 - 600  # past its share: the remaining context
    finally:
        engine.shutdown()
    engine = engine_over(CountingRunner(num_pages=32), max_concurrency=4, default_max_tokens=1000)
    try:
        assert engine.default_max_tokens(100) == 1000 and engine.default_max_tokens(1500) == 548
        assert engine.derived_max_tokens(100) == 412
    finally:
        engine.shutdown()


def test_async_stream_and_cancel_on_close() -> None:
    runner = CountingRunner()
    engine = engine_over(runner)

    async def main() -> tuple[list[int], list[str | None]]:
        ids: list[int] = []
        async for ev in engine.stream(req("a", [3], max_tokens=4)):
            ids += ev.token_ids
        reasons: list[str | None] = []
        runner.steps = threading.Semaphore(3)  # the worker cannot run ahead to the length limit
        agen = engine.stream(req("b", [3], max_tokens=10_000, ignore_eos=True))
        async for ev in agen:
            reasons.append(ev.finish_reason)
            if len(reasons) == 3:
                break
        await agen.aclose()
        runner.steps.release(100)  # far fewer than the length limit: only the cancel can end it
        return ids, reasons

    try:
        ids, reasons = asyncio.run(main())
        assert ids == [4, 5, 6, 7] and reasons == [None, None, None]
        wait_for(lambda: engine.snapshot().requests_cancelled == 1)
        snap = engine.snapshot()
        assert snap.admitted == 0 and snap.running == 0
    finally:
        engine.shutdown()


class OverlappingRunner(CountingRunner):
    """A runner with run_overlapped: it gives the engine its host turn inside the step, as the cuda
    runner does while the step computes on the device."""

    def __init__(self) -> None:
        super().__init__()
        self.inside = False
        self.turns = 0

    def run_overlapped(self, batch: ScheduledBatch, while_running) -> StepOutput:
        self.inside = True
        try:
            while_running()
            self.turns += 1
            return self.run(batch)
        finally:
            self.inside = False


def test_events_go_out_during_the_next_step_or_at_idle() -> None:
    runner = OverlappingRunner()
    engine = engine_over(runner)
    seen = []  # per event: its tokens, finish reason, whether a step was running, requests counted finished
    done = threading.Event()

    def sink(ev) -> None:
        seen.append((ev.token_ids, ev.finish_reason, runner.inside, engine.snapshot().requests_finished))
        if ev.finish_reason is not None:
            done.set()
    try:
        engine.submit(req("a", [3], max_tokens=4), sink=sink)
        assert done.wait(30)
        assert [ids for ids, *_ in seen] == [(4,), (5,), (6,), (7,)]
        # the tokens of steps 1-3 went out while the next step ran, the last step's once the engine idled
        assert [inside for _, _, inside, _ in seen] == [True, True, True, False]
        assert seen[-1][1] == "length" and seen[-1][3] == 1  # counted before its final event went out
        assert runner.turns == len(runner.batches) == 4
    finally:
        engine.shutdown()


class LaunchingRunner(CountingRunner):
    """launch / collect, as the cuda runner: a launched step's samples exist on the "device" at once
    (a lookahead row, FOLLOWS, takes the previous launch's sample of its row); the host reads them
    in collect. Prefill rows go through run()."""

    def __init__(self) -> None:
        super().__init__()
        self.last: list[int] = []  # the previous launch's samples, by row
        self.in_flight = self.most_in_flight = 0

    def launch(self, batch: ScheduledBatch):
        if self.steps is not None:
            assert self.steps.acquire(timeout=30), "test never released a step"
        if batch.follows:
            assert len(batch.seqs) == len(self.last) and all(w.token_ids == [FOLLOWS] for w in batch.seqs)
            inputs = list(self.last)
        else:
            inputs = [w.token_ids[-1] for w in batch.seqs]
        self.batches.append(batch)
        self.last = [(t + 1) % 26 for t in inputs]
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        return batch, list(self.last)

    def collect(self, launched) -> StepOutput:
        batch, samples = launched
        self.in_flight -= 1
        return StepOutput({w.seq_id: t for w, t in zip(batch.seqs, samples)})


def test_decode_ahead_gives_the_same_tokens_and_stops_at_the_budget() -> None:
    runner = LaunchingRunner()
    engine = engine_over(runner, decode_ahead=True)
    try:
        ids, text, final = collect(engine.submit(req("a", [3, 4], max_tokens=6)))
        assert ids == [5, 6, 7, 8, 9, 10] and text == "fghijk" and final.finish_reason == "length"
        assert runner.most_in_flight == 2  # a step was launched before the one before it was read
        assert sum(b.follows for b in runner.batches) == 4  # decode steps 2..5 looked ahead
        assert len(runner.batches) == 6  # prefill + 5 decode steps: none past the budget
        assert final.timings.predicted_n == 6
    finally:
        engine.shutdown()


def test_decode_ahead_drops_the_row_of_a_sequence_that_stopped() -> None:
    runner = LaunchingRunner()
    engine = engine_over(runner, decode_ahead=True)
    try:
        ids, text, final = collect(engine.submit(req("a", [22], max_tokens=10)))  # w -> x, y, z, a(EOS)
        assert ids == [23, 24, 25, 0] and text == "xyz" and final.finish_reason == "stop"
        assert runner.batches[-1].follows  # the step after the stop token ran and was dropped
        assert engine.pool.num_used == len(engine.scheduler.prefix_cache.pages_held())
        ids, _, final = collect(engine.submit(req("b", [1], max_tokens=3)))
        assert ids == [2, 3, 4] and final.finish_reason == "length"
        assert engine.snapshot().committed_decode_tokens == 3 + 2  # the dropped row is not counted
    finally:
        engine.shutdown()


def test_decode_ahead_lets_a_new_request_in_and_keeps_lanes_apart() -> None:
    runner = LaunchingRunner()
    runner.steps = threading.Semaphore(0)
    engine = engine_over(runner, max_concurrency=2, decode_ahead=True)
    try:
        first = engine.submit(req("a", [1], max_tokens=12))
        for _ in range(4):
            runner.steps.release()
        wait_for(lambda: len(runner.batches) >= 3)
        second = engine.submit(req("b", [10], max_tokens=5))
        for _ in range(64):
            runner.steps.release()
        ids_a, _, _ = collect(first)
        ids_b, _, _ = collect(second)
        assert ids_a == [(1 + i) % 26 for i in range(1, 13)]
        assert ids_b == [11, 12, 13, 14, 15]
        both = [b for b in runner.batches if len(b.seqs) == 2]
        assert any(b.follows for b in both)  # the two lanes looked ahead together once b decoded
    finally:
        engine.shutdown()


def test_no_decode_ahead_where_the_next_sample_needs_the_last_token_or_when_turned_off() -> None:
    runner = LaunchingRunner()
    engine = engine_over(runner, decode_ahead=True)
    try:
        penalised = SamplingParams(temperature=0.0, presence_penalty=0.5)
        ids, _, _ = collect(engine.submit(req("a", [3], max_tokens=5, sampling=penalised)))
        assert ids == [4, 5, 6, 7, 8] and not any(b.follows for b in runner.batches)
    finally:
        engine.shutdown()
    runner = LaunchingRunner()
    engine = engine_over(runner, decode_ahead=False)  # SchedulerConfig.decode_ahead on is the default
    try:
        ids, _, _ = collect(engine.submit(req("a", [3], max_tokens=5)))
        assert ids == [4, 5, 6, 7, 8] and runner.most_in_flight == 0
    finally:
        engine.shutdown()


def test_runner_failure_fails_the_lanes_and_keeps_serving() -> None:
    class FailingOnce(CountingRunner):
        def run(self, batch: ScheduledBatch) -> StepOutput:
            if not self.batches:
                self.batches.append(batch)
                raise RuntimeError("device lost")
            return super().run(batch)

    engine = engine_over(FailingOnce(), max_concurrency=1)
    try:
        _, _, final = collect(engine.submit(req("a", [1], max_tokens=3)))
        assert final.finish_reason == "error" and "device lost" in final.error
        ids, _, final = collect(engine.submit(req("b", [1], max_tokens=3)))
        assert ids == [2, 3, 4] and final.finish_reason == "length"
        assert engine.pool.num_used == len(engine.scheduler.prefix_cache.pages_held()) == 1
        assert engine.failed is None
    finally:
        engine.shutdown()


@pytest.mark.parametrize("prefix_reuse", [False, True])
def test_hundred_cancellations_return_the_pool_to_baseline(prefix_reuse: bool) -> None:
    runner = CountingRunner(num_pages=64, page_size=16)
    runner.steps = threading.Semaphore(0)
    engine = engine_over(runner, max_concurrency=4, max_pending_requests=100, prefill_chunk=32,
                         prefix_reuse=prefix_reuse)
    rng = random.Random(0)
    try:
        handles = [engine.submit(req(f"c{i}", [rng.randrange(1, 26) for _ in range(rng.randrange(1, 90))],
                                     max_tokens=rng.randrange(1, 8), ignore_eos=True))
                   for i in range(100)]
        t0 = time.monotonic()

        def idle() -> bool:  # a snapshot taken after the submissions shows nothing in flight
            snap = engine.snapshot()
            return snap.published_at > t0 and snap.admitted == 0
        done_steps = 0
        for h in rng.sample(handles, len(handles)):  # cancel in random order, a few steps apart
            n = rng.randrange(0, 6)
            if n:
                runner.steps.release(n)
            done_steps += n
            wait_for(lambda: len(runner.batches) >= done_steps or idle())
            h.cancel()
        runner.steps.release(100_000)
        reasons = [collect(h)[2].finish_reason for h in handles]
        assert set(reasons) == {"cancelled", "length"}
        wait_for(lambda: engine.snapshot().admitted == 0)
        snap = engine.snapshot()
        assert snap.running == 0 and snap.waiting == 0
        assert snap.requests_cancelled == reasons.count("cancelled") and snap.requests_finished == reasons.count("length")
        retained = engine.scheduler.prefix_cache.pages_held() if prefix_reuse else set()
        assert snap.kv_pages_used == len(retained) and engine.pool.num_free == 64 - len(retained)
        assert (len(retained) > 0) == prefix_reuse
    finally:
        runner.steps.release(100_000)
        engine.shutdown()


def test_timings_follow_the_spec_arithmetic() -> None:
    # the spec's terminal example: generation rates span predicted_n - 1 intervals
    t = Timings(cache_n=4096, prompt_n=4096, prompt_ms=83.0, predicted_n=129, predicted_ms=1140.0).to_dict()
    assert t["prompt_per_token_ms"] == 0.020263671875 and t["prompt_per_second"] == pytest.approx(49349.39759036145)
    assert t["predicted_per_token_ms"] == 8.90625 and t["predicted_per_second"] == pytest.approx(112.28070175438596)
    # its progress example: prompt_n is the whole suffix, the rates span the 2,048 processed so far
    t = Timings(4096, 4096, 41.5, 0, 0.0, prompt_processed_n=2048).to_dict()
    assert t["prompt_n"] == 4096 and t["prompt_per_token_ms"] == 0.020263671875
    assert t["prompt_per_second"] == pytest.approx(49349.39759036145)
    assert t["predicted_per_token_ms"] == t["predicted_per_second"] == 0.0
    one = Timings(0, 5, 0.0, 1, 0.0).to_dict()  # zero-duration and one-token cases: finite zeros
    assert one["prompt_per_second"] == one["predicted_per_second"] == one["predicted_per_token_ms"] == 0.0


def test_prompt_progress_and_per_token_timings() -> None:
    engine = engine_over(CountingRunner(num_pages=64, page_size=16), max_concurrency=1, prefill_chunk=32)
    prompt = [1 + i % 20 for i in range(80)]
    hints = {"return_progress": True, "timings_per_token": True}
    try:
        events = list(engine.submit(req("a", prompt, max_tokens=3, ignore_eos=True, hints=hints)))
        progress = [e for e in events if e.progress is not None]
        assert [(p.progress.total, p.progress.cache, p.progress.processed) for p in progress] == [
            (80, 0, 0), (80, 0, 32), (80, 0, 64), (80, 0, 80)]  # admission, then each prefill unit
        assert events[:4] == progress and all(not p.token_ids and p.finish_reason is None for p in progress)
        for p in progress:  # prompt-only snapshots: the whole suffix, rates over what was processed
            t = p.timings
            assert (t.cache_n, t.prompt_n, t.prompt_processed_n, t.predicted_n) == (0, 80, p.progress.processed, 0)
            assert t.prompt_ms == p.progress.elapsed_ms
        assert [p.progress.elapsed_ms for p in progress] == sorted(p.progress.elapsed_ms for p in progress)
        outputs = events[4:]
        assert [e.timings.predicted_n for e in outputs] == [1, 2, 3]  # a running snapshot on every event
        assert all(e.timings.prompt_processed_n is None and e.timings.prompt_n == 80 for e in outputs)
        assert outputs[-1].finish_reason == "length"
        assert outputs[0].timings.prompt_ms >= progress[-1].timings.prompt_ms

        # the next turn reuses the retained session: the first progress event has processed == cache
        turn = prompt + [e.token_ids[0] for e in outputs] + [5, 6]
        events = list(engine.submit(req("b", turn, max_tokens=2, ignore_eos=True, hints=hints)))
        first = events[0].progress
        assert first.cache == first.processed > 0 and first.total == len(turn)
        assert events[0].timings.prompt_n == len(turn) - first.cache

        # without the hints: no progress events; the first output event carries the prompt phase
        events = list(engine.submit(req("c", [7, 8, 9], max_tokens=3, ignore_eos=True)))
        assert all(e.progress is None for e in events) and len(events) == 3
        assert (events[0].timings.prompt_n, events[0].timings.predicted_n) == (3, 1)
        assert events[1].timings is None and events[2].timings.predicted_n == 3
    finally:
        engine.shutdown()


def test_final_event_names_the_slot_the_session_was_retained_in() -> None:
    engine = engine_over(CountingRunner(num_pages=64, page_size=16), max_concurrency=1,
                         max_private_continuations=2)
    try:
        finals = [collect(engine.submit(req(r, p, max_tokens=2, ignore_eos=True)))[2]
                  for r, p in (("a", [1, 2]), ("b", [5, 6]))]
        assert [f.slot_id for f in finals] == [0, 1]
        _, _, c = collect(engine.submit(req("c", [9, 9], max_tokens=2, ignore_eos=True)))
        assert c.slot_id == 0  # the catalog was full: the LRU session ("a") gave up its cell
        wait_for(lambda: engine.snapshot().requests_finished == 3)
        cells = {ci.slot: ci for ci in engine.snapshot().continuations}
        assert sorted(cells) == [0, 1]
        # the session includes the last sampled token, which is not yet executed
        assert cells[0].session == (9, 9, 10, 11) and cells[0].n_tokens == 3
        assert cells[1].session == (5, 6, 7, 8)
        _, _, d = collect(engine.submit(req("d", [3, 3], max_tokens=2, cache_prompt=False)))
        assert d.slot_id is None and d.finish_reason == "length"  # kept out of the context cache
    finally:
        engine.shutdown()
    engine = engine_over(CountingRunner(), prefix_reuse=False)
    try:
        assert collect(engine.submit(req("a", [1, 2], max_tokens=2)))[2].slot_id is None
    finally:
        engine.shutdown()


# ---- the real default model ------------------------------------------------------------------

NEAR_TIE = 0.02  # top-2 logit margin below which batched float arithmetic may pick either token
PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "1, 2, 3, 4,",
    "Once upon a time, in a small village at the edge of a dark forest, there lived",
    "def fibonacci(n):",
    "The three primary colors are",
    "Q: What is the boiling point of water?\nA:",
    "Translate to French: good morning, my friend.",
]


@pytest.fixture(scope="module")
def model(smollm2_artifact):
    """(runner, tokenizer) over the default model: 64 pages of 64 tokens, shared by the tests
    (one Engine at a time)."""
    from ninfer.engine.artifact import Artifact
    from ninfer.engine.backends.torch_runner import TorchModelRunner
    from ninfer.engine.tokenizer import Tokenizer

    artifact = Artifact.open(smollm2_artifact)
    return TorchModelRunner(artifact, num_pages=64, page_size=64), Tokenizer.from_metadata(artifact.meta)


def real_engine(model, **kw: object) -> Engine:
    runner, tokenizer = model
    engine = Engine(runner, tokenizer, SchedulerConfig(**kw), model_max_context=8192)
    engine.start()
    return engine


@pytest.mark.slow
def test_batching_is_faithful(model) -> None:
    runner, tokenizer = model
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    engine = real_engine(model, max_concurrency=8, prefix_reuse=False, prefill_chunk=16)
    try:
        alone = [collect(engine.submit(req(f"a{i}", p, max_tokens=12, ignore_eos=True)))[0]
                 for i, p in enumerate(prompts)]
        handles = [engine.submit(req(f"b{i}", p, max_tokens=12, ignore_eos=True)) for i, p in enumerate(prompts)]
        batched = [collect(h)[0] for h in handles]
        assert engine.snapshot().decode_row_rounds > engine.snapshot().decode_rounds  # rows did share rounds
    finally:
        engine.shutdown()
    for p, a, b in zip(prompts, alone, batched):
        assert len(a) == len(b) == 12
        k = next((i for i in range(12) if a[i] != b[i]), None)
        if k is not None:  # only a near-tie in the reference may flip
            top2 = runner.forward_logits(p + a[:k])[-1].topk(2).values
            assert float(top2[0] - top2[1]) < NEAR_TIE, (k, a, b)


class AheadAdapter:
    """The real torch runner behind launch / collect (tests only): the step runs at launch, and a
    FOLLOWS row takes the token the previous launch drew for its row, substituted on the host."""

    def __init__(self, runner) -> None:
        self.runner = runner
        self.last: list[int] = []
        self.follows = 0

    def __getattr__(self, name: str):
        return getattr(self.runner, name)

    def launch(self, batch: ScheduledBatch) -> StepOutput:
        if batch.follows:
            self.follows += 1
            for work, token in zip(batch.seqs, self.last, strict=True):
                work.token_ids = [token]
                work.output_token_ids = [*work.output_token_ids[:-1], token]
        out = self.runner.run(batch)
        self.last = [out.sampled[w.seq_id] for w in batch.seqs]
        return out

    def collect(self, launched: StepOutput) -> StepOutput:
        return launched


@pytest.mark.slow
def test_decode_ahead_draws_what_step_by_step_decoding_draws(model) -> None:
    runner, tokenizer = model
    prompts = [tokenizer.encode(p) for p in PROMPTS[:3]]
    samplings = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, top_p=0.9, seed=5)]
    results = []
    for ahead in (False, True):
        used = AheadAdapter(runner) if ahead else runner
        engine = Engine(used, tokenizer, SchedulerConfig(max_concurrency=2, prefix_reuse=False, decode_ahead=True),
                        model_max_context=8192)
        engine.start()
        try:
            results.append([collect(engine.submit(req(f"r{i}{j}", p, max_tokens=16, ignore_eos=True, sampling=sp)))[0]
                            for i, p in enumerate(prompts) for j, sp in enumerate(samplings)])
        finally:
            engine.shutdown()
    assert used.follows >= len(prompts) * len(samplings) * 13  # decode steps 2..15 of each looked ahead
    assert results[1] == results[0]


@pytest.mark.slow
def test_real_cancellations_return_the_pool_to_baseline(model) -> None:
    _, tokenizer = model
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    engine = real_engine(model, max_concurrency=4, max_pending_requests=100, prefill_chunk=8)
    rng = random.Random(1)
    finals: dict[str, object] = {}

    def sink(ev) -> None:  # runs on the engine thread
        if ev.finish_reason is not None:
            finals[ev.request_id] = ev

    def steps() -> int:
        snap = engine.snapshot()
        return snap.decode_rounds + snap.prefill_units

    try:
        assert engine.snapshot().kv_pages_used == 0
        ids = [f"c{i}" for i in range(100)]
        for i, rid in enumerate(ids):
            engine.submit(req(rid, prompts[i % 8], max_tokens=24, ignore_eos=True, cache_prompt=False), sink)
        cancelled: set[str] = set()
        for rid in rng.sample(ids, len(ids)):  # each cancel 0-2 engine steps after the previous one
            target = steps() + rng.randrange(0, 3)
            wait_for(lambda: steps() >= target or all(r in finals for r in ids if r not in cancelled))
            engine.cancel(rid)
            cancelled.add(rid)
        wait_for(lambda: len(finals) == 100)
        reasons = [finals[r].finish_reason for r in ids]
        assert set(reasons) <= {"cancelled", "length"} and reasons.count("cancelled") >= 50
        wait_for(lambda: engine.snapshot().admitted == 0 and engine.snapshot().running == 0)
        snap = engine.snapshot()
        assert snap.kv_pages_used == 0  # cache_prompt=False: nothing retained
        assert snap.requests_cancelled == reasons.count("cancelled")
        assert snap.prefill_units + snap.decode_rounds >= 50  # cancels landed between real steps
    finally:
        engine.shutdown()


@pytest.mark.slow
def test_prefix_reuse_is_exact_and_output_unchanged(model) -> None:
    runner, tokenizer = model
    engine = real_engine(model, max_concurrency=1)
    cow = engine.scheduler.copy_on_write
    try:
        first = tokenizer.encode(PROMPTS[3])
        ids, _, final = collect(engine.submit(req("t1", first, max_tokens=6, ignore_eos=True)))
        assert final.usage.cached_tokens == 0
        frontier = len(first) + len(ids) - 1  # the last sampled token has no KV yet
        turn2 = first + ids + tokenizer.encode(" And then")
        ids2, _, final2 = collect(engine.submit(req("t2", turn2, max_tokens=6, ignore_eos=True)))
        expect = frontier if cow else frontier // 64 * 64
        assert final2.usage.cached_tokens == final2.timings.cache_n == expect
        assert final2.timings.prompt_n == len(turn2) - expect
        fresh, _, final3 = collect(engine.submit(req("t3", turn2, max_tokens=6, ignore_eos=True, cache_prompt=False)))
        assert final3.usage.cached_tokens == 0 and fresh == ids2
        # a long raw prompt sent twice resumes all but its last token (a page boundary without copies)
        long = (tokenizer.encode(" ".join(PROMPTS)) * 8)[:530]
        collect(engine.submit(req("r1", long, max_tokens=2, raw_prompt=True)))
        again, _, final4 = collect(engine.submit(req("r2", long, max_tokens=2, raw_prompt=True)))
        assert final4.usage.cached_tokens == (529 if cow else 512)
        snap = engine.snapshot()
        if cow:
            assert snap.context_selections["private_endpoint"] == 1
            assert snap.context_selections["private_long_anchor"] == 1
        assert snap.reused_prompt_tokens == expect + final4.usage.cached_tokens
    finally:
        engine.shutdown()


@pytest.mark.slow
def test_stop_string_is_withheld_and_never_split(model) -> None:
    _, tokenizer = model
    engine = real_engine(model, max_concurrency=2)
    try:
        prompt = tokenizer.encode(PROMPTS[3])
        _, full, _ = collect(engine.submit(req("s0", prompt, max_tokens=24, ignore_eos=True, cache_prompt=False)))
        words = full.split()
        assert len(words) >= 4
        stop = " " + words[2]
        cut = full[:full.index(stop)]
        deltas = []
        final = None
        for ev in engine.submit(req("s1", prompt, max_tokens=24, ignore_eos=True, stop=[stop], cache_prompt=False)):
            deltas.append(ev.text)
            final = ev
        assert "".join(deltas) == cut
        assert (final.finish_reason, final.stop_reason) == ("stop", stop)
        assert not any(stop in d for d in deltas)
    finally:
        engine.shutdown()
