"""The session statistics panel (--log-stats-panel on): a table pinned beneath the scrolling log
records on an interactive terminal, redrawn as requests complete and left on screen at exit.

It reads the same outcomes as the req#N done records (`SessionStats`, fed by the request log) and
changes no request behaviour. Rich's Live display does the pinning: records print above it and
stay in the scrollback.
"""
from __future__ import annotations

import logging
import threading
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable

from rich.console import Console
from rich.live import Live
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

    def done(self, final: OutputEvent) -> None:
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
            return rows


def _rate(tokens: float, seconds: float) -> str:
    return f"{tokens / seconds:,.1f}" if seconds > 0 else "-"


def render(stats: SessionStats, running: int | None = None, waiting: int | None = None) -> Table:
    """The panel: title counts, then one row over every completed request (and one over the last ten).
    Ratios and rates divide summed tokens by summed seconds, so each request weighs by its size."""
    title = (f"{stats.completed} completed, {stats.failed} failed, {stats.cancelled} cancelled, "
             f"{stats.rejected} rejected")
    if running is not None:
        title += f" | {running} running, {waiting} waiting"
    table = Table(title=title, title_justify="left", min_width=PANEL_WIDTH)
    rows = stats.rows()
    speculative = any(o.speculative for _, outcomes in rows for o in outcomes)
    columns = [("", "left"), ("n", "right"), ("TTFT", "right"), ("cached", "right"),
               ("prefill tok/s", "right"), ("decode tok/s", "right")]
    if speculative:  # the spec's "ngram, ng rnds": accepted / drafted lookup tokens, verify rounds
        columns.append(("ngram, ng rnds", "right"))
    for name, justify in columns:
        table.add_column(name, justify=justify)  # type: ignore[arg-type]
    for name, outcomes in rows:
        if not outcomes:
            table.add_row(name, "0", *["-"] * (len(columns) - 2))
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
        table.add_row(*cells)
    return table


class _PanelHandler(logging.Handler):
    """Prints each log record above the live panel."""

    def __init__(self, live: Live, formatter: logging.Formatter | None) -> None:
        super().__init__()
        self.live = live
        if formatter is not None:
            self.setFormatter(formatter)

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.live.console.print(self.format(record), markup=False, highlight=False, soft_wrap=True)
        except Exception:  # noqa: BLE001 - logging must never raise into the server
            self.handleError(record)


class StatsPanel:
    """The live panel for the duration of a `with` block: while it is open, log records of the
    root logger print above it instead of straight to stderr."""

    def __init__(self, stats: SessionStats, gauges: Callable[[], tuple[int, int] | None]) -> None:
        self.stats = stats
        self.gauges = gauges
        self._live: Live | None = None
        self._saved: list[logging.Handler] = []

    def __rich__(self) -> Any:
        g = self.gauges()
        return render(self.stats, *(g if g is not None else (None, None)))

    def __enter__(self) -> StatsPanel:
        console = Console(stderr=True)
        self._live = Live(self, console=console, refresh_per_second=2, transient=False,
                          redirect_stdout=True, redirect_stderr=True)
        self._live.__enter__()
        root = logging.getLogger()
        self._saved = list(root.handlers)
        formatter = self._saved[0].formatter if self._saved else None
        root.handlers = [_PanelHandler(self._live, formatter)]
        return self

    def __exit__(self, *exc: object) -> None:
        logging.getLogger().handlers = self._saved
        if self._live is not None:
            self._live.__exit__(None, None, None)
            self._live = None
