"""What the session statistics panel (--log-stats-panel) shows: the outcomes of completed
requests (`SessionStats`, fed by the request log as it writes the req#N done records) and the
spec's columns over them. Pure data and text; the Textual app that pins it beneath the log is
ninfer/cli/panel.py. It changes no request behaviour.
"""
from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass

from rich.table import Table

from ninfer.engine.request import OutputEvent

RECENT = 10
PANEL_WIDTH = 77  # fits a console snapped to half of a 1920-pixel screen


@dataclass(slots=True, frozen=True)
class Outcome:
    """One completed request's numbers, as its req#N done record has them."""

    ttft_s: float
    prompt_tokens: int
    cached_tokens: int
    prefill_s: float
    decode_tokens: int  # output tokens after the first
    decode_s: float
    speculative: bool = False  # the request ran under --spec (the acceptance column is shown)
    drafted: int = 0
    accepted: int = 0
    rounds: int = 0  # verify rounds


class SessionStats:
    """Counts and per-request outcomes since start-up; safe from any thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.completed = self.failed = self.cancelled = self.rejected = 0
        self._all: list[Outcome] = []
        self._recent: deque[Outcome] = deque(maxlen=RECENT)
        self._by_model: dict[str, list[Outcome]] = {}  # a router's models, in first-completion order

    def done(self, final: OutputEvent, model: str | None = None) -> None:
        t, u = final.timings, final.usage
        with self._lock:
            if final.finish_reason == "cancelled":
                self.cancelled += 1
                return
            self.completed += 1
            if t is None or u is None:
                return
            spec = final.speculative or {}
            outcome = Outcome(t.prompt_ms / 1e3, u.prompt_tokens, u.cached_tokens, t.prompt_ms / 1e3,
                              max(t.predicted_n - 1, 0), t.predicted_ms / 1e3, final.speculative is not None,
                              spec.get("drafted_tokens", 0), spec.get("accepted_tokens", 0), spec.get("rounds", 0))
            self._all.append(outcome)
            self._recent.append(outcome)
            if model is not None:
                self._by_model.setdefault(model, []).append(outcome)

    def error(self, cancelled: bool) -> None:
        with self._lock:
            if cancelled:
                self.cancelled += 1
            else:
                self.failed += 1

    def reject(self) -> None:
        with self._lock:
            self.rejected += 1

    def rows(self) -> list[tuple[str, list[Outcome]]]:
        with self._lock:
            rows = [("all", list(self._all))]
            if len(self._all) > RECENT:
                rows.append((f"last {RECENT}", list(self._recent)))
            rows += [(model, list(outcomes)) for model, outcomes in self._by_model.items()]
            return rows


def _rate(tokens: float, seconds: float) -> str:
    return f"{tokens / seconds:,.1f}" if seconds > 0 else "-"


def title(stats: SessionStats, running: int | None = None, waiting: int | None = None) -> str:
    """completed/failed/cancelled/rejected counts, and the running/waiting gauges when known."""
    text = (f"{stats.completed} completed, {stats.failed} failed, {stats.cancelled} cancelled, "
            f"{stats.rejected} rejected")
    if running is not None:
        text += f" | {running} running, {waiting} waiting"
    return text


def table(stats: SessionStats) -> tuple[list[tuple[str, str]], list[list[str]]]:
    """(columns as (name, justify), rows): one row over every completed request, one over the last
    ten once more than ten completed, one per model on a router. Ratios and rates divide summed
    tokens by summed seconds, so each request weighs by its size."""
    rows = stats.rows()
    speculative = any(o.speculative for _, outcomes in rows for o in outcomes)
    columns = [("", "left"), ("n", "right"), ("TTFT", "right"), ("cached", "right"),
               ("prefill tok/s", "right"), ("decode tok/s", "right")]
    if speculative:  # the spec's "ngram, ng rnds": accepted / drafted lookup tokens, verify rounds
        columns.append(("ngram, ng rnds", "right"))
    cells_of: list[list[str]] = []
    for name, outcomes in rows:
        if not outcomes:
            cells_of.append([name, "0", *["-"] * (len(columns) - 2)])
            continue
        prompt = sum(o.prompt_tokens for o in outcomes)
        cached = sum(o.cached_tokens for o in outcomes)
        cells = [name, str(len(outcomes)),
                 f"{1e3 * sum(o.ttft_s for o in outcomes) / len(outcomes):,.0f} ms",
                 f"{100 * cached / prompt:.0f} %" if prompt else "-",
                 _rate(prompt - cached, sum(o.prefill_s for o in outcomes)),
                 _rate(sum(o.decode_tokens for o in outcomes), sum(o.decode_s for o in outcomes))]
        if speculative:
            drafted, accepted = sum(o.drafted for o in outcomes), sum(o.accepted for o in outcomes)
            cells.append(f"{accepted:,}/{drafted:,} ({100 * accepted / drafted:.0f} %), "
                         f"{sum(o.rounds for o in outcomes):,}" if drafted else "-")
        cells_of.append(cells)
    return columns, cells_of


def render(stats: SessionStats, running: int | None = None, waiting: int | None = None) -> Table:
    """The panel as a Rich table (what is left on screen at exit, and the text capture)."""
    out = Table(title=title(stats, running, waiting), title_justify="left", min_width=PANEL_WIDTH)
    columns, rows = table(stats)
    for name, justify in columns:
        out.add_column(name, justify=justify)  # type: ignore[arg-type]
    for cells in rows:
        out.add_row(*cells)
    return out
