"""Speculative decoding on CPU: the acceptance rule, context-lookup drafting and its backoff, the
scheduler's verify rows (pages of rejected positions released, truncation), the accept/reject rule's
output distribution on a small vocabulary, and the real Engine on the default model (float32) and a
tiny Qwen3.5: committed tokens equal plain greedy token for token, with stops, EOS, budgets,
logprobs and grammar masks inside rounds."""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from ninfer.engine.batch import SequenceWork, StepOutput
from ninfer.engine.config import SchedulerConfig, SpecConfig
from ninfer.engine.kv_cache import PagePool, StatePool
from ninfer.engine.lookup import FAILS_BEFORE_BACKOFF, FIRST_BACKOFF, LookupDrafter
from ninfer.engine.request import PreparedRequest, SamplingParams
from ninfer.engine.scheduler import Scheduler, Sequence, SeqStatus
from ninfer.engine.speculative import accepted_drafts, position_rows, sample_rows
from ninfer.errors import ConfigError

GREEDY = SamplingParams(temperature=0.0)


# ---- the rule -----------------------------------------------------------------------------------------

def test_accepted_drafts_is_the_reproduced_prefix_ending_at_a_stop() -> None:
    assert accepted_drafts([5, 6, 7, 8], [5, 6, 7]) == 3  # all survive: 3 drafts + the bonus draw
    assert accepted_drafts([5, 9, 7, 8], [5, 6, 7]) == 1  # draft 2 rejected: 1 draft + the correction
    assert accepted_drafts([4, 6, 7, 8], [5, 6, 7]) == 0
    assert accepted_drafts([5, 2, 7, 8], [5, 2, 7], stop_token_ids=frozenset({2})) == 1  # nothing after EOS


def test_position_rows_count_the_drafts_before_each_position() -> None:
    s = SequenceWork(seq_id=3, token_ids=[10, 11, 12], start_pos=7, block_table=[0], sample=True,
                     sampling=GREEDY, output_token_ids=[9, 10], seed=5, num_drafts=2, draft_masks=["m1", "m2"],
                     token_mask="m0")
    rows = position_rows(s)
    assert [r.output_token_ids for r in rows] == [[9, 10], [9, 10, 11], [9, 10, 11, 12]]
    assert [r.token_mask for r in rows] == ["m0", "m1", "m2"]
    assert all(r.num_drafts == 0 and r.seed == 5 for r in rows)


def test_spec_config_validates() -> None:
    with pytest.raises(ConfigError, match="--draft-tokens"):
        SpecConfig("lookup", draft_tokens=16)
    with pytest.raises(ConfigError, match="--spec"):
        SpecConfig("eagle")
    with pytest.raises(ConfigError, match="ngram"):
        SpecConfig("lookup", ngram_min=4, ngram_max=3)


# ---- lookup drafting ----------------------------------------------------------------------------------

def test_lookup_proposes_what_followed_the_longest_recent_match() -> None:
    d = LookupDrafter(draft_tokens=3, ngram_min=1, ngram_max=3)
    st = d.new_state()
    #          0  1  2  3  4  5  6  7  8  9
    tokens = [1, 2, 3, 4, 9, 2, 3, 5, 6, 2, 3]
    # the tail "2 3" occurred at 1-2 (then 4) and 5-6 (then 5): the most recent wins; "9 2 3" never did
    assert d.propose(st, tokens, 10) == [5, 6, 2]
    # a longer match beats a more recent shorter one: "1 2 3" -> 4 over "2 3" -> 5
    tokens = tokens + [8, 1, 2, 3]
    assert d.propose(st, tokens, 10) == [4, 9, 2]
    assert d.propose(st, tokens, 1) == [4]  # the row's budget caps the drafts
    assert d.propose(st, [7, 8, 9], 10) == []  # nothing to match (a fresh state is per request)


