"""Next-token sampling: penalties, logprob records, greedy or temperature/top-k/top-p/min-p.

Every row is reduced to its 20 most likely candidates (the spec's top_k domain) on the logits'
device; only that [n, 20] slice is filtered and normalized, so nothing sorts the whole vocabulary.
Randomness is one uniform per row from a CPU `torch.Generator` seeded from (seq.seed, number of
tokens the sequence has sampled), so a request draws the same tokens whatever else is in the batch
and on whatever device it runs.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from ninfer.engine.batch import SequenceWork
from ninfer.engine.request import TOP_K_CAP, TokenLogprob

OUTSIDE_TOP_LOGPROB = -9999.0  # OpenAI's value for a sampled token outside the top 20
_MASK64 = (1 << 64) - 1


def sample(logits: torch.Tensor, seqs: Sequence[SequenceWork]) -> tuple[list[int], list[TokenLogprob | None]]:
    """Sample one token per row. logits: float32 [n, vocab], row i belongs to seqs[i].

    Returns the token ids and, per row, a TokenLogprob when seqs[i].sampling.logprobs, else None.
    The caller's logits are not modified.
    """
    n, vocab = logits.shape
    assert n == len(seqs), f"{n} logit rows for {len(seqs)} sequences"
    if n == 0:
        return [], []
    logits = _apply_penalties(logits.float(), seqs)
    logits = apply_mask(logits, [s.token_mask for s in seqs])

    # Temperature per row; greedy rows divide by 1 (their logprobs are reported at T = 1).
    temps = [s.sampling.temperature if not s.sampling.greedy else 1.0 for s in seqs]
    temp = torch.tensor(temps, dtype=torch.float32, device=logits.device).unsqueeze(1)  # [n, 1]
    k_dom = min(TOP_K_CAP, vocab)
    top_vals, top_ids = torch.topk(logits, k_dom, dim=-1)  # [n, K], most likely first
    scaled = top_vals / temp  # [n, K]

    # Candidate filtering on the [n, K] slice: top_k, then top_p and min_p over the renormalized
    # top-k distribution. Column 0 (the most likely) always survives.
    cols = torch.arange(k_dom, device=logits.device).unsqueeze(0)  # [1, K]
    top_k = torch.tensor([min(s.sampling.top_k, k_dom) for s in seqs], device=logits.device).unsqueeze(1)
    scaled = scaled.masked_fill(cols >= top_k, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)  # [n, K]; -inf (masked or filtered) columns get 0
    top_p = torch.tensor([s.sampling.top_p for s in seqs], dtype=torch.float32, device=logits.device).unsqueeze(1)
    before = torch.cumsum(probs, dim=-1) - probs  # mass strictly above each column
    min_p = torch.tensor([s.sampling.min_p for s in seqs], dtype=torch.float32, device=logits.device).unsqueeze(1)
    # Each condition holds on a prefix of the columns (probs are sorted), so `keep` is a prefix.
    keep = (before < top_p) & (probs >= min_p * probs[:, :1]) & (probs > 0)
    keep[:, 0] = True
    probs = probs * keep

    # Inverse-CDF draw: the first column whose cumulative mass exceeds u * total.
    u = torch.tensor([_uniform(s.seed, len(s.output_token_ids)) for s in seqs],
                     dtype=torch.float32).to(logits.device).unsqueeze(1)  # [n, 1]
    cdf = torch.cumsum(probs, dim=-1)
    col = (cdf <= u * cdf[:, -1:]).sum(dim=-1)  # [n]
    # u*total can round up to total; never step past the last candidate with mass.
    col = torch.minimum(col, keep.sum(dim=-1) - 1)
    chosen = top_ids.gather(1, col.unsqueeze(1)).squeeze(1)  # [n]
    # Greedy rows take argmax, which (unlike topk) promises the lowest id among ties.
    greedy_rows = [i for i, s in enumerate(seqs) if s.sampling.greedy]
    if greedy_rows:
        rows = torch.tensor(greedy_rows, device=logits.device)
        chosen[rows] = logits[rows].argmax(dim=-1)

    token_ids = chosen.tolist()
    records: list[TokenLogprob | None] = [None] * n
    want = [i for i, s in enumerate(seqs) if s.sampling.logprobs]
    if want:
        rows = torch.tensor(want, device=logits.device)
        records_for = _logprob_records(logits[rows] / temp[rows], top_vals[rows] / temp[rows],
                                       top_ids[rows], chosen[rows], [seqs[i] for i in want])
        for i, rec in zip(want, records_for):
            records[i] = rec
    return token_ids, records


def apply_mask(logits: torch.Tensor, masks: Sequence[torch.Tensor | None]) -> torch.Tensor:
    """Structured output: rows with a mask (XGrammar's packed int32 bitmask [1, ceil(V/32)], bit j of
    word w allowing id 32w + j) keep only their allowed ids, the rest -inf. Plain torch, so it runs
    wherever the logits are. Returns a new tensor when any row is masked, else `logits` itself."""
    rows = [i for i, m in enumerate(masks) if m is not None]
    if not rows:
        return logits
    out = logits.clone()
    shifts = torch.arange(32, dtype=torch.int32, device=out.device)
    for i in rows:
        words = masks[i].to(out.device).reshape(-1)
        allowed = ((words.unsqueeze(-1) >> shifts) & 1).reshape(-1)[:out.shape[1]].bool()
        out[i].masked_fill_(~allowed, float("-inf"))
    return out


def _apply_penalties(logits: torch.Tensor, seqs: Sequence[SequenceWork]) -> torch.Tensor:
    """OpenAI's penalties: logit[j] -= count[j] * frequency + (count[j] > 0) * presence."""
    out = logits
    for i, seq in enumerate(seqs):
        sp = seq.sampling
        if not seq.output_token_ids or (sp.presence_penalty == 0.0 and sp.frequency_penalty == 0.0):
            continue
        if out is logits:
            out = logits.clone()  # leave the caller's tensor alone
        ids, counts = torch.tensor(seq.output_token_ids, device=logits.device).unique(return_counts=True)
        out[i, ids] -= sp.presence_penalty + sp.frequency_penalty * counts.to(torch.float32)
    return out


