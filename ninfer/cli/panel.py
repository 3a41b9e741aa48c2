"""The Textual statistics panel of `ninfer serve` (--log-stats-panel on, an interactive terminal).

A Textual app run inline on the server's own event loop: the session statistics table
(server/panel.py: the spec's columns over every completed request, the last ten, and each model of
a router) is pinned at the bottom of the terminal, and the log records are written to the terminal
itself above it, so they scroll into the terminal's scrollback like any other output. Textual has no
API to print above an inline app, so `_print_above` works the way Textual draws an inline frame: from
the top of the app's region it writes the records over it (the terminal scrolls them up) and the next
frame paints the region from the line after them. The panel reads only published numbers (the
request log's SessionStats and the Engines' snapshots), redraws after each batch of records and
twice a second, and its last frame is left on screen as ordinary output at exit. The terminal is in raw mode while it runs, so Ctrl+C arrives here as a
key and is handed to the server's interrupt handler (the same double-press rule). Without an
inline terminal (the pilot's headless driver) records go to `records_to` as plain lines.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
import threading
from collections.abc import AsyncIterator, Callable
from typing import ClassVar, TextIO

from rich.cells import cell_len
from rich.control import Control
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.geometry import Offset
from textual.widgets import DataTable

from ninfer.server.panel import SessionStats, table, title

Gauges = Callable[[], "tuple[int, int] | None"]


class StatsApp(App):
    """The statistics table, pinned beneath the records the terminal scrolls."""

    INLINE_PADDING = 0  # no blank line between the last record and the panel
    CSS = """
    Screen { height: auto; }
    Screen:inline { border: none; }
    #stats { height: auto; border: round $accent; }
    """
    BINDINGS: ClassVar = [Binding("ctrl+c", "interrupt", "stop (press twice)", priority=True)]

    def __init__(self, stats: SessionStats, gauges: Gauges, on_interrupt: Callable[[], None] | None = None,
                 records_to: TextIO | None = None) -> None:
        super().__init__()
        self.stats = stats
        self.gauges = gauges
        self.on_interrupt = on_interrupt
        self.records_to = records_to
        self._pending: list[str] = []  # records from any thread, written on the app's loop
        self._partial = ""  # a captured print's unfinished line
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None

    def compose(self) -> ComposeResult:
        yield DataTable(id="stats", show_cursor=False, zebra_stripes=False)

    def on_mount(self) -> None:
        self._loop = asyncio.get_running_loop()
        self.set_interval(0.5, self.redraw)
        self.redraw()
        self.drain()

    def add_record(self, line: str) -> None:
        """Queue one formatted log record (safe from any thread); the app's loop writes it."""
        with self._lock:
            first = not self._pending
            self._pending.append(line)
        loop = self._loop
        if first and loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop closed: stats_panel writes the rest
                loop.call_soon_threadsafe(self.drain)

    def _print(self, text: str, stderr: bool = False) -> None:
        """Text printed to stdout/stderr while the app runs (Textual captures it): whole lines go
        above the panel like records instead of being lost."""
        with self._lock:
            lines = (self._partial + text).split("\n")
            self._partial = lines.pop()
        for line in lines:
            self.add_record(line)

    def take_pending(self) -> list[str]:
        with self._lock:
            lines, self._pending = self._pending, []
        return lines

    def drain(self) -> None:
        """Write the queued records above the panel, then redraw it (on the app's loop)."""
        if not self.is_running:
            return
        lines = self.take_pending()
        if not lines:
            return
        self._print_above(lines)
        self.redraw()

    def _print_above(self, lines: list[str]) -> None:
        driver = self._driver
        if driver is None or self.is_headless or not driver.is_inline:
            out = self.records_to or sys.__stderr__
            out.write("".join(line + "\n" for line in lines))
            out.flush()
            return
        # Textual's inline rendering (App._display, InlineUpdate): the terminal cursor sits at
        # _previous_cursor_position inside the app's region, every frame starts from the region's
        # top-left and paints all of it. The records overwrite the region from its top (the
        # terminal wraps and scrolls them), and the next frame paints the region from the line
        # after them, over whatever is left of the old one. A record's last row is cleared to its
        # end unless the text fills it (there the cursor waits on the last column, which an erase
        # would blank); the rows before it are full of text.
        width = max(1, self.size.width)
        x, y = self._previous_cursor_position
        text = "".join(line + ("" if line and cell_len(line) % width == 0 else "\x1b[K") + "\r\n" for line in lines)
        driver.write(Control.move(-x, -y).segment.text + "\r" + text)
        driver.flush()
        self._previous_cursor_position = Offset(0, 0)  # the region now starts on this line
        self.screen.refresh()

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
                      headless: bool = False, records_to: TextIO | None = None) -> AsyncIterator[None]:
    """Run the panel for the duration of the block; the root logger's records go above it. At
    the end the queued records are written, the panel's last frame stays beneath them, and later
    records go to the terminal under it as before."""
    app = StatsApp(stats, gauges, on_interrupt, records_to)
    root = logging.getLogger()
    saved = list(root.handlers)
    root.handlers = [_ToApp(app, saved[0].formatter if saved else None)]
    task = asyncio.ensure_future(app.run_async(inline=True, inline_no_clear=True, mouse=False, headless=headless))
    try:
        yield
    finally:
        app.drain()
        if not task.done():
            app.exit()
        with contextlib.suppress(Exception):
            await task
        root.handlers = saved
        left = app.take_pending()  # logged while the app was closing: beneath its last frame
        if left:
            out = records_to or sys.__stderr__
            out.write("".join(line + "\n" for line in left))
            out.flush()
