"""The Textual statistics panel (cli/panel.py) driven with Textual's pilot: after scripted requests
pass through the request log, the pinned table shows the spec's rows and the title the counts;
log records are written out above it (to the terminal, or to `records_to` without one); Ctrl+C is
handed to the server's interrupt handler. tests/test_panel_terminal.py runs the real server in tmux."""
from __future__ import annotations

import asyncio
import io
import logging

from ninfer.cli.panel import StatsApp, stats_panel
from ninfer.engine.request import OutputEvent, Timings, Usage
from ninfer.errors import RequestError
from ninfer.server.reqlog import RequestLog


def finish(log: RequestLog, n: int, model: str, prompt: int, cached: int, out: int, prompt_ms: float,
           predicted_ms: float) -> None:
    final = OutputEvent("r", finish_reason="stop", usage=Usage(prompt, out, cached),
                        timings=Timings(cache_n=cached, prompt_n=prompt - cached, prompt_ms=prompt_ms,
                                        predicted_n=out, predicted_ms=predicted_ms))
    log.request_done(n, "chat", final, 1.0, model=model)


def rows(app: StatsApp) -> list[list[str]]:
    table = app.query_one("#stats")
    return [[str(c) for c in table.get_row_at(i)] for i in range(table.row_count)]


def test_panel_rows_after_scripted_requests() -> None:
    async def main() -> None:
        log = RequestLog()
        gauges = {"value": (1, 2)}
        app = StatsApp(log.stats, lambda: gauges["value"])
        async with app.run_test(size=(100, 30)) as pilot:
            assert rows(app) == [["all", "0", "-", "-", "-", "-"]]
            finish(log, 1, "alpha", 100, 0, 11, 100.0, 100.0)  # prefill 1000 tok/s; decode 10 in 0.1 s
            finish(log, 2, "beta", 100, 100, 31, 10.0, 1000.0)  # a cache hit; decode 30 in 1 s
            log.request_error(3, "chat", RequestError("x", status=499, code="client_closed"), 0.2)
            log.request_rejected("chat", RequestError("x", status=400, code="invalid_value", param="top_p"))
            await pilot.pause(0.7)
            table = rows(app)
            assert [r[0] for r in table] == ["all", "alpha", "beta"]  # per-model rows on a router
            assert table[0] == ["all", "2", "55 ms", "50 %", "909.1", "36.4"]
            assert table[1] == ["alpha", "1", "100 ms", "0 %", "1,000.0", "100.0"]
            assert app.query_one("#stats").border_title == \
                "2 completed, 0 failed, 1 cancelled, 1 rejected | 1 running, 2 waiting"
            for n in range(10):
                finish(log, 10 + n, "alpha", 10, 0, 2, 10.0, 10.0)
            gauges["value"] = (0, 0)
            await pilot.pause(0.7)
            assert [r[0] for r in rows(app)] == ["all", "last 10", "alpha", "beta"]
            assert rows(app)[1][1] == "10"
            assert app.query_one("#stats").border_title.endswith("| 0 running, 0 waiting")

    asyncio.run(main())


def test_records_scroll_above_and_ctrl_c_reaches_the_server() -> None:
    async def main() -> None:
        log = RequestLog()
        presses: list[int] = []
        out = io.StringIO()
        app = StatsApp(log.stats, lambda: None, on_interrupt=lambda: presses.append(1), records_to=out)
        async with app.run_test(size=(100, 30)) as pilot:
            app.add_record("2026-01-01 00:00:00.000 INFO req#1 done chat stop")
            await pilot.pause(0.1)
            print("a stray print")  # captured by Textual while the app runs: a record too
            await pilot.pause(0.1)
            assert out.getvalue() == "2026-01-01 00:00:00.000 INFO req#1 done chat stop\na stray print\n"
            assert not app.query("#records")  # no record view inside the app: the terminal scrolls them
            await pilot.press("ctrl+c")
            await pilot.pause(0.1)
            assert presses == [1] and app.is_running  # the server decides; the panel keeps running
            assert "running" not in app.query_one("#stats").border_title  # no gauges: no counts shown

    asyncio.run(main())


def test_stats_panel_takes_the_log_records_while_it_runs() -> None:
    async def main() -> None:
        root = logging.getLogger()
        before = list(root.handlers)
        log = RequestLog()
        out = io.StringIO()
        async with stats_panel(log.stats, lambda: (0, 0), lambda: None, headless=True, records_to=out):
            assert len(root.handlers) == 1 and type(root.handlers[0]).__name__ == "_ToApp"
            logging.getLogger("ninfer.server").warning("a record")
            logging.getLogger("ninfer.server").warning("the last record")  # written at the end at the latest
        assert root.handlers == before
        lines = out.getvalue().splitlines()
        assert len(lines) == 2 and lines[0].endswith("a record") and lines[1].endswith("the last record")

    asyncio.run(main())
