"""The engine's typed errors. Each says what went wrong in the engine's terms (token counts,
limits, the request field at fault) and carries no HTTP facts: the server maps every class to a
status, an error type and a code at its edge (ninfer/server/errors.py); the CLI turns them into
messages. They live here, not in ninfer/errors.py, because the engine owns them: ninfer/errors.py
keeps the errors every layer shares (config, artifact, model lookup) and the server's RequestError.
"""
from __future__ import annotations

from ninfer.errors import NInferError


class EngineError(NInferError):
    """Base of the errors the engine raises about a request or about its own state."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InvalidRequest(EngineError):
    """A request the engine cannot run as given. `field` names the input at fault as the request
    spelled it ("prompt", "top_p", "messages", "response_format.json_schema.schema"), or None."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class ContextLengthExceeded(InvalidRequest):
    """The prompt leaves no room in the context for one output token."""

    def __init__(self, prompt_tokens: int, limit: int) -> None:
        super().__init__(f"the prompt has {prompt_tokens} tokens, but the context holds {limit} "
                         "(prompt plus at least one output token)", field="prompt")
        self.prompt_tokens = prompt_tokens
        self.limit = limit


class DuplicateRequest(InvalidRequest):
    """A request id that is already in flight."""

    def __init__(self, request_id: str) -> None:
        super().__init__(f"request id {request_id!r} is already in flight", field="request_id")
        self.request_id = request_id


class TemplateError(InvalidRequest):
    """The chat template is missing, does not compile, or raised on these messages."""


class TokenOutOfRange(InvalidRequest):
    """A token id outside the vocabulary."""

    def __init__(self, token_id: int, vocab_size: int) -> None:
        super().__init__(f"token id {token_id} is out of range (vocabulary size {vocab_size})", field="token")
        self.token_id = token_id
        self.vocab_size = vocab_size


class SchemaError(InvalidRequest):
    """A JSON Schema that is not an object, or that the grammar compiler cannot enforce."""


class GrammarError(InvalidRequest):
    """A GBNF grammar the grammar compiler cannot read."""


class EngineOverloaded(EngineError):
    """Every lane and every pending place is taken; `capacity` is their number."""

    def __init__(self, capacity: int) -> None:
        super().__init__("the server is at capacity; retry shortly")
        self.capacity = capacity


class EngineNotRunning(EngineError):
    """The engine was shut down, or its worker failed (`reason` says how, when it did)."""

    def __init__(self, reason: str | None = None) -> None:
        super().__init__("the engine is not running" + (f" ({reason})" if reason else ""))
        self.reason = reason


class EngineBusy(EngineError):
    """A suspend asked while requests are queued, admitted or running (a suspend never cancels work)."""

    def __init__(self, what: str) -> None:
        super().__init__(f"the model is busy ({what}); suspend it once it is idle")


class EngineSuspended(EngineError):
    """A request submitted while the model is suspended (resume it first)."""

    def __init__(self) -> None:
        super().__init__("the model is suspended; resume it first")


class SuspendNotSupported(EngineError):
    """This runner cannot give its memory back (say which and why)."""
