"""--spec mtp on the engine side: the runner's MTP head proposes each row's drafts while it runs
the step before (StepOutput.drafts); the engine keeps them with the request and hands them to the
next decode round, cut to the round's budget."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class RunnerDraftState:
    drafts: list[int] = field(default_factory=list)  # proposed after the request's last committed token
    fallback_steps: int = 0  # (no backoff: an MTP head drafts every round)


class RunnerDrafter:
    """Drafts that the runner proposed (an MTP head): the same propose/observe shape as LookupDrafter."""

    def __init__(self, draft_tokens: int) -> None:
        self.draft_tokens = draft_tokens

    def new_state(self) -> RunnerDraftState:
        return RunnerDraftState()

    def offer(self, state: RunnerDraftState, drafts: list[int]) -> None:
        """The drafts the last step proposed for this request."""
        state.drafts = list(drafts)

    def propose(self, state: RunnerDraftState, tokens: list[int], limit: int) -> list[int]:
        drafts, state.drafts = state.drafts[:min(limit, self.draft_tokens)], []
        return drafts

    def observe(self, state: RunnerDraftState, drafted: int, accepted: int) -> None:
        pass
