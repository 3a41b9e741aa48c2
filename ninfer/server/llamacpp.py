"""llama.cpp's native endpoints: POST /completion (/completions), /tokenize, /detokenize."""
from __future__ import annotations

from typing import Any

from ninfer.engine.request import OutputEvent, PreparedRequest
from ninfer.server.errors import CLIENT_ERRORS, http_error
from ninfer.server.generate import Generation, new_request_id, prompt_progress, request_params
from ninfer.server.http import Call
from ninfer.server.params import bad, check_id_slot, check_model, opt_bool, opt_int
from ninfer.server.raw_prompt import prepare_raw
from ninfer.server.sse import KEEPALIVE, TIMEOUT, sse_data


def _n_predict(body: dict[str, Any]) -> int | None:
    """n_predict, then max_tokens; any negative value means the default output limit."""
    for name in ("n_predict", "max_tokens"):
        value = opt_int(body, name)
        if value is not None:
            return None if value < 0 else value
    return None


def _stop_type(event: OutputEvent) -> tuple[str, str]:
    """llama.cpp's stop_type and stopping_word for a final event."""
    if event.finish_reason == "stop":
        if isinstance(event.stop_reason, str):
            return "word", event.stop_reason
        return "eos", ""
    if event.finish_reason == "length":
        return "limit", ""
    return "none", ""


def _response_fields(body: dict[str, Any]) -> list[str] | None:
    fields = body.get("response_fields")
    if fields is None:
        return None
    if not isinstance(fields, list) or not all(isinstance(f, str) for f in fields):
        raise bad("response_fields", "response_fields must be an array of strings")
    return fields


def _select(obj: dict[str, Any], fields: list[str]) -> dict[str, Any]:
    """Keep only the named fields; "a/b" names a nested one and is reported under that path."""
    out: dict[str, Any] = {}
    for path in fields:
        node: Any = obj
        for key in path.split("/"):
            if not isinstance(node, dict) or key not in node:
                break
            node = node[key]
        else:
            out[path] = node
    return out


def _settings(call: Call, req: PreparedRequest, stream: bool) -> dict[str, Any]:
    return {**request_params(req), "stream": stream, "cache_prompt": req.cache_prompt,
            "n_ctx": call.state.loaded.max_context, "model": call.state.model_id}


def _final_object(call: Call, req: PreparedRequest, final: OutputEvent, content: str, token_ids: list[int],
                  prompt_text: str, stream: bool, return_tokens: bool) -> dict[str, Any]:
    stop_type, word = _stop_type(final)
    usage = final.usage
    obj: dict[str, Any] = {
        "index": 0,
        "content": content,
        "stop": True,
        "model": call.state.model_id,
        "tokens_predicted": usage.completion_tokens if usage else len(token_ids),
        "tokens_evaluated": usage.prompt_tokens if usage else len(req.prompt_token_ids),
        "generation_settings": _settings(call, req, stream),
        "prompt": prompt_text,
        "has_new_line": "\n" in content,
        "truncated": False,
        "stop_type": stop_type,
        "stopping_word": word,
        "tokens_cached": usage.cached_tokens if usage else 0,
    }
    # llama-server always has the array ([] unless asked); the last streamed object carries every id (spec)
    obj["tokens"] = token_ids if return_tokens or stream else []
    # llama.cpp always names a slot; -1 (its "any slot") when the context cache retained nothing
    obj["id_slot"] = final.slot_id if final.slot_id is not None else -1
    if final.timings is not None:
        obj["timings"] = final.timings.to_dict()
    return obj


async def handle_completion(call: Call) -> None:
    await run_completion(call, call.json())


