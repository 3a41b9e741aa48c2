"""The session file format: round trip, checksum verified before anything is parsed, the
compatibility profile, a cancelled save, and a real process killed (-9) in the middle of a save
leaving the previous file intact."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

from ninfer.engine.session_files import (SaveCancelled, SessionFileError, SessionImage, read_session_file,
                                         read_session_header, tmp_path, write_session_file)

COMPAT = {"artifact": "m@abc", "weight_formats": ["int4ag32"], "kv_dtype": "float32", "state_kinds": ["attention"]}


def image(n_tokens: int = 10, seed: int = 0) -> SessionImage:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 1000, (n_tokens,), generator=g).tolist()
    return SessionImage(tokens, tokens + [7], [4], True, 3,
                        [torch.randn(3, 4, 2, 8, generator=g).to(torch.bfloat16), torch.randn(3, 4, 2, 8, generator=g),
                         torch.randint(-128, 127, (2, 5), generator=g, dtype=torch.int8)])


def test_round_trip_keeps_every_tensor_bit_exact(tmp_path: Path) -> None:
    path = tmp_path / "a.slot"
    imgs = [image(10, 0), image(13, 1)]
    n = write_session_file(path, COMPAT, imgs, kind="slot", model="m")
    assert n == path.stat().st_size
    header, back, n_read = read_session_file(path, COMPAT)
    assert n_read == n and header["kind"] == "slot" and header["model"] == "m"
    assert header["images"][0]["digest"] == imgs[0].digest
    for a, b in zip(imgs, back):
        assert (a.token_ids, a.session, a.page_checkpoints, a.frontier_state, a.n_pages) == \
               (b.token_ids, b.session, b.page_checkpoints, b.frontier_state, b.n_pages)
        for x, y in zip(a.tensors, b.tensors):
            assert x.dtype == y.dtype and torch.equal(x, y)
    assert read_session_header(path)["images"][1]["token_ids"] == imgs[1].token_ids
    assert not tmp_path.joinpath(".a.slot.tmp").exists()


@pytest.mark.parametrize("where", ["payload", "header", "checksum", "truncate"])
def test_a_damaged_file_fails_its_checksum(tmp_path: Path, where: str) -> None:
    path = tmp_path / "a.slot"
    write_session_file(path, COMPAT, [image()], kind="slot")
    data = bytearray(path.read_bytes())
    if where == "truncate":
        data = data[:-100]
    else:
        i = {"payload": len(data) - 200, "header": 30, "checksum": len(data) - 1}[where]
        data[i] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(SessionFileError, match="checksum|not a ninfer"):
        read_session_file(path, COMPAT)


def test_incompatible_profile_names_what_differs(tmp_path: Path) -> None:
    path = tmp_path / "a.slot"
    write_session_file(path, COMPAT, [image()], kind="slot")
    with pytest.raises(SessionFileError, match="kv_dtype 'float32'.*'int8'"):
        read_session_file(path, {**COMPAT, "kv_dtype": "int8"})
    with pytest.raises(SessionFileError, match="does not exist"):
        read_session_file(tmp_path / "missing", COMPAT)


def test_cancelled_save_keeps_the_previous_file(tmp_path: Path) -> None:
    path = tmp_path / "a.slot"
    write_session_file(path, COMPAT, [image(10, 0)], kind="slot")
    before = path.read_bytes()
    cancel = threading.Event()
    cancel.set()
    with pytest.raises(SaveCancelled):
        write_session_file(path, COMPAT, [image(20, 5)], kind="slot", cancel=cancel)
    assert path.read_bytes() == before and not tmp_path_of(path).exists()


def tmp_path_of(path: Path) -> Path:
    return tmp_path(path)


WRITER = textwrap.dedent("""
    import sys, torch
    from pathlib import Path
    from ninfer.engine.session_files import SessionImage, write_session_file
    big = [torch.ones(64, 1024, 1024, dtype=torch.float32) for _ in range(2)]  # 512 MiB: takes a while to write
    img = SessionImage(list(range(100)), list(range(100)), [], False, 64, big)
    print("writing", flush=True)
    write_session_file(Path(sys.argv[1]), {"artifact": "x"}, [img], kind="slot")
    print("done", flush=True)
""")


def test_kill_9_during_a_save_leaves_the_previous_file(tmp_path: Path) -> None:
    path = tmp_path / "conv.slot"
    write_session_file(path, COMPAT, [image(10, 3)], kind="slot")
    before = path.read_bytes()
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(path)], env=env, stdout=subprocess.PIPE, text=True)
    tmp = tmp_path_of(path)
    deadline = time.monotonic() + 120
    try:
        assert proc.stdout.readline().strip() == "writing"
        # kill once the temporary file has data in it: mid-save
        while not (tmp.exists() and tmp.stat().st_size > (64 << 20)):
            assert proc.poll() is None, "the writer ended before it was killed"
            assert time.monotonic() < deadline
            time.sleep(0.001)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == -signal.SIGKILL
    assert tmp.exists(), "the kill came after the rename: not mid-save"
    assert path.read_bytes() == before
    _, imgs, _ = read_session_file(path, COMPAT)  # still verifies
    assert imgs[0].token_ids == image(10, 3).token_ids
