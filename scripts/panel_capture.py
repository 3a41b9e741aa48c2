"""Capture the statistics panel of a real `ninfer serve` run as text (docs/PANEL.md).

Runs the server in a tmux pane (a real terminal, so the Textual panel is on), sends chat requests
with the openai client (to two router models when --preset is given), presses Ctrl+C twice, and
prints the end of what the terminal holds after the exit (scrollback and screen, as tmux keeps it):
the last records, the panel's last frame left beneath them, and the records after it.

    python scripts/panel_capture.py MODEL_OR_NOTHING [--preset FILE] [--requests 12]
"""
from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time
import uuid

COLUMNS, LINES = 100, 34
RECORDS_SHOWN = 16  # record lines printed above the panel


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?")
    ap.add_argument("--preset")
    ap.add_argument("--requests", type=int, default=12)
    args = ap.parse_args()
    import openai

    port = free_port()
    cmd = [sys.executable, "-m", "ninfer.cli.main", "serve", "--port", str(port), "--log-stats-interval-ms", "0"]
    cmd += ["--models-preset", args.preset, "--models-max", "0"] if args.preset else ([args.model] if args.model else [])
    sock = f"ninfer-capture-{uuid.uuid4().hex[:12]}"

    def tmux(*a: str) -> str:
        return subprocess.run(["tmux", "-L", sock, "-f", "/dev/null", *a], check=True, capture_output=True,
                              text=True).stdout

    env = [f"PYTHONPATH={os.environ.get('PYTHONPATH', '')}", "TERM=xterm-256color"]
    tmux("new-session", "-d", "-s", "c", "-x", str(COLUMNS), "-y", str(LINES), "env", "-u", "COLUMNS", "-u", "LINES",
         *env, *cmd)
    tmux("set-option", "-t", "c", "remain-on-exit", "on")

    def text() -> str:
        return tmux("capture-pane", "-p", "-J", "-S", "-", "-E", "-", "-t", "c")

    try:
        deadline = time.monotonic() + 240
        while "serving" not in text():
            assert tmux("display-message", "-p", "-t", "c", "#{pane_dead}").strip() == "0", text()
            assert time.monotonic() < deadline, text()
            time.sleep(0.1)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
        names = [m.id for m in client.models.list().data]
        prompts = ["Say hi", "Name three colors.", "Count to five.", "What is 2+2?"]
        for n in range(args.requests):
            client.chat.completions.create(model=names[n % len(names)], max_tokens=16 + 4 * (n % 3),
                                           messages=[{"role": "user", "content": prompts[n % len(prompts)]}])
        time.sleep(1.5)  # two redraws
        tmux("send-keys", "-t", "c", "C-c")
        time.sleep(0.5)
        tmux("send-keys", "-t", "c", "C-c")
        deadline = time.monotonic() + 60
        while tmux("display-message", "-p", "-t", "c", "#{pane_dead}").strip() != "1":
            assert time.monotonic() < deadline, text()
            time.sleep(0.1)
        time.sleep(0.5)  # tmux reaps the process on its own time
        status = tmux("display-message", "-p", "-t", "c", "#{pane_dead_status}").strip() or "unknown"
        lines = [line.rstrip() for line in text().rstrip("\n").split("\n")]
    finally:
        subprocess.run(["tmux", "-L", sock, "kill-server"], capture_output=True, check=False)
    lines = [line for line in lines if line and not line.startswith("Pane is dead")]
    top = max((i for i, line in enumerate(lines) if line.lstrip().startswith("╭")), default=len(lines))
    print("\n".join(lines[max(0, top - RECORDS_SHOWN):]))
    print(f"(exit status {status})")


if __name__ == "__main__":
    main()
