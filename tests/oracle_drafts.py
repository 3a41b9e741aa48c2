"""Oracle drafts for speculative tests: a drafter that proposes the plain run's own continuation
(1..K drafts, cycling, one corrupted every third round), so rounds of every width end in full,
partial and no acceptance; and a greedy generation loop over a runner (torch or cuda)."""
from __future__ import annotations

from ninfer.engine.config import SchedulerConfig, SpecConfig
from ninfer.engine.engine import Engine
from ninfer.engine.lookup import LookupDrafter
from ninfer.engine.request import PreparedRequest, SamplingParams

GREEDY = SamplingParams(temperature=0.0)
K = 4


class OracleDrafter:
    """Proposes the plain run's continuation with 1..K drafts (cycling), corrupting one draft
    every third round: rounds of every width end in full, partial and no acceptance."""

    def __init__(self, prompt_len: int, reference: list[int], vocab: int) -> None:
        self.prompt_len, self.reference, self.vocab, self.rounds = prompt_len, reference, vocab, 0

    def new_state(self):
        return LookupDrafter(1, 1, 1).new_state()

    def propose(self, state, tokens: list[int], limit: int) -> list[int]:
        self.rounds += 1
        done = len(tokens) - self.prompt_len
        drafts = list(self.reference[done:done + min(limit, 1 + self.rounds % K)])
        if drafts and self.rounds % 3 == 1:
            i = (self.rounds // 3) % len(drafts)
            drafts[i] = (drafts[i] + 1) % self.vocab
        return drafts

    def observe(self, state, drafted: int, accepted: int) -> None:
        pass


def generate(runner, tokenizer, prompts: list[list[int]], spec: SpecConfig | None, oracle: list | None = None,
             max_tokens: int = 40) -> tuple[list[list[int]], object]:
    engine = Engine(runner, tokenizer, SchedulerConfig(prefix_reuse=False), model_max_context=2048, spec=spec)
    engine.start()
    try:
        outs = []
        for i, p in enumerate(prompts):
            if oracle is not None:
                engine.drafter = OracleDrafter(len(p), oracle[i], runner.vocab_size)
            ids = []
            for ev in engine.submit(PreparedRequest(request_id=f"r{i}", prompt_token_ids=p, sampling=GREEDY,
                                                    max_tokens=max_tokens, ignore_eos=True)):
                assert ev.error is None, ev.error
                ids += ev.token_ids
            outs.append(ids)
        return outs, engine.snapshot()
    finally:
        engine.shutdown()
