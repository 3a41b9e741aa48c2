"""MTP drafting on the torch backend (--spec mtp): the model's multi-token-prediction head, its own
paged K/V, and the K drafts each sampling row proposes for its next round.

After a step's target forward, every computed input p whose next token is now known (the next
prompt token, or the token the step committed) is paired with it: the head runs over the pairs
(h_p, t_{p+1}) at positions p, writing its K/V there, so its cache follows the sequence as the
target's does. A sampling row then chains the head from its last pair: draft 1 is the argmax of
the last pair's logits, and draft j + 1 comes from the head's own output for draft j at the next
position. Chain positions past the sequence's pages use scratch pages of this cache only. Drafts
are greedy whatever the request samples (point-mass proposals; the verification rule keeps the
output exact). The last input of a prompt chunk that does not sample has no pair (its next token
arrives with the next chunk), which leaves a hole in the head's cache there: drafts may be worse,
output is unaffected.
"""
from __future__ import annotations

from typing import Any

import torch

from ninfer.engine.batch import SequenceWork, StepOutput
from ninfer.engine.models.spec import ATTENTION, StateSpec
from ninfer.engine.ops.torch_ops import KVCache, TorchContext

MAX_ROWS = 8  # sampling rows a step may have (lanes)
SCRATCH_PER_ROW = 2  # pages past a row's own that a chain may reach (K < page size)


class MtpDrafts:
    """The head (models/<arch>.py's MtpHead), its K/V cache and the drafting chain."""

    def __init__(self, head: Any, model: Any, ops: Any, spec: StateSpec, num_pages: int, page_size: int,
                 dtype: torch.dtype, device: torch.device, draft_tokens: int) -> None:
        assert 0 < draft_tokens < page_size
        self.head, self.model, self.ops = head, model, ops
        self.num_pages, self.page_size, self.draft_tokens = num_pages, page_size, draft_tokens
        self.device = device
        head_spec = StateSpec((ATTENTION,), spec.attention, None)
        self.kv = KVCache(head_spec, num_pages + MAX_ROWS * SCRATCH_PER_ROW, page_size, dtype, device)
        self.last_outputs: dict[int, torch.Tensor] = {}  # seq_id -> the head's output at its last pair (checks)

    def copy_pages(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        self.kv.copy_pages(src, dst)

    def step(self, seqs: list[SequenceWork], offsets: list[int], hidden: torch.Tensor, out: StepOutput,
             accepted: dict[int, int]) -> None:
        """After a step: pair every computed input with its known next token through the head, then
        chain K drafts for each sampling row into out.drafts. hidden: the step's final normed hidden
        [T, hidden]; offsets: each sequence's first row."""
        spans, rows, ids, lasts = [], [], [], []
        for s, off in zip(seqs, offsets):
            prompt_part = len(s.token_ids) - s.num_drafts
            committed = [out.sampled[s.seq_id], *out.verified.get(s.seq_id, [])] if s.sample else []
            nxt = s.token_ids[1:prompt_part] + committed  # the next token of each kept input
            if not nxt:
                continue
            spans.append((s.start_pos, len(nxt), s.block_table, -1))
            rows.extend(range(off, off + len(nxt)))
            ids.extend(nxt)
            if s.sample:
                lasts.append((s, len(rows) - 1, s.start_pos + len(nxt) - 1))
        if not spans:
            return
        x = self._run(spans, hidden[rows], ids)  # [pairs, hidden]
        if not lasts:
            return
        h = x[[i for _, i, _ in lasts]]
        self.last_outputs = {s.seq_id: h[b] for b, (s, _, _) in enumerate(lasts)}
        drafts = [[] for _ in lasts]
        for j in range(self.draft_tokens):
            tokens = self.model.compute_logits(self.ops, h).argmax(-1)  # [rows]
            for d, t in zip(drafts, tokens.tolist()):
                d.append(t)
            if j + 1 == self.draft_tokens:
                break
            chain = [(pos + j + 1, 1, self._table(s, b, pos + j + 1), -1) for b, (s, _, pos) in enumerate(lasts)]
            h = self._run(chain, h, tokens.tolist())
        for (s, _, _), d in zip(lasts, drafts):
            out.drafts[s.seq_id] = d

    def _table(self, s: SequenceWork, b: int, pos: int) -> list[int]:
        # the row's pages, then its scratch pages, covering `pos`
        need = pos // self.page_size + 1
        scratch = [self.num_pages + b * SCRATCH_PER_ROW + i for i in range(SCRATCH_PER_ROW)]
        table = list(s.block_table[:need]) + scratch
        assert len(table) >= need, "a drafting chain ran past its scratch pages"
        return table[:need]

    def _run(self, spans: list[tuple[int, int, list[int], int]], hidden: torch.Tensor, ids: list[int]) -> torch.Tensor:
        ctx: TorchContext = self.ops.context(spans, self.kv, None)
        self.ops.begin(ctx)
        next_ids = torch.tensor(ids, dtype=torch.int64, device=self.device)
        return self.head.forward(self.ops, self.model, hidden, next_ids)
