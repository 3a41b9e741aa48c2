"""Where ninfer keeps converted models and compiled kernels."""
from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """`$NINFER_CACHE`, else `$XDG_CACHE_HOME/ninfer`, else `~/.cache/ninfer`."""
    env = os.environ.get("NINFER_CACHE")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "ninfer"