def test_lookup_backs_off_after_failed_rounds_and_probes_again() -> None:
    d = LookupDrafter(draft_tokens=2, ngram_min=1, ngram_max=2)
    st = d.new_state()
    tokens = [1, 2, 1, 2, 1]
    for _ in range(FAILS_BEFORE_BACKOFF):
        assert d.propose(st, tokens, 5) == [2, 1]
        d.observe(st, 2, 0)
    for _ in range(FIRST_BACKOFF):  # plain decode while backing off
        assert d.propose(st, tokens, 5) == []
    assert st.fallback_steps == FIRST_BACKOFF
    assert d.propose(st, tokens, 5) == [2, 1]  # the probe
    d.observe(st, 2, 0)  # fails: backs off for twice as long at once
    assert st.skip == 2 * FIRST_BACKOFF
    st.skip = 0
    d.observe(st, 2, 1)  # a probe that lands resets the backoff
    assert st.backoff == 0 and st.failed_rounds == 0


# ---- the scheduler ------------------------------------------------------------------------------------

def _decoding(sched: Scheduler, prompt: list[int], max_out: int = 20, stop: frozenset[int] = frozenset()) -> Sequence:
    seq = Sequence(seq_id=0, request_id="r", prompt_token_ids=prompt, max_output_tokens=max_out,
                   sampling=GREEDY, stop_token_ids=stop)
    sched.add(seq)
    while seq.status is not SeqStatus.DECODING:  # the prompt (a hybrid one in two chunks)
        batch = sched.schedule()
        sched.update(batch, StepOutput(sampled={0: 50} if batch.seqs[0].sample else {}))
    return seq


def test_verify_row_commits_the_accepted_prefix_and_releases_rejected_pages() -> None:
    pool = PagePool(16, 4)
    sched = Scheduler(SchedulerConfig(prefix_reuse=False), pool)
    seq = _decoding(sched, [1, 2, 3, 4, 5, 6])  # 6 computed, output [50]
    batch = sched.schedule()
    work = batch.seqs[0]
    sched.attach_drafts(seq, work, [51, 52, 53, 54, 55])  # positions 6..11: pages for 12 tokens
    assert work.token_ids == [50, 51, 52, 53, 54, 55] and work.num_drafts == 5
    assert len(seq.block_table) == 3 and work.block_table == seq.block_table
    # drafts 51, 52 reproduced, 60 drawn instead of 53
    pairs = sched.update(batch, StepOutput(sampled={0: 51}, verified={0: [52, 60]}))
    assert [t for _, t in pairs] == [51, 52, 60]
    assert seq.output_token_ids == [50, 51, 52, 60]
    assert seq.num_computed_tokens == 9  # 6 + the inputs 50, 51, 52
    assert len(seq.block_table) == 3 and pool.num_used == 3  # 9 tokens: 3 pages; nothing else held
    batch = sched.schedule()
    sched.attach_drafts(seq, batch.seqs[0], [61])
    sched.update(batch, StepOutput(sampled={0: 70}, verified={0: []}))  # rejected at once
    assert seq.num_computed_tokens == 10 and len(seq.block_table) == 3


def test_draft_limit_keeps_a_round_inside_the_budget_and_stops_end_it() -> None:
    pool = PagePool(16, 4)
    sched = Scheduler(SchedulerConfig(prefix_reuse=False), pool)
    seq = _decoding(sched, [1, 2, 3], max_out=4, stop=frozenset({2}))
    assert sched.draft_limit(seq) == 2  # 1 of 4 out: 2 drafts + 1 drawn token reach 4
    batch = sched.schedule()
    sched.attach_drafts(seq, batch.seqs[0], [7, 2])
    pairs = sched.update(batch, StepOutput(sampled={0: 7}, verified={0: [2]}))  # EOS accepted
    assert [t for _, t in pairs] == [7, 2] and seq.finished and seq.finish_reason == "stop"
    assert pool.num_used == 0  # no prefix cache: every page back


