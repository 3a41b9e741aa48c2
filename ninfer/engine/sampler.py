"""Next-token sampling on the host: the same definition as the cuda kernel (`kernels/sampling.cu`).

Per row, with seq = the row's SequenceWork and step = len(seq.output_token_ids):
  1. logits' = logits - presence * (count > 0) - frequency * count (float32, in that rounding order);
     ids the grammar mask forbids, and NaN, become -inf.
  2. candidates = the top_k (<= 20) largest logits', ties broken by the lower id. Greedy
     (temperature <= 0) takes candidate 0.
  3. p_j = exp((l_j - l_0) / T) in float32; keep the shortest prefix whose mass reaches
     top_p * (mass of all candidates) while p_j >= min_p * p_0 (at least candidate 0).
  4. u = (Philox4x32-10(key = seed as two u32 halves, counter = (step lo, step hi, 0, 0))[0] >> 8)
     * 2^-24; the token is the first kept candidate whose running float32 sum exceeds u * kept mass.
The 20-candidate arithmetic runs in numpy float32 with sequential sums as the kernel does, so equal
logits give equal tokens on both backends (up to expf ulp differences), whatever else is in the
batch. Only the [n, 20] candidate slice leaves the logits' device; nothing sorts the vocabulary.

Logprob records describe a given token (`logprob_records`), so a backend that sampled on the device
only computes records: they are log-softmax of logits' / T (greedy rows at T = 1), listing the 20
candidates.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from ninfer.engine.batch import SequenceWork
from ninfer.engine.request import TOP_K_CAP, TokenLogprob

OUTSIDE_TOP_LOGPROB = -9999.0  # OpenAI's value for a sampled token outside the top 20
_MASK32 = 0xFFFFFFFF
_MASK64 = (1 << 64) - 1
_INV_2_24 = np.float32(1.0 / 16777216.0)


def sample(logits: torch.Tensor, seqs: Sequence[SequenceWork]) -> tuple[list[int], list[TokenLogprob | None]]:
    """Sample one token per row. logits: float32 [n, vocab], row i belongs to seqs[i].

    Returns the token ids and, per row, a TokenLogprob when seqs[i].sampling.logprobs, else None.
    The caller's logits are not modified.
    """
    n = logits.shape[0]
    assert n == len(seqs), f"{n} logit rows for {len(seqs)} sequences"
    if n == 0:
        return [], []
    plain = _plain_greedy(logits, seqs)
    if plain is not None:
        return plain, [None] * n
    x = _prepare(logits, seqs)
    cand_v, cand_i = _candidates(x)
    tokens = _select(cand_v, cand_i, seqs)
    records: list[TokenLogprob | None] = [None] * n
    want = [i for i, s in enumerate(seqs) if s.sampling.logprobs]
    if want:
        rows = torch.tensor(want, device=x.device)
        got = _records(x.index_select(0, rows), cand_i[want], [seqs[i] for i in want], [tokens[i] for i in want])
        for i, rec in zip(want, got):
            records[i] = rec
    return tokens, records


def _plain_greedy(logits: torch.Tensor, seqs: Sequence[SequenceWork]) -> list[int] | None:
    """The definition's token when every row is greedy without penalties, mask or logprobs: the
    largest logit, the lowest id among equals (argmax returns the first), one pass over the vocab.
    None when the full path is needed (such a row, or a NaN, which the definition reads as -inf)."""
    for s in seqs:
        sp = s.sampling
        if (not sp.greedy or sp.logprobs or s.token_mask is not None
                or (s.output_token_ids and (sp.presence_penalty != 0.0 or sp.frequency_penalty != 0.0))):
            return None
    ids = torch.argmax(logits, dim=-1)
    if torch.isnan(logits.gather(1, ids[:, None])).any():  # argmax takes NaN as the largest
        return None
    return ids.tolist()


def logprob_records(logits: torch.Tensor, seqs: Sequence[SequenceWork],
                    tokens: Sequence[int]) -> list[TokenLogprob | None]:
    """The logprob record of tokens[i] for each row whose seqs[i].sampling.logprobs, else None.

    logits: float32 [n, vocab], raw (before penalties and grammar mask, which this applies). The
    tokens are taken as given (e.g. drawn by the cuda kernel); nothing is sampled. The caller's
    logits are not modified.
    """
    n = logits.shape[0]
    assert n == len(seqs) == len(tokens), f"{n} logit rows, {len(seqs)} sequences, {len(tokens)} tokens"
    out: list[TokenLogprob | None] = [None] * n
    want = [i for i, s in enumerate(seqs) if s.sampling.logprobs]
    if not want:
        return out
    sub = [seqs[i] for i in want]
    x = _prepare(logits.index_select(0, torch.tensor(want, device=logits.device)), sub)
    _, cand_i = _candidates(x)
    for i, rec in zip(want, _records(x, cand_i, sub, [int(tokens[i]) for i in want])):
        out[i] = rec
    return out


def mask_words(vocab: int) -> int:
    """Words of a packed token bitmask over `vocab` ids: ceil(vocab / 32)."""
    return (vocab + 31) // 32


def single_token_mask(token: int, words: int) -> torch.Tensor:
    """A packed token bitmask (XGrammar's int32 layout) that admits only `token`: a forced token
    (a thinking budget's early close) is committed through the mask, whatever the temperature."""
    mask = torch.zeros((1, words), dtype=torch.int32)
    bit = token % 32
    mask[0, token // 32] = (1 << bit) - (1 << 32 if bit == 31 else 0)
    return mask


def fill_mask_row(row: torch.Tensor, mask: torch.Tensor | None) -> None:
    """Write one row of a packed token bitmask (int32 [words], on any device; bit j of word w allows
    id 32w + j, XGrammar's layout): the grammar's `mask` ([1, words'] or [words'] int32), or every
    bit set when mask is None. Ids past the mask's own words are forbidden; its extra words dropped."""
    if mask is None:
        row.fill_(-1)
        return
    words = mask.reshape(-1)
    m = min(row.numel(), words.numel())
    row[:m].copy_(words[:m])
    row[m:].zero_()


def apply_mask(logits: torch.Tensor, masks: Sequence[torch.Tensor | None]) -> torch.Tensor:
    """Structured output: rows with a mask (packed int32 bitmask, see `fill_mask_row`) keep only
    their allowed ids, the rest -inf. Plain torch, so it runs wherever the logits are. Returns a new
    tensor when any row is masked, else `logits` itself."""
    if all(m is None for m in masks):
        return logits
    out = logits.clone()
    _mask_(out, masks)
    return out


def philox4x32_10(counter: tuple[int, int, int, int], key: tuple[int, int]) -> tuple[int, int, int, int]:
    """Random123's Philox4x32-10 on u32 words (Python ints), as sampling.cu computes it."""
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for r in range(10):
        if r:
            k0, k1 = (k0 + 0x9E3779B9) & _MASK32, (k1 + 0xBB67AE85) & _MASK32
        p0, p1 = 0xD2511F53 * c0, 0xCD9E8D57 * c2
        c0, c1, c2, c3 = (p1 >> 32) ^ c1 ^ k0, p1 & _MASK32, (p0 >> 32) ^ c3 ^ k1, p0 & _MASK32
    return c0, c1, c2, c3


def uniform_bits(seed: int, step: int) -> int:
    """The 24-bit integer behind a sequence's uniform at output position `step`: u = bits * 2^-24."""
    seed, step = seed & _MASK64, step & _MASK64
    return philox4x32_10((step & _MASK32, step >> 32, 0, 0), (seed & _MASK32, seed >> 32))[0] >> 8


def _prepare(logits: torch.Tensor, seqs: Sequence[SequenceWork]) -> torch.Tensor:
    """A new float32 [n, vocab]: penalties, grammar masks and NaN applied (step 1 of the definition)."""
    x = torch.nan_to_num(logits.float(), nan=float("-inf"), posinf=float("inf"), neginf=float("-inf"))
    for i, seq in enumerate(seqs):
        sp = seq.sampling
        if not seq.output_token_ids or (sp.presence_penalty == 0.0 and sp.frequency_penalty == 0.0):
            continue
        ids, counts = torch.tensor(seq.output_token_ids, device=x.device).unique(return_counts=True)
        pres = torch.tensor(sp.presence_penalty, dtype=torch.float32, device=x.device)
        freq = torch.tensor(sp.frequency_penalty, dtype=torch.float32, device=x.device)
        # The kernel's rounding: fadd(presence, fmul(frequency, count)), then one subtraction.
        x[i, ids] -= pres + freq * counts.to(torch.float32)
    _mask_(x, [s.token_mask for s in seqs])
    return x


def _mask_(x: torch.Tensor, masks: Sequence[torch.Tensor | None]) -> None:
    rows = [i for i, m in enumerate(masks) if m is not None]
    if not rows:
        return
    words = torch.empty((len(rows), mask_words(x.shape[1])), dtype=torch.int32, device=x.device)
    for r, i in enumerate(rows):
        fill_mask_row(words[r], masks[i])
    shifts = torch.arange(32, dtype=torch.int32, device=x.device)
    allowed = ((words.unsqueeze(-1) >> shifts) & 1).reshape(len(rows), -1)[:, :x.shape[1]].bool()
    idx = torch.tensor(rows, device=x.device)
    x[idx] = x[idx].masked_fill(~allowed, float("-inf"))


def _candidates(x: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """The K = min(20, vocab) largest entries of each row, ordered by value then lower id.
    -> values float32 [n, K], ids int64 [n, K], on the host."""
    n, vocab = x.shape
    K = min(TOP_K_CAP, vocab)
    vals, ids = torch.topk(x, min(K + 1, vocab), dim=-1)  # one extra column shows a tie across the cut
    tied = (vals[:, K] == vals[:, K - 1]).nonzero().flatten().tolist() if vocab > K else []
    vals, ids = vals[:, :K].clone(), ids[:, :K].clone()
    for r in tied:  # topk picks among equals arbitrarily: take the lowest ids of the K-th value
        kth = vals[r, K - 1]
        above = (x[r] > kth).nonzero().flatten()
        ids[r] = torch.cat([above, (x[r] == kth).nonzero().flatten()[:K - above.numel()]])
        vals[r] = x[r, ids[r]]
    v, i = vals.cpu().numpy(), ids.cpu().numpy()
    order = np.lexsort((i, -v))  # per row: value descending, then id ascending
    return np.take_along_axis(v, order, 1), np.take_along_axis(i, order, 1)


def _select(cand_v: np.ndarray, cand_i: np.ndarray, seqs: Sequence[SequenceWork]) -> list[int]:
    """Steps 2-4 of the definition on the candidates (float32 [n, K], ids [n, K]). -> token per row."""
    n, K = cand_v.shape
    greedy = np.array([s.sampling.greedy for s in seqs])
    k = np.array([1 if s.sampling.greedy else min(max(s.sampling.top_k, 1), K) for s in seqs])  # [n]
    temp = np.array([1.0 if s.sampling.greedy else s.sampling.temperature for s in seqs], np.float32)
    top_p = np.array([s.sampling.top_p for s in seqs], np.float32)
    min_p = np.array([s.sampling.min_p for s in seqs], np.float32)
    rows, cols = np.arange(n), np.arange(K)
    with np.errstate(all="ignore"):  # -inf - -inf in columns zeroed just below
        p = np.exp((cand_v - cand_v[:, :1]) / temp[:, None])  # [n, K] float32
    p = np.where((cand_v == -np.inf) | (cols >= k[:, None]), np.float32(0.0), p)
    run = np.cumsum(p, axis=1, dtype=np.float32)  # sequential float32 sums, the kernel's order
    total = run[rows, k - 1]
    # Candidate j > 0 joins while the mass before it is short of top_p and p_j >= min_p * p_0.
    grows = ((run[:, :-1] < (top_p * total)[:, None]) & (p[:, 1:] >= (min_p * p[:, 0])[:, None])
             & (cols[1:] < k[:, None]))
    keep = 1 + np.cumprod(grows, axis=1).sum(axis=1)  # [n], the kept prefix
    mass = run[rows, keep - 1]
    bits = np.array([uniform_bits(s.seed, len(s.output_token_ids)) for s in seqs], np.float32)
    target = bits * _INV_2_24 * mass  # float32, rounded as the kernel's
    hit = (run > target[:, None]) & (cols < keep[:, None])
    pick = np.where(hit.any(axis=1), hit.argmax(axis=1), keep - 1)
    pick[greedy] = 0
    return cand_i[rows, pick].tolist()


def _records(x: torch.Tensor, cand_i: np.ndarray, seqs: Sequence[SequenceWork],
             tokens: Sequence[int]) -> list[TokenLogprob]:
    """x: prepared logits [m, vocab]; cand_i: its candidate ids [m, K]. -> the record of tokens[r]."""
    temps = [1.0 if s.sampling.greedy else s.sampling.temperature for s in seqs]
    scaled = x / torch.tensor(temps, dtype=torch.float32, device=x.device).unsqueeze(1)  # [m, vocab]
    lse = torch.logsumexp(scaled, dim=-1, keepdim=True)  # [m, 1], over the whole vocabulary
    top_lp = (scaled.gather(1, torch.from_numpy(cand_i).to(x.device)) - lse).tolist()
    tok = torch.tensor(list(tokens), dtype=torch.int64, device=x.device).unsqueeze(1)
    chosen_lp = (scaled.gather(1, tok) - lse).squeeze(1).tolist()
    out: list[TokenLogprob] = []
    for r, seq in enumerate(seqs):
        ids, token = cand_i[r].tolist(), int(tokens[r])
        # A masked (-inf) token is never an alternative, so a row can list fewer than asked.
        pairs = [(t, lp) for t, lp in zip(ids, top_lp[r]) if lp != float("-inf")]
        lp = chosen_lp[r] if token in ids else OUTSIDE_TOP_LOGPROB
        out.append(TokenLogprob(token_id=token, logprob=lp, top=tuple(pairs[:seq.sampling.top_logprobs])))
    return out
