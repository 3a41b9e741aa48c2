"""ninfer: a local LLM inference server and toolkit."""
from __future__ import annotations

__all__ = ["__version__", "version_string"]


def __getattr__(name: str):
    # imported on first use: the command line installs its signal handling before any import
    if name in __all__:
        from ninfer import version

        return getattr(version, name)
    raise AttributeError(f"module 'ninfer' has no attribute {name!r}")
