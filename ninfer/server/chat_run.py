"""The one chat path: a decoded `ChatRequest` is rendered once, submitted, and its events run
through one generation loop into protocol-neutral pieces (chat_output.py), which the protocol's
`ChatEncoder` writes as chunks, events or one final object.

    decoder (protocol) -> ChatRequest -> prepare (render, grammar) -> PreparedRequest
        -> Generation (engine events) -> ChatOutput (pieces) -> ChatEncoder (protocol)
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import replace
from typing import Any


from ninfer.engine.chat import Rendered, render
from ninfer.engine.reasoning import CLOSE, EARLY_CLOSE_GUIDANCE, OPEN, ReasoningSpec
from ninfer.engine.request import OutputEvent, PreparedRequest
from ninfer.errors import RequestError
from ninfer.server.chat_output import ChatOutput, ChatResult, Piece
from ninfer.server.chat_request import ChatRequest
from ninfer.server.errors import CLIENT_ERRORS, http_error
from ninfer.server.generate import Generation, new_request_id
from ninfer.server.params import sampling_from
from ninfer.server.http import Call
from ninfer.server.sse import TIMEOUT
from ninfer.server.state import ServerState
from ninfer.server.structured import constrain, with_instruction
from ninfer.server.tools import forced_grammar


def template_kwargs(state: ServerState, chat: ChatRequest) -> dict[str, Any]:
    """The request's template kwargs over the server defaults (--no-thinking, --preserve-thinking,
    --default-reasoning-effort). A structured response or a forced tool call that does not ask for
    thinking runs without it. The default effort yields to everything the request decides: its own
    effort, thinking it disables, a forced call, an assistant prefill."""
    kwargs = dict(chat.template_kwargs)
    if chat.tool_choice.mode == "required" and kwargs.get("enable_thinking") is True:
        raise RequestError("tool_choice: a forced tool call starts the answer, so it cannot follow reasoning the "
                           "request enables; disable thinking or use tool_choice auto", param="tool_choice",
                           code="tool_choice_not_supported")
    if state.config.preserve_thinking:
        kwargs.setdefault("preserve_thinking", True)
    structured = chat.response_format is not None and chat.thinking_budget is None
    if state.config.no_thinking or structured or chat.tool_choice.mode == "required":
        if chat.tool_choice.mode == "required":
            kwargs.pop("reasoning_effort", None)  # a server default effort yields to a forced call
        kwargs.setdefault("enable_thinking", False)
    default = state.config.default_reasoning_effort
    if (default is not None and chat.requested_effort is None and "reasoning_effort" not in kwargs
            and kwargs.get("enable_thinking") is not False and chat.tool_choice.mode != "required"
            and chat.prefill is None):
        if default != "none":
            kwargs["reasoning_effort"] = default
        elif "enable_thinking" not in kwargs:
            kwargs["enable_thinking"] = False
    return kwargs


def reasoning_spec(state: ServerState, chat: ChatRequest, thinking: bool, opens: bool) -> ReasoningSpec:
    """The split, the thinking budget and the post-thinking sampler of a request."""
    spec = ReasoningSpec(starts_open=opens)
    if not thinking:
        return spec
    tok = state.loaded.tokenizer
    budget = chat.thinking_budget or state.config.default_thinking_budget
    if budget is not None:
        message = state.config.thinking_budget_message or EARLY_CLOSE_GUIDANCE
        if CLOSE not in message:
            message += CLOSE
        spec.budget = budget
        spec.close_ids = tok.encode(message + "\n\n", parse_special=False)
    fields = chat.post_thinking if chat.post_thinking is not None else state.config.post_thinking
    if fields is not None:
        preset = replace(state.base_sampling, temperature=0.2, logprobs=chat.sampling.logprobs,
                         top_logprobs=chat.sampling.top_logprobs, seed=chat.sampling.seed)
        flags = state.config.post_thinking or {}
        spec.post_thinking = sampling_from({**flags, **fields}, preset, greedy=state.config.sampler.greedy,
                                           logprobs=chat.sampling.logprobs, top_logprobs=chat.sampling.top_logprobs)
    return spec


def render_chat(state: ServerState, chat: ChatRequest,
                add_generation_prompt: bool = True) -> tuple[Rendered, dict[str, Any]]:
    """The request's prompt (and the template kwargs it was rendered with). Without the generation
    prompt (/apply-template's add_generation_prompt false) the prompt ends after the last turn."""
    kwargs = template_kwargs(state, chat)
    rendered = render(state.loaded.tokenizer, with_instruction(chat.messages, chat.response_format), tools=chat.tools,
                      kwargs=kwargs, prefill=chat.prefill, add_generation_prompt=add_generation_prompt)
    return rendered, kwargs


def prepare(state: ServerState, chat: ChatRequest, request_id: str, generate: bool = True) -> PreparedRequest:
    """Render the conversation and build what the engine runs. Raises client errors. A token
    count (generate=False) builds no grammar."""
    loaded = state.loaded
    assert loaded is not None
    grammar = constrain(state, chat.response_format) if generate else None
    if chat.tool_choice.mode == "required" and generate:  # the call always parses, its arguments fit the schema
        grammar = forced_grammar(state, chat.tools, chat.tool_choice)
    rendered, kwargs = render_chat(state, chat)
    if not rendered.ids:
        raise RequestError("the rendered prompt is empty", param="messages", code="invalid_prompt")
    template = loaded.tokenizer.chat_template or ""
    if chat.prefill is not None and OPEN in template and kwargs.get("enable_thinking") is not False:
        raise RequestError("an assistant prefill continues the answer, so thinking must be disabled explicitly "
                           "(enable_thinking false, thinking disabled or reasoning effort none)", param="messages",
                           code="assistant_prefill_not_supported")
    thinking = rendered.opens_reasoning or (kwargs.get("enable_thinking") is not False and OPEN in template)
    # timings_per_token and return_progress shape a stream only: the engine does the work only then
    hints: dict[str, Any] = {"protocol": chat.protocol, "timings_per_token": chat.stream and chat.timings_per_token,
                             "return_progress": chat.stream and chat.return_progress, "thinking": thinking,
                             "requested_reasoning_effort": chat.requested_effort}
    return PreparedRequest(request_id=request_id, prompt_token_ids=rendered.ids, sampling=chat.sampling,
                           max_tokens=chat.max_tokens, stop=list(chat.stop), ignore_eos=chat.ignore_eos,
                           grammar=grammar, hints=hints,
                           reasoning=reasoning_spec(state, chat, thinking, rendered.opens_reasoning))


class ChatEncoder:
    """A protocol's output side. The loop calls `respond` once (aggregate) or, streaming,
    `keepalive`/`progress`/`piece` as things happen, then `finish` or `fail`. `open` is the
    encoder's to call: a protocol decides which event starts its stream."""

    def __init__(self, call: Call, chat: ChatRequest) -> None:
        self.call = call
        self.chat = chat
        self.req: PreparedRequest | None = None  # set once prepared
        self.created = 0

    async def respond(self, result: ChatResult) -> None:
        raise NotImplementedError

    async def keepalive(self) -> None:
        raise NotImplementedError

    async def progress(self, event: OutputEvent) -> None:
        """A prompt-progress event (only when the request asked for them)."""

    async def piece(self, piece: Piece) -> None:
        raise NotImplementedError

    async def finish(self, result: ChatResult) -> None:
        raise NotImplementedError

    async def fail(self, err: RequestError) -> None:
        """An error after the stream started, in the protocol's own stream envelope."""
        raise NotImplementedError


Decode = Callable[[str], tuple[ChatRequest, ChatEncoder]]


async def run_chat(call: Call, protocol: str, decode: Decode) -> None:
    """Decode (given the request id), prepare, generate, encode: every chat protocol's handler.
    Errors before generation count as rejections of `protocol` and propagate to the envelope."""
    state = call.state
    request_id = new_request_id()
    try:
        chat, encoder = decode(request_id)
        req = await asyncio.to_thread(prepare, state, chat, request_id)
    except CLIENT_ERRORS as e:
        err = http_error(e)
        state.reject(protocol, err)
        raise err
    encoder.req = req
    out = ChatOutput(chat.callable_tools, chat.parallel_tool_calls, stream=chat.stream)
    async with Generation(call, req, chat.stream, observe=out.feed, result_fields=out.log_fields) as gen:
        encoder.created = gen.created
        if not chat.stream:
            async for event in gen.events(None):
                assert isinstance(event, OutputEvent)
            await encoder.respond(out.result)
            return
        try:
            async for event in gen.events(state.config.keepalive_seconds):
                if event is TIMEOUT:
                    await encoder.keepalive()
                    continue
                assert isinstance(event, OutputEvent)
                if event.progress is not None:
                    await encoder.progress(event)
                    continue
                for piece in gen.observed:  # out.feed(event), run before the event was logged
                    await encoder.piece(piece)
                if event.finish_reason is not None:
                    await encoder.finish(out.result)
        except CLIENT_ERRORS as e:
            if not call.started:
                raise
            await encoder.fail(http_error(e))
        await call.end()
