"""The reasoning channel: <think>...</think> split from the answer as text is committed, safe at
any chunk boundary, plus what a thinking request asks of the engine (a thinking budget with
early close, post-thinking sampling).

Reasoning opens when the prompt ends inside <think> or the output starts (after whitespace) with
<think>. It closes only at a </think> followed by whitespace or the end of the output, so a
marker quoted while reasoning (followed by punctuation, say) stays reasoning; the whitespace after
the close is format, not answer. Text that could still become an opener or a close is held back.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ninfer.engine.request import SamplingParams

OPEN, CLOSE = "<think>", "</think>"
# Qwen's canonical early-close guidance: committed at the thinking budget, then the close marker.
EARLY_CLOSE_GUIDANCE = ("\n\nConsidering the limited time by the user, I have to give the solution based on the "
                        "thinking directly now.\n")


@dataclass(slots=True)
class ReasoningSpec:
    """How a chat request's output is split and bounded.

    starts_open: the prompt ended inside <think>. budget: the thinking-token cap (None: none).
    close_ids: the early-close guidance and close marker, committed without sampling at the cap.
    post_thinking: the sampler from the first token after the close (None: unchanged)."""

    starts_open: bool = False
    budget: int | None = None
    close_ids: list[int] = field(default_factory=list)
    post_thinking: SamplingParams | None = None


def effective_budget(budget: int, can_produce: int, close_len: int) -> int | None:
    """The spec's cap for requested budget B when C tokens can still be produced and early close
    needs R = close_len + 1 (guidance, marker, one post-close token). None: not enforceable."""
    needed = close_len + 1
    if can_produce <= budget or can_produce - budget >= needed:
        return budget
    if can_produce > needed:
        return can_produce - needed
    return None


class ReasoningSplitter:
    """Splits committed output text into (reasoning, content) deltas."""

    def __init__(self, starts_open: bool) -> None:
        # "start": before the output showed whether it opens reasoning; "reasoning"; "closing":
        # after </think>, dropping format whitespace; "content"
        self.state = "reasoning" if starts_open else "start"
        self._held = ""
        self.opened = starts_open  # reasoning happened at all
        self._lead = True  # the newline right after <think> is format, not reasoning

    @property
    def in_reasoning(self) -> bool:
        return self.state == "reasoning"

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        """Add committed text; -> (reasoning delta, content delta). final: the output ended."""
        self._held += text
        reasoning, content = [], []
        while True:
            held = self._held
            if self.state == "start":
                stripped = held.lstrip()
                if stripped.startswith(OPEN):
                    self.state, self.opened = "reasoning", True
                    self._held = stripped[len(OPEN):]
                    continue
                if not final and OPEN.startswith(stripped):  # still possibly an opener (or only whitespace)
                    break
                self.state = "content"
                continue
            if self.state == "reasoning":
                if self._lead and held:
                    self._lead = False
                    if held.startswith("\n"):
                        self._held = held = held[1:]
                i = held.find(CLOSE)
                if i >= 0:
                    after = held[i + len(CLOSE):]
                    if not after and not final:  # the next character decides
                        reasoning.append(held[:i])
                        self._held = held[i:]
                        break
                    if not after or after[0].isspace():
                        reasoning.append(held[:i])
                        self.state, self._held = "closing", after
                        continue
                    reasoning.append(held[:i + len(CLOSE)])  # quoted: stays reasoning
                    self._held = after
                    continue
                keep = 0 if final else _partial_suffix(held, CLOSE)
                reasoning.append(held[:len(held) - keep])
                self._held = held[len(held) - keep:]
                break
            if self.state == "closing":
                stripped = held.lstrip()
                if not stripped and not final:
                    self._held = ""
                    break
                self.state, self._held = "content", stripped
                continue
            content.append(held)
            self._held = ""
            break
        if final and self._held:
            (reasoning if self.state == "reasoning" else content).append(self._held)
            self._held = ""
        return "".join(reasoning), "".join(content)


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0

