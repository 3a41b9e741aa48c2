"""The build string `<VERSION>+<build id>` the spec's "Server version" section defines."""
from __future__ import annotations

import functools
import os
import subprocess
from pathlib import Path

_PKG = Path(__file__).resolve().parent
__version__ = (_PKG / "VERSION").read_text().strip()


@functools.cache
def build_id() -> str:
    """`NINFER_BUILD_ID` when set, else `git describe --always --tags --dirty` of the source tree."""
    env = os.environ.get("NINFER_BUILD_ID")
    if env:
        return env
    try:
        out = subprocess.run(
            ["git", "describe", "--always", "--tags", "--dirty"],
            cwd=_PKG.parent, capture_output=True, text=True, timeout=5,
        )
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    described = out.stdout.strip()
    return described if out.returncode == 0 and described else "unknown"


def version_string() -> str:
    return f"{__version__}+{build_id()}"
