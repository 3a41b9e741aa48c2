"""POST /v1/completions: OpenAI's legacy text completion of a raw prompt."""
from __future__ import annotations

from typing import Any

from ninfer.errors import RequestError
from ninfer.server.errors import CLIENT_ERRORS, http_error
from ninfer.server.generate import Generation, new_request_id, system_fingerprint, usage_dict
from ninfer.server.http import Call
from ninfer.server.params import check_model, opt_bool, opt_int, unsupported
from ninfer.server.raw_prompt import RawOptions, prepare_raw
from ninfer.server.sse import DONE, KEEPALIVE, TIMEOUT, sse_data, sse_error


def _check_openai_only(body: dict[str, Any]) -> None:
    for name, neutral in (("n", 1), ("best_of", 1)):
        value = opt_int(body, name)
        if value is not None and value != neutral:
            raise unsupported(name, f"{name} is supported only at {neutral}: one request produces one completion")
    logprobs = body.get("logprobs")
    if logprobs is not None and logprobs is not False:
        value = opt_int(body, "logprobs", lo=0)
        if value:
            raise unsupported("logprobs", "logprobs is supported only at 0 on /v1/completions")
    suffix = body.get("suffix")
    if suffix is not None and not isinstance(suffix, str):
        raise RequestError("suffix must be a string", param="suffix", code="invalid_value")
    if suffix:
        raise unsupported("suffix", "suffix (fill-in-the-middle) is not supported")


async def handle_completions(call: Call) -> None:
    body = call.json()
    state = call.state
    rid = new_request_id()
    try:
        check_model(body, state)
        _check_openai_only(body)
        max_tokens = opt_int(body, "max_tokens", lo=-1)
        echo = opt_bool(body, "echo") or False
        req, opts = prepare_raw(body, state, rid, None if max_tokens == -1 else max_tokens, "completions")
    except CLIENT_ERRORS as e:
        err = http_error(e)
        state.reject("completions", err)
        raise err
    prompt_text = state.loaded.tokenizer.decode(req.prompt_token_ids, skip_special_tokens=False) if echo else ""
    async with Generation(call, req, opts.stream) as gen:
        base = {"id": f"cmpl-{rid}", "object": "text_completion", "created": gen.created,
                "model": state.model_id, "system_fingerprint": system_fingerprint()}
        if not opts.stream:
            out = await gen.collect()
            final = out.final
            payload = {**base, "choices": [{"text": prompt_text + out.text, "index": 0, "logprobs": None,
                                            "finish_reason": final.finish_reason}],
                       "usage": usage_dict(final.usage)}
            if final.timings is not None:
                payload["timings"] = final.timings.to_dict()
            await call.respond(200, payload)
            return
        await _stream(call, gen, base, prompt_text, opts)


async def _stream(call: Call, gen: Generation, base: dict[str, Any], echo_text: str, opts: RawOptions) -> None:
    state = call.state

    def chunk(text: str, finish: str | None = None) -> dict[str, Any]:
        return {**base, "choices": [{"text": text, "index": 0, "logprobs": None, "finish_reason": finish}]}

    async def open_stream() -> None:
        await call.start_stream()
        if echo_text:
            await call.write(sse_data(chunk(echo_text)))

    try:
        async for event in gen.events(state.config.keepalive_seconds):
            if not call.started:
                await open_stream()
            if event is TIMEOUT:
                await call.write(KEEPALIVE)
                continue
            if event.text:
                data = chunk(event.text)
                if opts.timings_per_token and event.timings is not None:
                    data["timings"] = event.timings.to_dict()
                await call.write(sse_data(data))
            if event.finish_reason is not None:
                timings = {"timings": event.timings.to_dict()} if event.timings is not None else {}
                if opts.include_usage:
                    await call.write(sse_data(chunk("", event.finish_reason)))
                    await call.write(sse_data({**base, "choices": [], "usage": usage_dict(event.usage), **timings}))
                else:
                    await call.write(sse_data({**chunk("", event.finish_reason), **timings}))
                await call.write(DONE)
    except CLIENT_ERRORS as e:
        if not call.started:
            raise
        await call.write(sse_error(http_error(e)))
    await call.end()