def _logprob_records(scaled: torch.Tensor, top_scaled: torch.Tensor, top_ids: torch.Tensor,
                     chosen: torch.Tensor, seqs: list[SequenceWork]) -> list[TokenLogprob]:
    """scaled: [m, vocab] logits / T; top_scaled, top_ids: [m, K] its largest entries."""
    lse = torch.logsumexp(scaled, dim=-1, keepdim=True)  # [m, 1], over the whole vocabulary
    top_lp = (top_scaled - lse).tolist()
    chosen_lp = (scaled.gather(1, chosen.unsqueeze(1)) - lse).squeeze(1).tolist()
    ids = top_ids.tolist()
    out: list[TokenLogprob] = []
    for r, seq in enumerate(seqs):
        token = int(chosen[r])
        # A masked (-inf) token is never an alternative, so a row can list fewer than asked.
        pairs = [(t, lp) for t, lp in zip(ids[r], top_lp[r]) if lp != float("-inf")]
        lp = chosen_lp[r] if token in ids[r] else OUTSIDE_TOP_LOGPROB
        out.append(TokenLogprob(token_id=token, logprob=lp, top=tuple(pairs[:seq.sampling.top_logprobs])))
    return out


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def _uniform(seed: int, step: int) -> float:
    """The uniform in [0, 1) a sequence with this seed draws at output position `step`."""
    gen = torch.Generator()
    gen.manual_seed(_splitmix64((_splitmix64(seed & _MASK64) + step) & _MASK64))
    return float(torch.rand((), generator=gen, dtype=torch.float64))
