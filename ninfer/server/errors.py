"""The HTTP face of errors: the one place where the engine's typed errors become an HTTP status,
an OpenAI error type, a code and a param. A handler catches `CLIENT_ERRORS` and answers with
`http_error(e)`; the server's own RequestErrors (body validation) pass through unchanged.
"""
from __future__ import annotations

import logging

from ninfer.engine.errors import (ContextLengthExceeded, EngineBusy, EngineError, EngineOverloaded,
                                  EngineSuspended, GrammarError, InvalidRequest, SchemaError, SuspendNotSupported)
from ninfer.errors import RequestError

log = logging.getLogger("ninfer.server")

CLIENT_ERRORS = (RequestError, EngineError)  # what a handler answers the client with

# engine error class -> (status, OpenAI error type, code); the most derived class listed wins, so
# DuplicateRequest, TemplateError and TokenOutOfRange answer as InvalidRequest. EngineNotRunning
# and any class not listed answer 500, as any unexpected failure does.
HTTP_FACTS: dict[type[EngineError], tuple[int, str, str | None]] = {
    SchemaError: (400, "invalid_request_error", "invalid_json_schema"),
    GrammarError: (400, "invalid_request_error", "invalid_grammar"),
    InvalidRequest: (400, "invalid_request_error", None),
    EngineOverloaded: (429, "server_error", "server_overloaded"),
    EngineBusy: (409, "invalid_request_error", "model_busy"),
    EngineSuspended: (503, "service_unavailable", "model_suspended"),
    SuspendNotSupported: (400, "invalid_request_error", "suspend_not_supported"),
}


def http_error(err: RequestError | EngineError) -> RequestError:
    """The RequestError to answer for `err`: itself when it is one; else the engine error mapped
    through HTTP_FACTS, its message kept and its `field` as the param."""
    if isinstance(err, RequestError):
        return err
    if isinstance(err, ContextLengthExceeded):  # llama-server's type and counts, the spec's code
        return RequestError(err.message, param=err.field, code="context_length_exceeded", status=400,
                            type="exceed_context_size_error",
                            extra={"n_prompt_tokens": err.prompt_tokens, "n_ctx": err.limit})
    for cls in type(err).__mro__:
        facts = HTTP_FACTS.get(cls)
        if facts is not None:
            status, kind, code = facts
            return RequestError(err.message, param=getattr(err, "field", None), code=code, status=status,
                                type=kind)
    log.error("engine error answered as 500: %s: %s", type(err).__name__, err)
    return RequestError("internal server error", status=500, code="internal_error", type="server_error")
