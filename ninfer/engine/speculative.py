"""Speculative verification: the rule that turns a verify row's per-position draws into committed
tokens, shared by every runner.

A verify row computes its last committed token t and K drafts d_1..d_K at consecutive positions, so
the logits at position i predict the token after d_i (after t for i = 0). Every position draws a
token with the one sampler (ninfer.engine.sampler) as a plain decode step at that point would: the
drafts before it count as output (penalties, and the RNG step len(output) + i), and position i's
grammar mask is the mask after the drafts before it. The row commits x_0, and x_i for i >= 1 as
long as every draft before it was reproduced (x_{j-1} == d_j for j <= i): the accepted drafts plus
one corrected (or, when all K survive, bonus) token.

Drafts here are deterministic proposals (a context lookup, a greedy MTP head): a point-mass draft
distribution q = delta(d). For it this coupled draw is the standard accept/reject rule: the draft
survives with probability p(d) = min(1, p(d) / q(d)), and after a rejection the committed token
is distributed as p without d, renormalized, which is norm(max(0, p - q)). So the output
distribution is the target's, and, because a position's random number depends only on (seed,
output position), a seeded request commits the same tokens with and without speculation (up to
the numerics of computing K + 1 positions in one forward).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from ninfer.engine.batch import SequenceWork, StepOutput

MAX_DRAFT_TOKENS = 15


def position_rows(seq: SequenceWork) -> list[SequenceWork]:
    """The sampling rows of a verify row's K + 1 positions (position i sees drafts[:i] as output)."""
    drafts = seq.drafts
    masks = [seq.token_mask, *(seq.draft_masks or [None] * seq.num_drafts)]
    return [dataclasses.replace(seq, output_token_ids=seq.output_token_ids + drafts[:i], token_mask=masks[i],
                                num_drafts=0, draft_masks=[])
            for i in range(seq.num_drafts + 1)]


def accepted_drafts(draws: Sequence[int], drafts: Sequence[int], stop_token_ids: frozenset[int] = frozenset()) -> int:
    """How many drafts the draws reproduce: the longest prefix with draws[i] == drafts[i], ending
    at a stop token (nothing after a stop is committed). The row commits draws[:n + 1]."""
    n = 0
    while n < len(drafts) and draws[n] == drafts[n] and draws[n] not in stop_token_ids:
        n += 1
    return n


def sample_rows(logits: torch.Tensor, seqs: Sequence[SequenceWork]) -> tuple[StepOutput, dict[int, int]]:
    """Sample the sampling rows of a step on the host: logits float32 [rows, vocab] hold one row per
    ordinary sampled sequence and num_drafts + 1 rows (in position order) per verify row, in batch
    order. -> the StepOutput, and per verify row its accepted draft count."""
    from ninfer.engine.sampler import sample

    rows = [r for s in seqs for r in (position_rows(s) if s.num_drafts else [s])]
    out = StepOutput(sampled={})
    accepted: dict[int, int] = {}
    if not rows:
        return out, accepted
    tokens, records = sample(logits, rows)
    i = 0
    for s in seqs:
        n = s.num_drafts + 1
        commit(out, s, tokens[i:i + n], records[i:i + n], accepted)
        i += n
    return out, accepted


def commit(out: StepOutput, s: SequenceWork, draws: Sequence[int], records: Sequence, accepted: dict[int, int]) -> None:
    """Record row `s`'s draws (one per position) in `out`: the first draw, and for a verify row the
    draws after each accepted draft; its accepted count into `accepted`."""
    out.sampled[s.seq_id] = int(draws[0])
    if records[0] is not None:
        out.logprobs[s.seq_id] = records[0]
    if s.num_drafts:
        a = accepted_drafts(draws, s.drafts, s.stop_token_ids)
        out.verified[s.seq_id] = [int(t) for t in draws[1:a + 1]]
        out.verified_logprobs[s.seq_id] = list(records[1:a + 1])
        accepted[s.seq_id] = a