def test_truncate_round_drops_tokens_after_a_stop_string_and_retains_no_stale_state() -> None:
    pool, states = PagePool(16, 4), StatePool(4)
    sched = Scheduler(SchedulerConfig(max_private_continuations=2), pool, state_pool=states)
    seq = _decoding(sched, [1, 2, 3, 4, 5])
    batch = sched.schedule()
    sched.attach_drafts(seq, batch.seqs[0], [51, 52])
    sched.update(batch, StepOutput(sampled={0: 51}, verified={0: [52, 53]}))
    assert seq.output_token_ids == [50, 51, 52, 53] and seq.num_computed_tokens == 8
    sched.truncate_round(seq, 2)  # a stop string completed at 51
    assert seq.output_token_ids == [50, 51] and seq.num_computed_tokens == 6 and seq.state_ahead
    sched.finish(seq, "stop", "x")
    assert len(sched.prefix_cache) == 0  # its working state is past the frontier: not retained
    assert pool.num_used == 0 and states.num_used == 0


# ---- the distribution ---------------------------------------------------------------------------------

def _chi2_ok(counts: np.ndarray, probs: np.ndarray) -> bool:
    """Pearson's chi-square over the cells with expected count >= 5, at the 0.999 quantile (a
    deterministic test: the seeds are fixed)."""
    n = counts.sum()
    keep = probs * n >= 5
    stat = float((((counts - n * probs) ** 2) / (n * probs))[keep].sum())
    dof = int(keep.sum()) - 1
    # Wilson-Hilferty approximation of the 0.999 quantile of chi2(dof)
    z = 3.09
    q = dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3
    return stat < q


def test_sampled_verification_keeps_the_target_distribution() -> None:
    """Small vocabulary, fixed target logits per position: over 6000 seeds the committed tokens
    follow the target distribution at position 0 and, given x0, at position 1; a draft survives with
    probability p(draft); and each seed commits what plain sampling with that seed draws."""
    vocab = 6
    logits0 = torch.tensor([1.0, 0.2, -0.5, 0.7, 0.0, -1.0])
    logits1 = torch.tensor([-0.3, 0.9, 0.4, 0.0, 1.2, -0.8])  # the target after the draft
    p0 = torch.softmax(logits0, 0).numpy().astype(np.float64)
    p1 = torch.softmax(logits1, 0).numpy().astype(np.float64)
    sp = SamplingParams(temperature=1.0, top_k=0, top_p=1.0)
    draft = 3
    first, second, accepted = np.zeros(vocab), np.zeros(vocab), 0
    n = 6000
    rows = [SequenceWork(seq_id=s, token_ids=[0, draft], start_pos=4, block_table=[0], sample=True, sampling=sp,
                         output_token_ids=[1], seed=s, num_drafts=1) for s in range(n)]
    logits = torch.stack([logits0, logits1]).repeat(n, 1).float()
    out, acc = sample_rows(logits, rows)
    plain, _ = sample_rows(logits0.repeat(n, 1).float(), [SequenceWork(
        seq_id=s, token_ids=[0], start_pos=4, block_table=[0], sample=True, sampling=sp, output_token_ids=[1],
        seed=s) for s in range(n)])
    for s in range(n):
        x0 = out.sampled[s]
        first[x0] += 1
        assert x0 == plain.sampled[s]  # the same draw as without speculation
        if acc[s]:
            assert x0 == draft
            accepted += 1
            second[out.verified[s][0]] += 1
        else:
            assert out.verified[s] == []
    assert _chi2_ok(first, p0)
    assert _chi2_ok(second, p1)
    rate, expect = accepted / n, p0[draft]
    assert abs(rate - expect) < 4 * math.sqrt(expect * (1 - expect) / n)


# ---- the real default model ---------------------------------------------------------------------------

