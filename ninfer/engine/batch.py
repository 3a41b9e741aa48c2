"""The two dataclasses that cross between scheduler and runner, and the runner protocol.

The loop is one-way: `scheduler.schedule()` -> `runner.run(batch)` -> `scheduler.update(batch, output)`.
The runner never touches the page allocator; it gets block tables.

Recurrent state (hybrid models): a runner whose model keeps per-sequence recurrent state (conv
window + delta-rule matrix per linear-attention layer) has `num_state_slots > 0` and owns that
many physical state slots, each holding every recurrent layer's state of one sequence at one
token position. The scheduler addresses them by slot id exactly as it addresses pages:
`SequenceWork.state_slot` is the slot a row reads and updates, `ScheduledBatch.state_copies`
the slot-to-slot copies to run first. A pure-attention runner has no `num_state_slots` (or 0):
then state_slot is always -1 and state_copies always empty.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from ninfer.engine.request import SamplingParams, TokenLogprob

# A lookahead step's input token (ScheduledBatch.follows): the one the step before sampled for the
# row, still on the device when the step is launched.
FOLLOWS = -1


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
    # Hybrid models: the recurrent-state slot this sequence reads its state from and writes its
    # state back to, advanced over token_ids; after the step it holds the state after exactly
    # start_pos + len(token_ids) tokens. start_pos == 0 means a fresh sequence: the runner starts
    # from zero state (the slot may hold a previous sequence's stale state). start_pos > 0 means
    # the slot already holds the state after start_pos tokens (earlier steps, or this batch's
    # state_copies). -1 for a pure-attention model.
    state_slot: int = -1
    # Speculative verification: the last drafts_count ids of token_ids are drafts proposed after
    # the row's first token (its last committed token); the runner computes logits at every
    # position, draws the target token at each with the one sampler (position i counts the
    # drafts before it as output: penalties and the RNG step) and commits the longest prefix of
    # drafts that the draws reproduce, plus the draw after it (StepOutput.verified). Recurrent
    # state ends after exactly the committed inputs. 0: an ordinary row.
    num_drafts: int = 0
    stop_token_ids: frozenset[int] = frozenset()  # a verify row commits nothing after a stop token
    # structured output with drafts: the mask of each position 1..num_drafts (position 0 is
    # token_mask); a position whose draft the grammar refuses has none (None) and ends the drafts
    draft_masks: list[Any] = field(default_factory=list)
    return_hidden: bool = False  # an embedding's prompt: hand back this row's final normed hidden states

    @property
    def drafts(self) -> list[int]:
        return self.token_ids[len(self.token_ids) - self.num_drafts:] if self.num_drafts else []


@dataclass(slots=True)
class ScheduledBatch:
    seqs: list[SequenceWork]
    # (src page, dst page): copy src's K/V into dst, every layer, before computing the batch;
    # a prefix hit that ends inside a page gets a private copy of it (copy-on-write). Only
    # emitted when the runner has `copy_pages`.
    page_copies: list[tuple[int, int]] = field(default_factory=list)
    # (src slot, dst slot): copy every recurrent layer's state of slot src into slot dst before
    # computing the batch (the runner does it in run(), before any row reads its state_slot). A
    # prompt that resumes a retained entry starts from a copy of the entry's checkpoint in its
    # own working slot; src is never written by anyone until the copy has run. Hybrid models only.
    state_copies: list[tuple[int, int]] = field(default_factory=list)
    # A lookahead step (Scheduler.lookahead, a runner's `launch`): one decode row per sequence of the
    # step launched just before it, in the same order, each input token FOLLOWS (the token that step
    # samples for the row; its output_token_ids end with a FOLLOWS for it too).
    follows: bool = False

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.seqs)


@dataclass(slots=True)
class StepOutput:
    """Per sampled sequence: the next token id (and its logprob record when asked). A verify row
    (SequenceWork.num_drafts > 0) commits `sampled` (the draw at its first position) followed by
    `verified` (the draws at the positions after each accepted draft), in order."""

    sampled: dict[int, int]  # seq_id -> token id
    logprobs: dict[int, TokenLogprob] = field(default_factory=dict)
    verified: dict[int, list[int]] = field(default_factory=dict)  # seq_id -> tokens after sampled
    verified_logprobs: dict[int, list[TokenLogprob | None]] = field(default_factory=dict)
    # a runner that drafts (an MTP head): seq_id -> the drafts it proposes after the committed tokens
    drafts: dict[int, list[int]] = field(default_factory=dict)
    # rows with return_hidden: seq_id -> the final normed hidden states of its tokens, [tokens, hidden]
    # (a view the next step may overwrite: read it before then)
    hidden: dict[int, Any] = field(default_factory=dict)


class ModelRunner(Protocol):
    """Executes batches. A hybrid model's runner also has `num_state_slots: int` (the engine
    reads it with getattr, default 0) and honours SequenceWork.state_slot and
    ScheduledBatch.state_copies."""

    page_size: int
    num_pages: int
    vocab_size: int

    def run(self, batch: ScheduledBatch) -> StepOutput:
        """Run the batch's state_copies, write its K/V into its pages (and its recurrent state
        into its state slots), run the model, sample where asked."""
        ...
