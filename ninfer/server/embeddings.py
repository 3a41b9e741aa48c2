"""POST /v1/embeddings (and /embeddings): OpenAI's embeddings over the served model. Each input's
final normed hidden states come from the engine's prefill path (PreparedRequest.pooling), pooled
mean, last or cls (llama-server's `pooling`), then normalized (llama-server's `embd_normalize`:
-1 none, 0 max-abs to int16 range, 1 taxicab, 2 euclidean (the default, as OpenAI's are unit
vectors), p > 2 a p-norm; `normalize: false` is -1). The inputs run as one batch of engine requests
(fanout.py); usage counts their prompt tokens."""
from __future__ import annotations

import base64
from typing import TYPE_CHECKING, Any

from ninfer.engine.request import POOLINGS, PreparedRequest, SamplingParams
from ninfer.errors import RequestError
from ninfer.server.errors import CLIENT_ERRORS, http_error
from ninfer.server.fanout import run_each
from ninfer.server.generate import new_request_id
from ninfer.server.http import Call
from ninfer.server.params import bad, check_model, opt_bool, opt_int
from ninfer.server.raw_prompt import prompt_token_ids
from ninfer.server.state import ServerState

if TYPE_CHECKING:  # the server imports this before the model (and torch) loads
    import torch

MAX_INPUTS = 2048  # OpenAI's bound on one request's inputs


def _is_ids(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(t, int) and not isinstance(t, bool)
                                                          for t in value)


def embedding_inputs(value: Any, state: ServerState) -> list[list[int]]:
    """OpenAI's input: a string, an array of strings, an array of token ids (one input) or an
    array of token-id arrays; each as token ids (a string as a raw prompt: BOS when the model adds one)."""
    if isinstance(value, str) or _is_ids(value):
        items = [value]
    elif isinstance(value, list) and value:
        items = value
    elif value is None:
        raise bad("input", "input is required", code="missing_required_parameter")
    else:
        raise bad("input", "input must be a string, an array of strings, or token ids")
    if len(items) > MAX_INPUTS:
        raise bad("input", f"input holds at most {MAX_INPUTS} items")
    limit = state.loaded.engine.context_limit
    out = []
    for i, item in enumerate(items):
        where = f"input[{i}]" if len(items) > 1 or not isinstance(value, str) else "input"
        if not (isinstance(item, str) or _is_ids(item)):
            raise bad(where, f"{where} must be a string or an array of token ids")
        if isinstance(item, str) and not item:
            raise bad(where, f"{where} is empty")
        try:
            ids = prompt_token_ids(item, state)
        except RequestError as e:
            e.param = where
            raise
        if len(ids) >= limit:
            raise RequestError(f"{where} has {len(ids)} tokens; an input holds at most {limit - 1}", param=where,
                               code="context_length_exceeded", type="exceed_context_size_error",
                               extra={"n_prompt_tokens": len(ids), "n_ctx": limit})
        out.append(ids)
    return out


def normalization(body: dict[str, Any]) -> int:
    """llama-server's embd_normalize (default 2); normalize: false turns it off."""
    if opt_bool(body, "normalize") is False:
        return -1
    value = opt_int(body, "embd_normalize", lo=-1)
    return 2 if value is None else value


def normalize(v: torch.Tensor, norm: int) -> torch.Tensor:
    """llama.cpp's common_embd_normalize."""
    if norm < 0:
        return v
    if norm == 0:
        scale = v.abs().max() / 32760.0
    elif norm == 1:
        scale = v.abs().sum()
    elif norm == 2:
        scale = v.pow(2).sum().sqrt()
    else:
        scale = v.abs().pow(norm).sum().pow(1.0 / norm)
    return v / scale if scale > 0 else v


def _encode(v: torch.Tensor, encoding: str) -> Any:
    if encoding == "base64":  # OpenAI's: little-endian float32 bytes
        return base64.b64encode(v.float().contiguous().numpy().astype("<f4").tobytes()).decode()
    return v.tolist()


async def handle_embeddings(call: Call) -> None:
    body = call.json()
    state = call.state
    rid = new_request_id()
    try:
        check_model(body, state)
        inputs = embedding_inputs(body.get("input"), state)
        encoding = "float" if body.get("encoding_format") is None else body["encoding_format"]
        if encoding not in ("float", "base64"):
            raise bad("encoding_format", "encoding_format must be float or base64")
        hidden = state.loaded.facts.hidden_size
        dimensions = opt_int(body, "dimensions", lo=1)
        if dimensions is not None and dimensions != hidden:
            raise RequestError(f"dimensions: this model's embeddings have {hidden} dimensions and cannot be "
                               "shortened", param="dimensions", code="dimensions_not_supported")
        pooling = "mean" if body.get("pooling") is None else body["pooling"]
        if pooling not in POOLINGS:
            raise bad("pooling", f"pooling must be one of {', '.join(POOLINGS)}", code="pooling_not_supported")
        norm = normalization(body)
        reqs = [PreparedRequest(request_id=f"{rid}-{i}", prompt_token_ids=ids, max_tokens=1,
                                sampling=SamplingParams(temperature=0.0), pooling=pooling,
                                hints={"protocol": "embeddings"})
                for i, ids in enumerate(inputs)]
    except CLIENT_ERRORS as e:
        err = http_error(e)
        state.reject("embeddings", err)
        raise err
    outcomes = await run_each(call, reqs, "embeddings")
    data = [{"object": "embedding", "index": i, "embedding": _encode(normalize(o.final.embedding, norm), encoding)}
            for i, o in enumerate(outcomes)]
    tokens = sum(len(ids) for ids in inputs)
    await call.respond(200, {"object": "list", "data": data, "model": state.model_id,
                             "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})
