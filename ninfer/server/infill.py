"""POST /infill: llama.cpp's fill-in-the-middle. The prefix, suffix and optional prompt become one
raw prompt in the model's own FIM tokens (prefix-suffix-middle order, as llama.cpp builds it) and
run as a /completion request; a model without FIM tokens is refused with infill_not_supported."""
from __future__ import annotations

from typing import Any

from ninfer.errors import RequestError
from ninfer.server.http import Call
from ninfer.server.llamacpp import run_completion
from ninfer.server.params import bad

# (prefix, suffix, middle) spellings of the FIM families
FIM_TOKENS = (
    ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),  # Qwen2.5-Coder, Qwen3-Coder
    ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),  # StarCoder
    ("<|fim▁begin|>", "<|fim▁hole|>", "<|fim▁end|>"),  # DeepSeek-Coder
    ("<PRE>", "<SUF>", "<MID>"),  # CodeLlama
)


def fim_ids(tokenizer: Any) -> tuple[int, int, int] | None:
    """The model's (prefix, suffix, middle) token ids, or None when it has no FIM tokens."""
    for spellings in FIM_TOKENS:
        ids = [tokenizer.added_token_id(s) for s in spellings]
        if all(i is not None for i in ids):
            return ids[0], ids[1], ids[2]
    return None


def infill_prompt(tokenizer: Any, body: dict[str, Any]) -> list[int]:
    """[FIM_PRE] input_prefix [FIM_SUF] input_suffix [FIM_MID] prompt, as token ids."""
    fim = fim_ids(tokenizer)
    if fim is None:
        raise RequestError("/infill needs a model with fill-in-the-middle tokens; this model has none",
                           code="infill_not_supported")
    texts = {}
    for name in ("input_prefix", "input_suffix", "prompt"):
        value = body.get(name, "")
        if value is None:
            value = ""
        if not isinstance(value, str):
            raise bad(name, f"{name} must be a string")
        texts[name] = value
    if body.get("input_extra"):
        raise RequestError("input_extra (repository context chunks) is not supported", param="input_extra",
                           code="input_extra_not_supported")
    pre, suf, mid = fim

    def enc(text: str) -> list[int]:
        return tokenizer.encode(text, parse_special=False) if text else []

    return [pre, *enc(texts["input_prefix"]), suf, *enc(texts["input_suffix"]), mid, *enc(texts["prompt"])]


async def handle_infill(call: Call) -> None:
    body = call.json()
    try:
        ids = infill_prompt(call.state.loaded.tokenizer, body)
    except RequestError as e:
        call.state.reject("infill", e)
        raise
    rest = {k: v for k, v in body.items() if k not in ("input_prefix", "input_suffix", "input_extra")}
    await run_completion(call, {**rest, "prompt": ids})
