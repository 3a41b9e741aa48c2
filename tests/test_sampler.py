from __future__ import annotations

import math

import pytest
import torch

from ninfer.engine.batch import SequenceWork
from ninfer.engine.request import SamplingParams
from ninfer.engine.sampler import OUTSIDE_TOP_LOGPROB, _logprob_records, sample

VOCAB = 1000


def _seq(seed: int = 0, output: list[int] | None = None, **sampling: object) -> SequenceWork:
    return SequenceWork(seq_id=seed, token_ids=[1], start_pos=0, block_table=[0], sample=True,
                        sampling=SamplingParams(**sampling), output_token_ids=list(output or []), seed=seed)


def _logits(n: int, seed: int = 0, scale: float = 3.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, VOCAB, generator=gen) * scale


def test_greedy_is_argmax_with_lowest_id_on_ties() -> None:
    logits = _logits(4)
    logits[3, 7] = logits[3, 500] = logits[3].max() + 1.0  # a tie: id 7 must win
    ids, records = sample(logits, [_seq(i, temperature=0.0) for i in range(4)])
    assert ids[:3] == logits[:3].argmax(dim=-1).tolist()
    assert ids[3] == 7
    assert records == [None] * 4


def test_caller_logits_unchanged() -> None:
    logits = _logits(1)
    before = logits.clone()
    sample(logits, [_seq(1, output=[5, 5, 9], presence_penalty=1.0, frequency_penalty=0.5)])
    assert torch.equal(logits, before)


def test_same_seed_same_stream_independent_of_batch() -> None:
    logits = _logits(1, scale=0.5)  # flat: many candidates are likely
    def stream(seed: int, companions: int) -> list[int]:
        out: list[int] = []
        for _ in range(30):
            seqs = [_seq(seed, output=out)] + [_seq(1000 + c, output=out) for c in range(companions)]
            ids, _ = sample(logits.expand(len(seqs), -1).contiguous(), seqs)
            out.append(ids[0])
        return out
    alone = stream(42, 0)
    assert stream(42, 3) == alone
    assert stream(43, 0) != alone
    assert len(set(alone)) > 3  # it really samples


def test_top_k_one_and_tiny_top_p_equal_greedy() -> None:
    logits = _logits(6, scale=0.5)
    greedy = logits.argmax(dim=-1).tolist()
    ids_k, _ = sample(logits, [_seq(i, top_k=1, temperature=1.5) for i in range(6)])
    ids_p, _ = sample(logits, [_seq(i, top_p=1e-6, temperature=1.5) for i in range(6)])
    assert ids_k == greedy
    assert ids_p == greedy


def test_min_p_filters_relative_to_max() -> None:
    logits = torch.full((1, VOCAB), -20.0)
    # Relative to the most likely: 1, 0.5, 0.15, 0.05 (absolute probs ~0.59, 0.29, 0.088, 0.029).
    logits[0, 10:14] = torch.tensor([1.0, 0.5, 0.15, 0.05]).log()
    drawn = {sample(logits, [_seq(s, min_p=0.1)])[0][0] for s in range(300)}
    assert drawn == {10, 11, 12}
    drawn_all = {sample(logits, [_seq(s, min_p=0.0)])[0][0] for s in range(300)}
    assert drawn_all == {10, 11, 12, 13}


def test_top_p_keeps_smallest_set_reaching_p() -> None:
    logits = torch.full((1, VOCAB), -30.0)
    logits[0, 20:23] = torch.tensor([0.5, 0.3, 0.2]).log()
    for top_p, expected in ((0.45, {20}), (0.7, {20, 21}), (0.85, {20, 21, 22})):
        drawn = {sample(logits, [_seq(s, top_p=top_p)])[0][0] for s in range(200)}
        assert drawn == expected, top_p


