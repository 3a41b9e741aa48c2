"""`ninfer slots list|show|rm` on a folder of slot files, as a user runs them (save, restore and
erase against a running server are in test_slots_http.py)."""
from __future__ import annotations

import json
from pathlib import Path

from ninfer.engine.session_files import write_session_file
from tests.test_cli import ninfer
from tests.test_session_files import COMPAT, image


def test_list_show_rm(tmp_path: Path) -> None:
    write_session_file(tmp_path / "conv-a", COMPAT, [image(10, 1)], kind="slot", model="smol")
    write_session_file(tmp_path / "conv-b", COMPAT, [image(30, 2)], kind="slot", model="smol")
    (tmp_path / "notes.txt").write_text("not a slot file")
    out = ninfer("slots", "list", str(tmp_path), "--json")
    assert out.returncode == 0, out.stderr
    rows = json.loads(out.stdout)
    assert [r["file"] for r in rows] == ["conv-a", "conv-b"]
    assert rows[1]["tokens"] == 31 and rows[1]["model"] == "smol" and rows[1]["digest"] == image(30, 2).digest
    assert rows[0]["size"] == (tmp_path / "conv-a").stat().st_size
    text = ninfer("slots", "list", str(tmp_path)).stdout
    assert "conv-b" in text and "notes.txt" not in text
    shown = json.loads(ninfer("slots", "show", str(tmp_path / "conv-a"), "--json").stdout)
    assert shown["compat"]["kv_dtype"] == "float32" and shown["images"][0]["checkpoints"] == [4, 10]
    assert ninfer("slots", "rm", str(tmp_path / "conv-a")).returncode == 0
    assert not (tmp_path / "conv-a").exists()
    bad = ninfer("slots", "rm", str(tmp_path / "notes.txt"))
    assert bad.returncode == 1 and "not a ninfer session file" in bad.stderr and (tmp_path / "notes.txt").exists()
    down = ninfer("slots", "erase", "0", "--url", "http://127.0.0.1:9")
    assert down.returncode == 1 and "cannot reach" in down.stderr