class OracleDrafter:
    """Proposes the plain run's continuation, corrupting some drafts, so rounds end in full
    acceptance, rejection at a later position and rejection at the first."""

    def __init__(self, prompt_len: int, reference: list[int], draft_tokens: int) -> None:
        self.prompt_len, self.reference, self.k = prompt_len, reference, draft_tokens
        self.rounds = 0

    def new_state(self):
        return LookupDrafter(1, 1, 1).new_state()

    def propose(self, state, tokens: list[int], limit: int) -> list[int]:
        self.rounds += 1
        done = len(tokens) - self.prompt_len
        drafts = list(self.reference[done:done + min(limit, self.k)])
        if drafts and self.rounds % 3 == 1:  # corrupt one position
            i = (self.rounds // 3) % len(drafts)
            drafts[i] = (drafts[i] + 1) % 49152
        return drafts

    def observe(self, state, drafted: int, accepted: int) -> None:
        pass


@pytest.fixture(scope="module")
def f32_model(smollm2_artifact):
    from ninfer.engine.artifact import Artifact
    from ninfer.engine.backends.torch_runner import TorchModelRunner
    from ninfer.engine.tokenizer import Tokenizer

    artifact = Artifact.open(smollm2_artifact)
    return (TorchModelRunner(artifact, num_pages=64, page_size=64, dtype=torch.float32),
            Tokenizer.from_metadata(artifact.meta))


def _engine(model, spec: SpecConfig | None, **kw: object):
    from ninfer.engine.engine import Engine

    runner, tokenizer = model
    engine = Engine(runner, tokenizer, SchedulerConfig(prefix_reuse=False, **kw), model_max_context=4096, spec=spec)
    engine.start()
    return engine


def _collect(handle) -> tuple[list[int], str, list, object]:
    ids, text, lps, final = [], "", [], None
    for ev in handle:
        ids += ev.token_ids
        text += ev.text
        lps += ev.logprobs
        final = ev
    return ids, text, lps, final


def _chat(tokenizer, content: str) -> list[int]:
    return tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": content}]))


SOURCE = Path(__file__).resolve().parents[1] / "ninfer" / "engine" / "lookup.py"
PROMPTS = [
    "Repeat this code exactly:\n\n" + SOURCE.read_text()[1500:2300],
    "List the numbers from 1 to 30, separated by commas.",
    "Quote the first sentence of this text, then summarize it: The quick brown fox jumps over the lazy dog. "
    "The dog did not move. The fox ran into the forest and the dog slept on.",
    "Write a haiku about rain.",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n\nExplain this function and rewrite it iteratively.",
    "Say the word 'banana' ten times.",
    "What is the capital of France? Answer in one sentence and repeat the question first.",
    "Translate to French: The cat is on the table. The cat is on the chair. The cat is on the bed.",
]


@pytest.mark.slow
def test_lookup_greedy_equals_plain_greedy_on_the_default_model(f32_model) -> None:
    """float32, 8 prompts of several kinds: --spec lookup commits exactly the plain greedy tokens
    (drafts were verified and some accepted, so the verify path ran)."""
    _, tokenizer = f32_model
    prompts = [_chat(tokenizer, p) for p in PROMPTS]
    plain = _engine(f32_model, None)
    try:
        ref = [_collect(plain.submit(PreparedRequest(request_id=f"p{i}", prompt_token_ids=p, sampling=GREEDY,
                                                     max_tokens=48)))[0] for i, p in enumerate(prompts)]
    finally:
        plain.shutdown()
    spec = _engine(f32_model, SpecConfig("lookup", draft_tokens=4, ngram_min=1, ngram_max=3))
    try:
        drafted = accepted = 0
        for i, p in enumerate(prompts):
            ids, _, _, final = _collect(spec.submit(PreparedRequest(request_id=f"s{i}", prompt_token_ids=p,
                                                                    sampling=GREEDY, max_tokens=48)))
            assert ids == ref[i], PROMPTS[i][:40]
            drafted += final.timings.draft_n
            accepted += final.timings.draft_n_accepted
            assert final.timings.to_dict()["draft_n"] == final.timings.draft_n if final.timings.draft_n else True
        snap = spec.snapshot()
    finally:
        spec.shutdown()
    assert drafted > 0 and 0 < accepted < drafted
    assert snap.completed_drafted_tokens == drafted and snap.completed_accepted_tokens == accepted
    assert snap.committed_decode_tokens == sum(len(r) - 1 for r in ref)
    assert snap.decode_rounds < snap.committed_decode_tokens  # some rounds committed several tokens


@pytest.mark.slow
def test_bf16_verify_rows_commit_the_plain_greedy_tokens_on_the_default_model(smollm2_artifact) -> None:
    """bfloat16 (the CPU default): oracle drafts of every width 2..5, fully, partly and not
    accepted, commit exactly the plain greedy tokens: each query of a verify row attends as its
    decode step would (with one SDPA call over the row, one of these prompts diverged at token 7)."""
    from oracle_drafts import generate

    from ninfer.engine.artifact import Artifact
    from ninfer.engine.backends.torch_runner import TorchModelRunner
    from ninfer.engine.tokenizer import Tokenizer

    artifact = Artifact.open(smollm2_artifact)
    tokenizer = Tokenizer.from_metadata(artifact.meta)
    texts = ["Repeat exactly: the cat sat on the mat, the cat sat on the mat, the cat sat on the mat.",
             "List the numbers from 1 to 25, separated by commas.",
             "def add(a, b):\n    return a + b\n\nRewrite this function with type hints.",
             "Write a short poem about the sea."]
    prompts = [_chat(tokenizer, t) for t in texts]
    runner = TorchModelRunner(artifact, num_pages=64, page_size=64, dtype=torch.bfloat16)
    plain, _ = generate(runner, tokenizer, prompts, None)
    spec, snap = generate(runner, tokenizer, prompts, SpecConfig("lookup", draft_tokens=4), oracle=plain)
    assert spec == plain
    assert 0 < snap.accepted_tokens < snap.drafted_tokens


def test_rounds_with_stops_budgets_logprobs_and_sampling_match_plain_decode(f32_model) -> None:
    """Oracle drafts (the plain continuation, some corrupted): a stop string inside a round, EOS
    inside a round, the output budget, logprobs and seeded sampling give what plain decode gives."""
    runner, tokenizer = f32_model
    prompt = _chat(tokenizer, "Say hello and tell me your name in one short sentence.")
    sampled = SamplingParams(temperature=0.8, top_k=20, top_p=0.95, seed=7, logprobs=True, top_logprobs=3)
    cases = [dict(sampling=GREEDY, max_tokens=64),  # ends with EOS
             dict(sampling=SamplingParams(temperature=0.0, logprobs=True, top_logprobs=2), max_tokens=9),
             dict(sampling=sampled, max_tokens=40, stop=None)]
    plain = _engine(f32_model, None)
    try:
        refs = [_collect(plain.submit(PreparedRequest(request_id=f"p{i}", prompt_token_ids=prompt,
                                                      **{k: v for k, v in c.items() if v is not None})))
                for i, c in enumerate(cases)]
        # a stop string that completes in the middle of the greedy output
        words = refs[0][1].split()
        stop = " " + words[len(words) // 2]
        stop_ref = _collect(plain.submit(PreparedRequest(request_id="pstop", prompt_token_ids=prompt, sampling=GREEDY,
                                                         max_tokens=64, stop=[stop])))
    finally:
        plain.shutdown()
    assert refs[0][3].finish_reason == "stop" and refs[0][3].stop_reason in tokenizer.stop_token_ids
    assert stop_ref[3].finish_reason == "stop" and stop_ref[3].stop_reason == stop
    spec = _engine(f32_model, SpecConfig("lookup", draft_tokens=5))
    try:
        for i, (case, ref) in enumerate(zip(cases, refs)):
            spec.drafter = OracleDrafter(len(prompt), ref[0], 5)
            got = _collect(spec.submit(PreparedRequest(request_id=f"s{i}", prompt_token_ids=prompt,
                                                       **{k: v for k, v in case.items() if v is not None})))
            assert got[0] == ref[0] and got[1] == ref[1]
            assert (got[3].finish_reason, got[3].stop_reason) == (ref[3].finish_reason, ref[3].stop_reason)
            assert got[3].usage == ref[3].usage
            assert [lp.token_id for lp in got[2]] == [lp.token_id for lp in ref[2]]
            for a, b in zip(got[2], ref[2]):
                assert abs(a.logprob - b.logprob) < 1e-4
                assert [t for t, _ in a.top] == [t for t, _ in b.top]
            assert got[3].timings.draft_n_accepted > 0 and got[3].speculative["rounds"] > 0
        spec.drafter = OracleDrafter(len(prompt), refs[0][0], 5)
        got = _collect(spec.submit(PreparedRequest(request_id="sstop", prompt_token_ids=prompt, sampling=GREEDY,
                                                   max_tokens=64, stop=[stop])))
        assert got[0] == stop_ref[0] and got[1] == stop_ref[1] and got[3].usage == stop_ref[3].usage
        assert got[3].finish_reason == "stop" and got[3].stop_reason == stop
    finally:
        spec.shutdown()


def test_grammar_masks_apply_at_every_draft_position(f32_model) -> None:
    """A JSON-schema request under speculation: one mask per draft position; drafts the grammar
    refuses are cut before verification, and the output equals the plain constrained output."""
    from ninfer.engine.grammar import JsonGrammars

    runner, tokenizer = f32_model
    grammars = JsonGrammars(tokenizer, runner.vocab_size)
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"]}
    prompt = _chat(tokenizer, "Give me a JSON object with a person's name and age.")

    def request(rid: str) -> PreparedRequest:
        return PreparedRequest(request_id=rid, prompt_token_ids=prompt, sampling=GREEDY, max_tokens=40,
                               grammar=grammars.json_schema(schema, "schema", strict=True))

    plain = _engine(f32_model, None)
    try:
        ref = _collect(plain.submit(request("p")))
    finally:
        plain.shutdown()
    spec = _engine(f32_model, SpecConfig("lookup", draft_tokens=4))
    try:
        oracle = OracleDrafter(len(prompt), ref[0], 4)
        spec.drafter = oracle
        got = _collect(spec.submit(request("s")))
        assert got[0] == ref[0] and got[3].finish_reason == ref[3].finish_reason
        assert got[3].timings.draft_n_accepted > 0
        # a draft the grammar refuses ends the drafts there (a letter where JSON must start)
        matcher = grammars.json_schema(schema, "schema", strict=True).matcher()
        bad = tokenizer.encode("x")[0]
        brace = tokenizer.encode("{")[0]
        assert len(matcher.draft_masks([brace, bad, brace])) == 1
        assert len(matcher.draft_masks([bad])) == 0
        assert matcher.accept(brace)  # the matcher was left where it was
    finally:
        spec.shutdown()


# ---- a hybrid model -----------------------------------------------------------------------------------

def test_hybrid_lookup_greedy_equals_plain_greedy(tiny_qwen3_5_dirs: dict[str, Path], tmp_path: Path) -> None:
    """Tiny Qwen3.5 (float32): verification advances the recurrent state over the accepted inputs
    only (restored from the per-token states on rejection), so every later token is still the plain
    greedy one, across prompts and rounds of full, partial and no acceptance."""
    from ninfer.engine.artifact import Artifact
    from ninfer.engine.backends.torch_runner import TorchModelRunner
    from ninfer.engine.convert import convert
    from ninfer.engine.engine import Engine
    from ninfer.engine.tokenizer import Tokenizer

    artifact = Artifact.open(convert(tiny_qwen3_5_dirs["causal"], tmp_path / "q35.ninfer", weights="keep",
                                     progress=False))
    runner = TorchModelRunner(artifact, num_pages=64, page_size=16, dtype=torch.float32, num_state_slots=6)
    tokenizer = Tokenizer.from_metadata(artifact.meta)
    prompts = [[1, 504, 3458, 282, 4649, 314, 253, 1345, 30, 216, 11, 3012, 1183],
               [17, 923, 40211, 5, 5, 5, 880, 12, 31999, 7, 64, 1024, 2048, 4096, 77, 301, 19, 2, 48000, 3, 9],
               [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7]]

    def run(spec: SpecConfig | None, drafter_for=None) -> list[list[int]]:
        engine = Engine(runner, tokenizer, SchedulerConfig(prefix_reuse=False), model_max_context=1024, spec=spec)
        engine.start()
        try:
            outs = []
            for i, p in enumerate(prompts):
                if drafter_for is not None:
                    engine.drafter = drafter_for(i, p)
                outs.append(_collect(engine.submit(PreparedRequest(
                    request_id=f"r{i}", prompt_token_ids=p, sampling=GREEDY, max_tokens=24, ignore_eos=True)))[0])
            return outs
        finally:
            engine.shutdown()

    ref = run(None)
    assert run(SpecConfig("lookup", draft_tokens=3, ngram_min=1, ngram_max=2)) == ref
    assert run(SpecConfig("lookup", draft_tokens=4), lambda i, p: OracleDrafter(len(p), ref[i], 4)) == ref


# ---- --spec mtp ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def q35_mtp(tiny_qwen3_5_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory):
    """The tiny Qwen3.5 folder plus a random MTP head (mtp.*, as the released checkpoints carry it),
    converted; and the same folder converted without it."""
    import dataclasses
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    from ninfer.engine.artifact import Artifact
    from ninfer.engine.config import ModelConfig
    from ninfer.engine.convert import convert
    from ninfer.engine.models import expected_weights

    root = tmp_path_factory.mktemp("q35_mtp")
    folder = root / "tiny-qwen3_5-mtp"
    shutil.copytree(tiny_qwen3_5_dirs["causal"], folder)
    hf = json.loads((folder / "config.json").read_text())
    hf["mtp_num_hidden_layers"] = 1
    (folder / "config.json").write_text(json.dumps(hf))
    config = dataclasses.replace(ModelConfig.from_hf(hf), mtp_layers=1)
    state = load_file(str(folder / "model.safetensors"))
    gen = torch.Generator().manual_seed(5)
    for name, shape in expected_weights(config).items():
        if name.startswith("mtp."):
            scale = 0.1 if "norm" in name else 1.0 / math.sqrt(shape[-1])
            state[name] = torch.randn(shape, generator=gen) * scale
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with_head = Artifact.open(convert(folder, root / "mtp.ninfer", weights="keep", progress=False))
    without = Artifact.open(convert(tiny_qwen3_5_dirs["causal"], root / "plain.ninfer", weights="keep", progress=False))
    return with_head, without


def test_converter_keeps_a_whole_mtp_head_and_refuses_mtp_without_one(q35_mtp) -> None:
    from ninfer.engine.backends.torch_runner import TorchModelRunner
    from ninfer.engine.loader import check_spec

    with_head, without = q35_mtp
    assert with_head.meta.config.mtp_layers == 1 and "mtp.fc.weight" in with_head.meta.tensor_formats
    assert without.meta.config.mtp_layers == 0
    assert not any(n.startswith("mtp.") for n in without.meta.tensor_formats)
    with pytest.raises(ConfigError, match=r"mtp\.\* tensors"):
        check_spec(SpecConfig("mtp"), without.meta, "torch")
    with pytest.raises(ConfigError, match="torch backend"):
        check_spec(SpecConfig("mtp"), with_head.meta, "cuda")
    with pytest.raises(ConfigError, match=r"mtp\.\* tensors"):
        TorchModelRunner(without, num_pages=8, page_size=16, num_state_slots=2, mtp_draft_tokens=3)


def test_mtp_drafts_follow_the_sequence_as_a_fresh_computation_does(q35_mtp) -> None:
    """Runner level: after a prefill and after verify rounds (partial acceptance, state restored),
    the cached head proposes exactly the drafts a from-scratch computation over the same tokens does."""
    from ninfer.engine.backends.torch_runner import TorchModelRunner
    from ninfer.engine.batch import ScheduledBatch

    runner = TorchModelRunner(q35_mtp[0], num_pages=32, page_size=16, dtype=torch.float32, num_state_slots=2,
                              mtp_draft_tokens=3)
    prompt = [1, 504, 3458, 282, 4649, 314, 253, 1345, 30, 216, 11, 3012, 1183, 77, 301, 19, 2]
    pages = [5, 9, 2, 7]
    out = runner.run(ScheduledBatch([SequenceWork(seq_id=0, token_ids=prompt, start_pos=0, block_table=pages,
                                                  sample=True, sampling=GREEDY, state_slot=1)]))
    tokens = prompt + [out.sampled[0]]
    drafts = out.drafts[0]

    def check(step: int) -> None:  # the same drafts, and the head's output at the last pair to f32 rounding
        fresh_drafts, fresh_out = runner.mtp_fresh_drafts(tokens)
        assert drafts == fresh_drafts, step
        assert (runner.mtp.last_outputs[0] - fresh_out).abs().max().item() < 1e-4, step

    assert len(drafts) == 3
    check(-1)
    greedy = list(tokens)  # the plain greedy continuation, to propose drafts the target accepts
    while len(greedy) < len(tokens) + 20:
        greedy.append(int(runner.forward_logits(greedy)[-1].argmax()))
    for step in range(4):
        proposal = greedy[len(tokens):len(tokens) + 3]
        if step % 2:  # make the last draft wrong, so the round accepts two and rejects one
            proposal[-1] = (proposal[-1] + 1) % runner.vocab_size
        work = SequenceWork(seq_id=0, token_ids=[tokens[-1], *proposal], start_pos=len(tokens) - 1,
                            block_table=pages, sample=True, sampling=GREEDY, output_token_ids=tokens[len(prompt):],
                            state_slot=1, num_drafts=len(proposal))
        out = runner.run(ScheduledBatch([work]))
        tokens += [out.sampled[0], *out.verified[0]]
        assert len(out.verified[0]) == (2 if step % 2 else 3) and tokens == greedy[:len(tokens)]
        drafts = out.drafts[0]
        check(step)


def test_mtp_greedy_equals_plain_greedy(q35_mtp) -> None:
    """Through the Engine: --spec mtp commits the plain greedy tokens (tiny random weights)."""
    from ninfer.engine.backends.torch_runner import TorchModelRunner
    from ninfer.engine.engine import Engine
    from ninfer.engine.tokenizer import Tokenizer

    artifact = q35_mtp[0]
    tokenizer = Tokenizer.from_metadata(artifact.meta)
    prompts = [[1, 504, 3458, 282, 4649, 314, 253, 1345, 30, 216, 11], [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7],
               [17, 923, 40211, 5, 5, 5, 880, 12, 31999, 7, 64, 1024, 2048, 4096, 77, 301, 19, 2, 48000, 3]]

    def run(spec: SpecConfig | None) -> tuple[list[list[int]], object]:
        runner = TorchModelRunner(artifact, num_pages=64, page_size=16, dtype=torch.float32, num_state_slots=6,
                                  mtp_draft_tokens=3 if spec else 0)
        engine = Engine(runner, tokenizer, SchedulerConfig(prefix_reuse=False), model_max_context=1024, spec=spec)
        engine.start()
        try:
            outs = [_collect(engine.submit(PreparedRequest(request_id=f"r{i}", prompt_token_ids=p, sampling=GREEDY,
                                                           max_tokens=20, ignore_eos=True)))[0]
                    for i, p in enumerate(prompts)]
            return outs, engine.snapshot()
        finally:
            engine.shutdown()

    plain, _ = run(None)
    spec, snap = run(SpecConfig("mtp", draft_tokens=3))
    assert spec == plain
    assert snap.spec_method == "mtp" and snap.drafted_tokens > 0  # every decode round carried MTP drafts
