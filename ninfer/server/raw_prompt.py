"""The raw-prompt side shared by /v1/completions and /completion: the prompt (string, token ids,
or both mixed; one prompt per request) and the sampler/stop/budget fields both accept."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ninfer.engine.request import PreparedRequest
from ninfer.errors import RequestError
from ninfer.server.params import bad, check_llamacpp_neutral, opt_bool, opt_object, parse_stop, sampling_from
from ninfer.server.state import ServerState
from ninfer.server.structured import constrain, refuse_with_grammar, request_format

MAX_RAW_STOPS = 32


def _multiple() -> RequestError:
    return RequestError("several prompts in one request are not supported: send one prompt per request",
                        param="prompt", code="multiple_prompts_not_supported")


def _is_token(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def prompt_token_ids(value: Any, state: ServerState) -> list[int]:
    """A string, an array of token ids, a mixed array of ids and strings, or a one-element array
    of any of those. Special-token text in a string encodes as that token."""
    tok = state.loaded.tokenizer
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
        value = value[0]
    if isinstance(value, str):
        parts: list[Any] = [value]
    elif isinstance(value, list):
        if not value:
            raise bad("prompt", "the prompt is empty", code="invalid_prompt")
        has_str = any(isinstance(x, str) for x in value)
        has_tok = any(_is_token(x) for x in value)
        if any(isinstance(x, list) for x in value) or (has_str and not has_tok):
            raise _multiple()
        if not all(isinstance(x, str) or _is_token(x) for x in value):
            raise bad("prompt", "prompt arrays hold token ids and strings only", code="invalid_prompt")
        parts = value
    elif value is None:
        raise bad("prompt", "prompt is required", code="missing_required_parameter")
    else:
        raise bad("prompt", "prompt must be a string, an array of token ids, or both mixed")
    ids: list[int] = []
    vocab = tok.vocab_size
    for part in parts:
        if isinstance(part, str):
            ids.extend(tok.encode(part, add_special_tokens=False))
        else:
            if not 0 <= part < vocab:
                raise bad("prompt", f"token id {part} is out of range (vocabulary size {vocab})",
                          code="invalid_prompt")
            ids.append(part)
    if isinstance(parts[0], str) and tok.add_bos_token and tok.bos_token_id is not None \
            and (not ids or ids[0] != tok.bos_token_id):
        ids.insert(0, tok.bos_token_id)
    if not ids:
        raise bad("prompt", "the prompt is empty", code="invalid_prompt")
    return ids


@dataclass(slots=True)
class RawOptions:
    stream: bool
    include_usage: bool
    timings_per_token: bool


def prepare_raw(body: dict[str, Any], state: ServerState, request_id: str, max_tokens: int | None,
                protocol: str) -> tuple[PreparedRequest, RawOptions]:
    """The PreparedRequest for a raw prompt: sampler, stops, ignore_eos, cache_prompt."""
    check_llamacpp_neutral(body)
    fmt = request_format(body)
    grammar = constrain(state, fmt)
    ids = prompt_token_ids(body.get("prompt"), state)
    stop = parse_stop(body.get("stop"), MAX_RAW_STOPS)
    ignore_eos = opt_bool(body, "ignore_eos") or False
    if grammar is not None:
        refuse_with_grammar(stop, ignore_eos, fmt)
    stream = opt_bool(body, "stream") or False
    stream_options = opt_object(body, "stream_options") or {}
    include_usage = stream_options.get("include_usage", False)
    if not isinstance(include_usage, bool):
        raise bad("stream_options.include_usage", "stream_options.include_usage must be a boolean")
    cache_prompt = opt_bool(body, "cache_prompt")
    sampling = sampling_from(body, state.base_sampling, greedy=state.config.sampler.greedy,
                             negative_top_k_widest=True)
    tpt = bool(opt_bool(body, "timings_per_token")) and stream  # it shapes a stream only
    req = PreparedRequest(request_id=request_id, prompt_token_ids=ids, sampling=sampling,
                          max_tokens=max_tokens, stop=stop, ignore_eos=ignore_eos, grammar=grammar,
                          cache_prompt=True if cache_prompt is None else cache_prompt, raw_prompt=True,
                          hints={"protocol": protocol, "timings_per_token": tpt,
                                 "skip_special_tokens": True})
    return req, RawOptions(stream=stream, include_usage=include_usage, timings_per_token=tpt)