async def run_completion(call: Call, body: dict[str, Any]) -> None:
    """A llama.cpp completion of `body` (its prompt already in place: /completion, /infill)."""
    state = call.state
    rid = new_request_id()
    try:
        check_model(body, state)
        max_tokens = _n_predict(body)
        return_tokens = bool(opt_bool(body, "return_tokens"))
        return_progress = bool(opt_bool(body, "return_progress"))
        check_id_slot(body, state.loaded.engine.snapshot().max_private_continuations)
        fields = _response_fields(body)
        req, opts = prepare_raw(body, state, rid, max_tokens, "completion")
        req.hints["return_progress"] = return_progress and opts.stream  # progress shapes a stream only
    except CLIENT_ERRORS as e:
        err = http_error(e)
        state.reject("completion", err)
        raise err
    tok = state.loaded.tokenizer
    prompt_text = tok.decode(req.prompt_token_ids, skip_special_tokens=False)

    def shape(obj: dict[str, Any]) -> dict[str, Any]:
        return _select(obj, fields) if fields is not None else obj

    async with Generation(call, req, opts.stream) as gen:
        if not opts.stream:
            out = await gen.collect()
            obj = _final_object(call, req, out.final, out.text, out.token_ids, prompt_text, False, return_tokens)
            await call.respond(200, shape(obj))
            return
        token_ids: list[int] = []
        unsent: list[int] = []
        predicted = 0
        try:
            async for event in gen.events(state.config.keepalive_seconds):
                if not call.started:
                    await call.start_stream()
                if event is TIMEOUT:
                    await call.write(KEEPALIVE)
                    continue
                piece = prompt_progress(event, opts.timings_per_token)
                if piece is not None:  # the engine sends these only when return_progress asked
                    await call.write(sse_data({"index": 0, "content": "", "stop": False, **piece}))
                    continue
                token_ids.extend(event.token_ids)
                unsent.extend(event.token_ids)  # ids whose text is held back (partial UTF-8, a stop prefix)
                predicted += len(event.token_ids)
                if event.text:  # the last piece of text may arrive with the final event
                    data: dict[str, Any] = {"index": 0, "content": event.text, "stop": False,
                                            "tokens": unsent if return_tokens else [],
                                            "tokens_predicted": predicted}
                    unsent = []
                    if opts.timings_per_token and event.timings is not None:
                        data["timings"] = event.timings.to_dict()
                    await call.write(sse_data(data))
                if event.finish_reason is not None:
                    obj = _final_object(call, req, event, "", token_ids, prompt_text, True, return_tokens)
                    await call.write(sse_data(shape(obj)))
        except CLIENT_ERRORS as e:
            if not call.started:
                raise
            e = http_error(e)
            await call.write(sse_data({"error": {"message": e.message, "type": e.type, "code": e.code}}))
        await call.end()


async def handle_tokenize(call: Call) -> None:
    body = call.json()
    tok = call.state.loaded.tokenizer
    content = body.get("content")
    if not isinstance(content, str):
        raise bad("content", "content must be a string")
    parse_special = opt_bool(body, "parse_special")
    add_special = opt_bool(body, "add_special") or False
    with_pieces = opt_bool(body, "with_pieces") or False
    ids = tok.encode(content, add_special_tokens=add_special, parse_special=parse_special is not False)
    if not with_pieces:
        await call.respond(200, {"tokens": ids})
        return
    pieces = []
    for tid in ids:
        raw = tok.token_bytes(tid)
        try:
            piece: Any = raw.decode("utf-8")
        except UnicodeDecodeError:
            piece = list(raw)
        pieces.append({"id": tid, "piece": piece})
    await call.respond(200, {"tokens": pieces})


async def handle_detokenize(call: Call) -> None:
    body = call.json()
    tok = call.state.loaded.tokenizer
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise bad("tokens", "tokens must be an array of token ids")
    vocab = tok.vocab_size
    for t in tokens:
        if not 0 <= t < vocab:
            raise bad("tokens", f"token id {t} is out of range (vocabulary size {vocab})")
    await call.respond(200, {"content": tok.decode(tokens, skip_special_tokens=False)})
