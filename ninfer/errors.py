"""Typed errors. Each carries a one-line message a user can act on; the CLI prints it
without a traceback, the server maps the HTTP-facing ones to the protocol's envelope."""
from __future__ import annotations


class NInferError(Exception):
    """Base of every error ninfer raises on purpose."""


class ConfigError(NInferError):
    """A bad option or config value."""


class ArtifactError(NInferError):
    """A .ninfer file (or a conversion source) that cannot be used."""


class ModelNotFoundError(NInferError):
    """A model argument that names nothing usable."""


class RequestError(NInferError):
    """Invalid client input, with the HTTP status, OpenAI error type, code and param."""

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None,
                 status: int = 400, type: str = "invalid_request_error",
                 extra: dict[str, object] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
        self.status = status
        self.type = type
        self.extra = extra or {}  # further fields of the OpenAI-shaped error object (llama-server's)


class ExitCode:
    """The process exit statuses of every command, decided here and nowhere else: 0 after a
    requested stop or a finished command, 1 when start-up (or the command) fails, 2 when a serving
    engine fails later, 130 when the user interrupts (Ctrl+C or SIGTERM before serving)."""

    OK = 0
    FAILED = 1
    ENGINE_FAILED = 2
    INTERRUPTED = 130
