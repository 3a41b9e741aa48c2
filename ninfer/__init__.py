"""ninfer: a local LLM inference server and toolkit."""
from __future__ import annotations

from ninfer.version import __version__, version_string

__all__ = ["__version__", "version_string"]
