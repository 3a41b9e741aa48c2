"""Start-up reliability, each on a real `ninfer serve` process: a signal at any point of loading
ends it with 130 and no native abort; every start-up input (chat template, sampler presets, model
file) is checked before ready and refused with one line and exit 1."""
from __future__ import annotations

import json
import os
import signal
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

ABORT_SIGNS = ("terminate called", "Fatal Python error", "core dumped", "Aborted")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(args: list[str], tmp: Path, env: dict[str, str] | None = None) -> tuple[subprocess.Popen, Path]:
    log = tmp / f"serve-{time.monotonic_ns()}.log"
    cmd = [sys.executable, "-m", "ninfer.cli.main", "serve", *args, "--port", str(_free_port())]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
    return proc, log


def _wait_exit(proc: subprocess.Popen, timeout: float) -> int:
    """The exit status; a process still running after `timeout` is killed (never left behind)."""
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise


def _wait_for(proc: subprocess.Popen, log: Path, marker: str, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while marker not in log.read_text(errors="replace"):
        assert proc.poll() is None, f"serve exited before {marker!r}:\n{log.read_text()}"
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"no {marker!r} within {timeout} s:\n{log.read_text()}")
        time.sleep(0.02)


def _wait_until_mapped(proc: subprocess.Popen, library: str, timeout: float = 120.0) -> None:
    """Until the process has `library` mapped (Linux); elsewhere a fixed 0.4 s."""
    maps = Path(f"/proc/{proc.pid}/maps")
    if not maps.exists():
        time.sleep(0.4)
        return
    deadline = time.monotonic() + timeout
    while library not in maps.read_text(errors="replace"):
        assert proc.poll() is None and time.monotonic() < deadline, f"{library} was never loaded"
        time.sleep(0.005)


def _ended_cleanly(proc: subprocess.Popen, log: Path, allowed: tuple[int, ...] = (130,)) -> str:
    rc = _wait_exit(proc, 60)
    text = log.read_text(errors="replace")
    assert rc in allowed, f"exit status {rc}:\n{text}"
    for sign in ABORT_SIGNS:
        assert sign not in text, text
    assert "Traceback" not in text, text
    return text


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_signal_at_each_point_of_start_up_ends_it_cleanly(sig: int, smollm2_artifact: Path,
                                                          smollm2_gguf: Path, tmp_path: Path) -> None:
    # 1. while the command's modules import (torch is loading: the process is inside ninfer's
    #    code, where a KeyboardInterrupt would abort natively or be swallowed): 130 at once
    proc, log = _spawn([str(smollm2_artifact)], tmp_path)
    _wait_until_mapped(proc, "libtorch")
    proc.send_signal(sig)
    _ended_cleanly(proc, log)

    # 2. the moment the port is bound and the load thread starts, and 3. into the load
    for delay in (0.0, 0.6):
        proc, log = _spawn([str(smollm2_artifact)], tmp_path)
        _wait_for(proc, log, "listening on")
        time.sleep(delay)
        proc.send_signal(sig)
        text = _ended_cleanly(proc, log)
        assert "stopped during start-up" in text or "ready" in text.split("listening on")[-1], text

    # 4. while a GGUF converts into an empty cache (torch work on the load thread)
    proc, log = _spawn([str(smollm2_gguf)], tmp_path, env={"NINFER_CACHE": str(tmp_path / "cache")})
    _wait_for(proc, log, "converting")
    time.sleep(0.3)
    proc.send_signal(sig)
    assert "stopped during start-up" in _ended_cleanly(proc, log)


def _refused(args: list[str], tmp: Path, *needles: str) -> str:
    proc, log = _spawn(args, tmp)
    rc = _wait_exit(proc, 240)
    text = log.read_text(errors="replace")
    assert rc == 1, f"exit status {rc}:\n{text}"
    assert "Traceback" not in text and "ready" not in text, text
    errors = [line for line in text.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, text
    for needle in needles:
        assert needle in errors[0], errors[0]
    return errors[0]


@pytest.mark.parametrize("template, why", [
    ("{% for m in messages %}{{ m.content | no_such_filter }}{% endfor %}", "does not compile"),
    ("{% for m in messages %}{{ m.content }}{% endfor %", "does not compile"),
    ("{{ raise_exception('this template is broken') }}", "this template is broken"),
    ("{{ messages[0].content.no_such_method() }}", "cannot render"),
])
def test_broken_chat_template_is_refused_before_ready(template: str, why: str, smollm2_artifact: Path,
                                                      tmp_path: Path) -> None:
    path = tmp_path / "broken.jinja"
    path.write_text(template)
    _refused([str(smollm2_artifact), "--chat-template", str(path)], tmp_path, "--chat-template", str(path), why)


def _rewrite_metadata(src: Path, dst: Path, edit) -> None:
    """Copy a .ninfer with its ninfer.metadata JSON edited by `edit(dict)`."""
    raw = src.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    meta = json.loads(header["__metadata__"]["ninfer.metadata"])
    edit(meta)
    header["__metadata__"]["ninfer.metadata"] = json.dumps(meta)
    new = json.dumps(header).encode()
    new += b" " * (-len(new) % 8)
    dst.write_bytes(struct.pack("<Q", len(new)) + new + raw[8 + n:])


def test_bad_sampler_preset_is_refused_before_ready(smollm2_artifact: Path, tmp_path: Path) -> None:
    bad = tmp_path / "bad-preset.ninfer"
    _rewrite_metadata(smollm2_artifact, bad, lambda m: m.update(sampler_presets={"default": {"top_p": "high"}}))
    _refused([str(bad)], tmp_path, str(bad), "top_p")


def test_truncated_artifact_names_the_file_and_the_problem(smollm2_artifact: Path, tmp_path: Path) -> None:
    raw = smollm2_artifact.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    for cut, words in ((8 + n // 2, "truncated"), (len(raw) // 2, "truncated"), (len(raw) - 1, "truncated")):
        bad = tmp_path / f"cut-{cut}.ninfer"
        bad.write_bytes(raw[:cut])
        line = _refused([str(bad)], tmp_path, str(bad), words)
        assert "SafetensorError" not in line


def test_corrupt_gguf_names_the_problem_without_converting(smollm2_gguf: Path, tmp_path: Path) -> None:
    raw = smollm2_gguf.read_bytes()
    for name, data in (("header-cut.gguf", raw[:5000]), ("garbage.gguf", b"GGUF" + b"\xff" * 4000)):
        bad = tmp_path / name
        bad.write_bytes(data)
        proc, log = _spawn([str(bad)], tmp_path, env={"NINFER_CACHE": str(tmp_path / "cache")})
        assert _wait_exit(proc, 240) == 1
        text = log.read_text()
        assert "converting" not in text and "Traceback" not in text, text
        [line] = [x for x in text.splitlines() if x.startswith("error:")]
        assert str(bad) in line and "(error)" not in line, line
