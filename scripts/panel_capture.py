"""Capture the statistics panel of a real `ninfer serve` run as text (docs/PANEL.md).

Runs the server under a pseudo-terminal (so the Textual panel is on), sends chat requests with the
openai client (to two router models when --preset is given), presses Ctrl+C twice on the terminal,
and prints the last frame the panel left on screen with the control sequences removed.

    python scripts/panel_capture.py MODEL_OR_NOTHING [--preset FILE] [--requests 12]
"""
from __future__ import annotations

import argparse
import os
import pty
import re
import select
import socket
import subprocess
import sys
import threading
import time

RECORD_LINES = 16  # the record view's height (cli/panel.py)
ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(\x07|\x1b\\)|\x1b[()][0-9A-Za-z]|\x1b[=>78]")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def read_all(fd: int, seconds: float, out: bytearray) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], 0.05)
        if ready:
            try:
                chunk = os.read(fd, 65536)
            except OSError:
                return
            if not chunk:
                return
            out += chunk


def last_frame(raw: bytes) -> str:
    """The text of the app's last frame: the record lines above the table, then the table from its
    top border to its bottom border."""
    text = ANSI.sub("", raw.decode("utf-8", "replace")).replace("\r\n", "\n").replace("\r", "\n")
    lines = [line.rstrip() for line in text.split("\n")]
    tops = [i for i, line in enumerate(lines) if line.lstrip().startswith("╭")]
    if not tops:
        return "\n".join(lines[-40:])
    start = tops[-1]
    above = max(0, start - RECORD_LINES)
    end = next((i for i in range(start, len(lines)) if lines[i].lstrip().startswith("╰")), len(lines) - 1)
    return "\n".join(line for line in lines[above:start] if line.strip()) + "\n" + "\n".join(lines[start:end + 1])


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
    master, slave = pty.openpty()
    os.set_blocking(master, False)
    import fcntl
    import struct
    import termios
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 34, 100, 0, 0))
    env = dict(os.environ, TERM="xterm-256color", COLUMNS="100", LINES="34")
    proc = subprocess.Popen(cmd, stdin=slave, stdout=slave, stderr=slave, env=env, start_new_session=True)
    os.close(slave)
    raw = bytearray()
    done = threading.Event()

    def drain() -> None:  # read the terminal all the time: a full pty would block the server's writes
        while not done.is_set():
            read_all(master, 0.1, raw)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 240
        while b"serving" not in raw:
            assert proc.poll() is None and time.monotonic() < deadline, ANSI.sub("", raw.decode(errors="replace"))
            time.sleep(0.1)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
        names = [m.id for m in client.models.list().data]
        prompts = ["Say hi", "Name three colors.", "Count to five.", "What is 2+2?"]
        for n in range(args.requests):
            client.chat.completions.create(model=names[n % len(names)], max_tokens=16 + 4 * (n % 3),
                                           messages=[{"role": "user", "content": prompts[n % len(prompts)]}])
        time.sleep(1.5)  # two redraws
        os.write(master, b"\x03")
        time.sleep(0.5)
        os.write(master, b"\x03")
        proc.wait(60)
        time.sleep(1.0)
    finally:
        done.set()
        if proc.poll() is None:
            proc.kill()
    print(last_frame(bytes(raw)))
    print(f"(exit status {proc.returncode})")


if __name__ == "__main__":
    main()
