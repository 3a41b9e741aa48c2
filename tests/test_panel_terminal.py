"""The statistics panel of a real `ninfer serve` in a real terminal (tmux): the records scroll up
into the terminal's scrollback, the panel stays pinned beneath them on screen, exactly once, and at
exit its last frame is left as ordinary output with the records that follow it below."""
from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import pytest
from test_reliability_startup import _free_port

pytestmark = pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux")

COLUMNS, LINES = 100, 24
REQUESTS = 14  # 28 records (start and done): more than the screen holds


class Tmux:
    """One pane on a private tmux server (its own socket), killed at the end."""

    def __init__(self, command: list[str], env: dict[str, str]) -> None:
        self.socket = f"ninfer-test-{uuid.uuid4().hex[:12]}"
        self.tmux(["new-session", "-d", "-s", "t", "-x", str(COLUMNS), "-y", str(LINES),
                   "env", "-u", "COLUMNS", "-u", "LINES", *(f"{k}={v}" for k, v in env.items()), *command])
        self.tmux(["set-option", "-t", "t", "remain-on-exit", "on"])

    def tmux(self, args: list[str]) -> str:
        return subprocess.run(["tmux", "-L", self.socket, "-f", "/dev/null", *args], check=True,
                              capture_output=True, text=True).stdout

    def screen(self) -> list[str]:
        return self.tmux(["capture-pane", "-p", "-t", "t"]).rstrip("\n").split("\n")

    def everything(self) -> list[str]:
        """The scrollback and the screen."""
        return self.tmux(["capture-pane", "-p", "-J", "-S", "-", "-E", "-", "-t", "t"]).rstrip("\n").split("\n")

    def value(self, name: str) -> str:
        return self.tmux(["display-message", "-p", "-t", "t", f"#{{{name}}}"]).strip()

    def close(self) -> None:
        subprocess.run(["tmux", "-L", self.socket, "kill-server"], capture_output=True, check=False)


def wait(predicate, what: str, pane: Tmux, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} within {timeout} s:\n" + "\n".join(pane.everything()))
        time.sleep(0.1)


def panel_tops(lines: list[str]) -> list[int]:
    return [i for i, line in enumerate(lines) if "completed," in line and line.lstrip().startswith("╭")]


def test_records_scroll_into_the_scrollback_beneath_them_the_panel(smollm2_artifact: Path, tmp_path: Path) -> None:
    port = _free_port()
    env = {"PYTHONPATH": os.environ.get("PYTHONPATH", ""), "TERM": "xterm-256color", "HOME": os.environ["HOME"],
           "PATH": os.environ["PATH"]}
    status = tmp_path / "status"
    serve = shlex.join([sys.executable, "-m", "ninfer.cli.main", "serve", str(smollm2_artifact), "--port", str(port),
                        "--log-stats-interval-ms", "0", "--max-context", "1024"])
    pane = Tmux(["sh", "-c", f"{serve}; echo $? > {shlex.quote(str(status))}"], env)
    try:
        wait(lambda: any("serving" in line for line in pane.everything()), "serving record", pane)
        body = {"messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 2, "temperature": 0}
        for _ in range(REQUESTS):
            assert httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=120).status_code == 200
        wait(lambda: f"{REQUESTS} completed," in "\n".join(pane.screen()), "panel with every request", pane)

        screen, everything = pane.screen(), pane.everything()
        assert int(pane.value("history_size")) > 0  # records went up into the scrollback
        done = [line for line in everything if " INFO req#" in line and " done " in line]
        assert [line.split("req#")[1].split()[0] for line in done] == [str(n) for n in range(1, REQUESTS + 1)]
        assert not any("req#1 done" in line for line in screen)  # scrolled off the screen, kept above
        # the panel: on screen once, at the bottom, beneath the last record; never copied into the scrollback
        assert len(panel_tops(everything)) == 1 and len(panel_tops(screen)) == 1
        top = panel_tops(screen)[0]
        assert f"req#{REQUESTS} done" in "\n".join(screen[:top])
        assert screen[top + 2].split()[1:3] == ["all", str(REQUESTS)] and screen[top + 3].split()[1] == "last"
        assert screen[top + 4].lstrip().startswith("╰")
        assert all(not line.strip() for line in screen[top + 5:])

        pane.tmux(["send-keys", "-t", "t", "C-c"])
        wait(lambda: "Press Ctrl+C again" in "\n".join(pane.everything()), "the first Ctrl+C's warning", pane)
        pane.tmux(["send-keys", "-t", "t", "C-c"])
        # the exit status the shell around the server wrote (tmux's own pane_dead_status can lag:
        # it reaps the pane's process on its own time)
        wait(lambda: status.exists() and status.read_text().endswith("\n"), "exit", pane, timeout=60)
        assert status.read_text().strip() == "0", "\n".join(pane.everything()[-30:])
        wait(lambda: "server stopped" in "\n".join(pane.everything()), "the last record", pane)
        after = pane.everything()
        tops = panel_tops(after)
        assert len(tops) == 1  # the last frame stays, once, as ordinary output
        warning = max(i for i, line in enumerate(after) if "Press Ctrl+C again" in line)
        assert warning < tops[0]  # records logged while it ran stayed above it
        assert any("server stopped" in line for line in after[tops[0] + 5:])  # later records below it
    finally:
        pane.close()
