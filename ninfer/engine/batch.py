"""The two dataclasses that cross between scheduler and runner, and the runner protocol.

The loop is one-way: `scheduler.schedule()` -> `runner.run(batch)` -> `scheduler.update(batch, output)`.
The runner never touches the page allocator; it gets block tables.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from ninfer.engine.request import SamplingParams, TokenLogprob


@dataclass(slots=True)
class SequenceWork:
    """One lane's work in a step: compute `token_ids` at positions start_pos.. and maybe sample.

    block_table lists the KV page ids holding positions 0.. (page i covers tokens
    [i*page_size, (i+1)*page_size)); it already covers start_pos + len(token_ids).
    """

    seq_id: int  # stable for the request's life; keys per-request runner state (RNG)
    token_ids: list[int]
    start_pos: int  # == num_computed_tokens before this step
    block_table: list[int]
    sample: bool  # True: sample the next token from the last position's logits
    sampling: SamplingParams
    output_token_ids: list[int] = field(default_factory=list)  # generated so far (penalties)
    seed: int = 0  # the request's resolved seed: the RNG stream is (seed, number of tokens sampled)
    token_mask: Any = None  # structured output: the ids this sample may take (grammar.Matcher.next_mask)


@dataclass(slots=True)
class ScheduledBatch:
    seqs: list[SequenceWork]
    # (src page, dst page): copy src's K/V into dst, every layer, before computing the batch;
    # a prefix hit that ends inside a page gets a private copy of it (copy-on-write). Only
    # emitted when the runner has `copy_pages`.
    page_copies: list[tuple[int, int]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.seqs)


@dataclass(slots=True)
class StepOutput:
    """Per sampled sequence: the next token id (and its logprob record when asked)."""

    sampled: dict[int, int]  # seq_id -> token id
    logprobs: dict[int, TokenLogprob] = field(default_factory=dict)


class ModelRunner(Protocol):
    page_size: int
    num_pages: int
    vocab_size: int

    def run(self, batch: ScheduledBatch) -> StepOutput:
        """Write the batch's K/V into its pages, run the model, sample where asked."""
        ...
