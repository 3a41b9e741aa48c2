"""Engine over a runner with recurrent state (a hybrid model's contract, without torch): the
runner keeps, per state slot, the token history a real recurrent state summarises, applies
state_copies first, and checks every row resumes exactly where its slot stands. A resumed
request must sample what a request computed from root samples, and the snapshot must count
the slots."""
from __future__ import annotations

import time

from engine_helpers import LetterTokens, generate

from ninfer.engine.batch import ScheduledBatch, StepOutput
from ninfer.engine.config import SchedulerConfig
from ninfer.engine.engine import Engine


class HistoryStateRunner:
    """State slot i holds the tokens its sequence consumed; a sample depends on the whole state."""

    page_size, num_pages, vocab_size = 4, 64, 26

    def __init__(self, num_state_slots: int) -> None:
        self.num_state_slots = num_state_slots
        self.states: list[tuple[int, ...] | None] = [None] * num_state_slots
        self.state_copies: list[tuple[int, int]] = []
        self.page_copies: list[tuple[int, int]] = []

    def copy_pages(self, copies: list[tuple[int, int]]) -> None:
        self.page_copies += copies

    def run(self, batch: ScheduledBatch) -> StepOutput:
        for src, dst in batch.state_copies:
            assert self.states[src] is not None, f"copy out of an empty slot {src}"
            self.states[dst] = self.states[src]
        self.state_copies += batch.state_copies
        sampled = {}
        for w in batch.seqs:
            assert w.state_slot >= 0
            state = () if w.start_pos == 0 else self.states[w.state_slot]
            assert state is not None and len(state) == w.start_pos, "resumed off the slot's position"
            self.states[w.state_slot] = state = state + tuple(w.token_ids)
            if w.sample:
                sampled[w.seq_id] = 1 + (sum(state) * 7 + len(state)) % 25  # never EOS (0)
        return StepOutput(sampled)


def wait_for(cond, deadline_s: float = 30.0) -> None:
    end = time.monotonic() + deadline_s
    while not cond():
        assert time.monotonic() < end, "condition not reached before the deadline"
        time.sleep(0.001)


def test_resumed_state_samples_what_root_samples_and_slots_are_counted() -> None:
    runner = HistoryStateRunner(num_state_slots=2 * 2 + 2)  # 2 lanes x (working + capture) + 2
    engine = Engine(runner, LetterTokens(), SchedulerConfig(max_concurrency=2), model_max_context=256)
    engine.start()
    try:
        snap = engine.snapshot()
        assert (snap.state_slots_total, snap.state_slots_used) == (6, 0)
        first, _ = generate(engine, "a", [3, 4, 5, 6, 7], 3)
        # the retained frontier is the prompt + the first two outputs (7 tokens, inside page 1)
        turn = [3, 4, 5, 6, 7] + first + [9, 9]
        resumed, final = generate(engine, "b", turn, 4)
        assert final.usage.cached_tokens == 7
        # a captured its page checkpoint at 4 (slot 0 -> 1); b resumed a's frontier (0 -> 2) and
        # captured its own at 8 (2 -> 3); the runner checked each copy's source stood at 4, 7, 8
        assert runner.state_copies == [(0, 1), (0, 2), (2, 3)] and runner.page_copies == [(1, 2)]
        fresh, final = generate(engine, "c", turn, 4, cache_prompt=False)
        assert final.usage.cached_tokens == 0 and fresh == resumed
        wait_for(lambda: engine.snapshot().running == 0)
        snap = engine.snapshot()
        (entry,) = snap.continuations  # b's conversation replaced a's; c was not retained
        assert entry.n_tokens == len(turn) + 3 and entry.state_slot == 2 and entry.page_checkpoints == ((8, 3),)
        assert snap.state_slots_used == 2
        # a prompt leaving b's conversation at token 9 resumes at its page checkpoint (8)
        branch = turn[:9] + [11, 12, 13]
        resumed, final = generate(engine, "d", branch, 4)
        assert final.usage.cached_tokens == 8 and runner.state_copies[-1] == (3, 5)
        fresh, final = generate(engine, "e", branch, 4, cache_prompt=False)
        assert final.usage.cached_tokens == 0 and fresh == resumed
    finally:
        engine.shutdown()