def test_penalties_change_argmax() -> None:
    logits = torch.zeros(1, VOCAB)
    logits[0, 3] = 2.0
    logits[0, 4] = 1.5
    assert sample(logits, [_seq(0, output=[3], temperature=0.0)])[0] == [3]
    assert sample(logits, [_seq(0, output=[3], temperature=0.0, presence_penalty=1.0)])[0] == [4]
    # Presence counts a token once; frequency counts every occurrence.
    assert sample(logits, [_seq(0, output=[3, 3, 3], temperature=0.0, presence_penalty=0.4)])[0] == [3]
    assert sample(logits, [_seq(0, output=[3, 3, 3], temperature=0.0, frequency_penalty=0.2)])[0] == [4]
    # A negative penalty favours repeats.
    assert sample(logits, [_seq(0, output=[4], temperature=0.0, presence_penalty=-1.0)])[0] == [4]


def test_empirical_distribution_matches_tempered_top_k() -> None:
    base = torch.tensor([2.0, 1.6, 1.2, 1.0, 0.5, 0.3, 0.0])
    logits = torch.full((1, VOCAB), -5.0)
    logits[0, 100:107] = base
    temperature, top_k, draws = 0.7, 4, 4000
    seqs = [_seq(s, temperature=temperature, top_k=top_k) for s in range(draws)]
    ids, _ = sample(logits.expand(draws, -1).contiguous(), seqs)
    counts = torch.bincount(torch.tensor(ids), minlength=VOCAB).float() / draws
    expected = torch.softmax(base[:top_k] / temperature, dim=0)
    assert counts[100:100 + top_k].sum().item() == 1.0  # nothing outside the top 4
    # Binomial sd is <= 0.008 at 4000 draws; ignoring T (p0 0.40 vs 0.47) or top_k fails this.
    assert torch.max(torch.abs(counts[100:100 + top_k] - expected)).item() < 0.03


def test_logprobs_match_log_softmax_after_penalties_and_temperature() -> None:
    logits = _logits(2)
    seqs = [_seq(0, output=[1, 1, 2], temperature=0.8, frequency_penalty=0.5, presence_penalty=0.25,
                 logprobs=True, top_logprobs=5),
            _seq(1, temperature=0.0, logprobs=True, top_logprobs=20)]
    ids, records = sample(logits, seqs)
    pen = logits[0].clone()
    pen[1] -= 0.25 + 2 * 0.5
    pen[2] -= 0.25 + 0.5
    ref0 = torch.log_softmax(pen / 0.8, dim=-1)
    ref1 = torch.log_softmax(logits[1], dim=-1)  # greedy reports at T = 1
    for rec, tok, ref, n_top in ((records[0], ids[0], ref0, 5), (records[1], ids[1], ref1, 20)):
        assert rec is not None and rec.token_id == tok
        assert rec.logprob == pytest.approx(ref[tok].item(), abs=1e-5)
        vals, idx = torch.topk(ref, n_top)
        assert [t for t, _ in rec.top] == idx.tolist()
        assert [lp for _, lp in rec.top] == pytest.approx(vals.tolist(), abs=1e-5)
    assert records[1].logprob == records[1].top[0][1]


def test_masked_tokens_never_listed_and_outside_top_reports_sentinel() -> None:
    logits = torch.full((1, VOCAB), float("-inf"))
    logits[0, [5, 6, 7]] = torch.tensor([1.0, 0.5, 0.0])  # a structured-output mask left 3 tokens
    ids, records = sample(logits, [_seq(3, logprobs=True, top_logprobs=10)])
    assert ids[0] in (5, 6, 7)
    assert [t for t, _ in records[0].top] == [5, 6, 7]
    assert sum(math.exp(lp) for _, lp in records[0].top) == pytest.approx(1.0)
    # A token outside the 20 most likely (possible with a caller-forced id) reports -9999.
    wide = _logits(1)
    top_vals, top_ids = torch.topk(wide, 20)
    outsider = int(torch.argmin(wide))
    rec = _logprob_records(wide, top_vals, top_ids, torch.tensor([outsider]), [_seq(0, logprobs=True)])[0]
    assert rec.logprob == OUTSIDE_TOP_LOGPROB and rec.top == ()
