"""The Textual statistics panel of `ninfer serve` (--log-stats-panel on, an interactive terminal).

A Textual app run inline on the server's own event loop: the log records scroll in the upper part
and the session statistics table (server/panel.py: the spec's columns over every completed request,
the last ten, and each model of a router) is pinned beneath them. It reads only published numbers
(the request log's SessionStats and the Engines' snapshots), redraws twice a second, and its last
frame is left on screen at exit. The terminal is in raw mode while it runs, so Ctrl+C arrives here
as a key and is handed to the server's interrupt handler (the same double-press rule).
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable

from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.widgets import DataTable, RichLog

from ninfer.server.panel import SessionStats, table, title

Gauges = Callable[[], "tuple[int, int] | None"]
MAX_RECORDS = 2000  # lines the record view keeps
RECORD_LINES = 16  # height of the record view in the inline app


class StatsApp(App):
    """Records above, the statistics table beneath."""

    CSS = f"""
    Screen {{ height: auto; }}
    #records {{ height: {RECORD_LINES}; border: none; }}
    #stats {{ height: auto; border: round $accent; }}
    """
    BINDINGS = [Binding("ctrl+c", "interrupt", "stop (press twice)", priority=True)]

    def __init__(self, stats: SessionStats, gauges: Gauges, on_interrupt: Callable[[], None] | None = None) -> None:
        super().__init__()
        self.stats = stats
        self.gauges = gauges
        self.on_interrupt = on_interrupt
        self._pending: deque[str] = deque()  # records from any thread, moved into the view on the loop
        self._lock = threading.Lock()

    def compose(self) -> ComposeResult:
        yield RichLog(id="records", max_lines=MAX_RECORDS, wrap=True, markup=False, highlight=False)
        yield DataTable(id="stats", show_cursor=False, zebra_stripes=False)

    def on_mount(self) -> None:
        self.set_interval(0.1, self.drain)
        self.set_interval(0.5, self.redraw)
        self.redraw()

    def add_record(self, line: str) -> None:
        """Queue one formatted log record (safe from any thread)."""
        with self._lock:
            self._pending.append(line)

    def drain(self) -> None:
        view = self.query_one("#records", RichLog)
        with self._lock:
            lines, self._pending = list(self._pending), deque()
        for line in lines:
            view.write(line)

    def redraw(self) -> None:
        gauges = self.gauges()
        running, waiting = gauges if gauges is not None else (None, None)
        widget = self.query_one("#stats", DataTable)
        columns, rows = table(self.stats)
        widget.clear(columns=True)
        for name, _ in columns:
            widget.add_column(name, key=name or "row")
        for cells in rows:
            widget.add_row(*cells)
        widget.border_title = title(self.stats, running, waiting)

    def action_interrupt(self) -> None:
        if self.on_interrupt is not None:
            self.on_interrupt()


class _ToApp(logging.Handler):
    def __init__(self, app: StatsApp, formatter: logging.Formatter | None) -> None:
        super().__init__()
        self.app = app
        if formatter is not None:
            self.setFormatter(formatter)

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.app.add_record(self.format(record))
        except Exception:  # noqa: BLE001 - logging must never raise into the server
            self.handleError(record)


@contextlib.asynccontextmanager
async def stats_panel(stats: SessionStats, gauges: Gauges, on_interrupt: Callable[[], None],
                      headless: bool = False) -> AsyncIterator[None]:
    """Run the panel for the duration of the block; the root logger's records go into it."""
    app = StatsApp(stats, gauges, on_interrupt)
    root = logging.getLogger()
    saved = list(root.handlers)
    root.handlers = [_ToApp(app, saved[0].formatter if saved else None)]
    task = asyncio.ensure_future(app.run_async(inline=True, inline_no_clear=True, mouse=False, headless=headless))
    try:
        yield
    finally:
        if not task.done():
            app.exit()
        with contextlib.suppress(Exception):
            await task
        root.handlers = saved
