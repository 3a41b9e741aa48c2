"""Field validation shared by the protocol adapters: typed getters that raise field-specific 400s,
stops, the model check and the sampler merge (preset < process flags < request < --greedy)."""
from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from ninfer.engine.request import MAX_TOP_LOGPROBS, SamplingParams
from ninfer.errors import RequestError
from ninfer.server.state import ServerState

_MISSING = object()
MAX_SEED = 2**63 - 1


def bad(param: str, message: str, code: str = "invalid_value") -> RequestError:
    return RequestError(message, param=param, code=code)


def unsupported(param: str, message: str) -> RequestError:
    return RequestError(message, param=param, code=f"{param.split('.')[0]}_not_supported")


def opt_bool(body: dict[str, Any], name: str) -> bool | None:
    value = body.get(name)
    if value is not None and not isinstance(value, bool):
        raise bad(name, f"{name} must be a boolean")
    return value


def opt_int(body: dict[str, Any], name: str, lo: int | None = None, hi: int | None = None,
            param: str | None = None) -> int | None:
    value = body.get(name)
    param = param or name
    if value is None:
        return None
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad(param, f"{param} must be an integer")
    if lo is not None and value < lo:
        raise bad(param, f"{param} must be >= {lo}")
    if hi is not None and value > hi:
        raise bad(param, f"{param} must be <= {hi}")
    return value


def check_id_slot(body: dict[str, Any], num_slots: int) -> None:
    """llama.cpp's id_slot: -1 (any slot, its default) or a context-cache slot 0..num_slots-1.
    A valid one is accepted without effect (spec): the prefix cache already picks the cell
    sharing the longest prefix, which is what pinning a slot is for."""
    value = opt_int(body, "id_slot", lo=-1)
    if value is None or value < num_slots:
        return
    valid = f"ids 0..{num_slots - 1}, or -1 for any" if num_slots else "it retains no sessions: use -1"
    raise bad("id_slot", f"id_slot {value} names no slot of this server ({valid})", code="invalid_slot")


def opt_number(body: dict[str, Any], name: str, lo: float | None = None,
               hi: float | None = None) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise bad(name, f"{name} must be a finite number")
    if lo is not None and value < lo:
        raise bad(name, f"{name} must be >= {lo}")
    if hi is not None and value > hi:
        raise bad(name, f"{name} must be <= {hi}")
    return float(value)


def opt_object(body: dict[str, Any], name: str) -> dict[str, Any] | None:
    value = body.get(name)
    if value is not None and not isinstance(value, dict):
        raise bad(name, f"{name} must be an object")
    return value


def parse_stop(value: Any, max_n: int, param: str = "stop") -> list[str]:
    """A string or a list of up to `max_n` non-empty strings."""
    if value is None:
        return []
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise bad(param, f"{param} must be a string or an array of strings")
    if len(value) > max_n:
        raise bad(param, f"{param} accepts at most {max_n} strings")
    if any(not s for s in value):
        raise bad(param, f"{param} strings must be non-empty")
    return list(dict.fromkeys(value))


def check_model(body: dict[str, Any], state: ServerState, *, required: bool = False) -> None:
    """A missing, null or empty model is the loaded one; any other name goes through the server's
    model resolution (state.resolve_model: on a router the pool has already resolved it to this model)."""
    model = body.get("model")
    if model is None or model == "":
        if required:
            raise bad("model", "model is required", code="missing_required_parameter")
        return
    if not isinstance(model, str):
        raise bad("model", "model must be a string")
    state.resolve_model(model)


def check_logit_bias(value: Any, param: str = "logit_bias") -> None:
    """All-zero logit_bias is neutral; anything else asks for behaviour the sampler lacks."""
    if value is None:
        return
    if isinstance(value, dict):
        biases = list(value.values())
    elif isinstance(value, list):  # llama.cpp's [[token, bias], ...]
        biases = []
        for pair in value:
            if not isinstance(pair, list) or len(pair) != 2:
                raise bad(param, f"{param} pairs must be [token, bias]")
            biases.append(pair[1])
    else:
        raise bad(param, f"{param} must be an object of token -> bias")
    for b in biases:
        if isinstance(b, bool) or not isinstance(b, (int, float)):
            if b is False:  # llama.cpp: false bans the token
                raise unsupported(param, "logit_bias is not supported: the sampler cannot bias tokens")
            raise bad(param, f"{param} values must be numbers")
        if b != 0:
            raise unsupported(param, "logit_bias is not supported: the sampler cannot bias tokens "
                                     "(only all-zero biases are accepted)")


def sampling_from(body: dict[str, Any], base: SamplingParams, *, greedy: bool,
                  logprobs: bool = False, top_logprobs: int = 0,
                  negative_temperature_greedy: bool = True, negative_top_k_widest: bool = False,
                  max_temperature: float = 100.0) -> SamplingParams:
    """Request sampler fields over the process base (preset + flags); --greedy wins at the end.
    The protocols differ only where the spec says so: a negative temperature samples greedily and
    a top_k of zero or below is the widest set on the raw-prompt routes (llama.cpp's reading); Chat,
    Responses and Messages take a non-negative top_k, Responses a temperature in [0, 2], Messages
    one in [0, 1]."""
    temperature = opt_number(body, "temperature", lo=None if negative_temperature_greedy else 0.0)
    top_p = opt_number(body, "top_p", 0.0, 1.0)
    min_p = opt_number(body, "min_p", 0.0, 1.0)
    presence = opt_number(body, "presence_penalty", -2.0, 2.0)
    frequency = opt_number(body, "frequency_penalty", -2.0, 2.0)
    top_k = body.get("top_k")
    if top_k is not None:
        if isinstance(top_k, float) and top_k.is_integer() and abs(top_k) < 2**53:
            top_k = int(top_k)
        if isinstance(top_k, bool) or not isinstance(top_k, int):
            raise bad("top_k", "top_k must be an integer")
        if top_k < 0 and not negative_top_k_widest:
            raise bad("top_k", "top_k must be >= 0 (a value above 20 is clamped to 20)")
        top_k = max(min(top_k, 2**31), -1)  # <= 0: the widest set; > 20: clamped by SamplingParams
    seed = opt_int(body, "seed", lo=-MAX_SEED - 1, hi=2**64 - 1)
    if seed is not None and seed > MAX_SEED:
        seed = seed & MAX_SEED  # unsigned 64-bit seeds (llama.cpp's 4294967295 etc.) fold into range
    if temperature is not None and temperature < 0:
        temperature = 0.0
    if temperature is not None and temperature > max_temperature:
        raise bad("temperature", f"temperature must be <= {max_temperature:g}")
    params = SamplingParams(
        temperature=base.temperature if temperature is None else temperature,
        top_k=base.top_k if top_k is None else top_k,
        top_p=base.top_p if top_p is None else top_p,
        min_p=base.min_p if min_p is None else min_p,
        presence_penalty=base.presence_penalty if presence is None else presence,
        frequency_penalty=base.frequency_penalty if frequency is None else frequency,
        seed=base.seed if seed is None else seed,
        logprobs=logprobs,
        top_logprobs=top_logprobs,
    )
    if greedy:
        params.temperature = 0.0
    return params


def parse_logprobs(body: dict[str, Any]) -> tuple[bool, int]:
    """Chat's logprobs (bool) and top_logprobs (0..20, needs logprobs: true)."""
    logprobs = bool(opt_bool(body, "logprobs"))
    top = opt_int(body, "top_logprobs", 0, MAX_TOP_LOGPROBS) or 0
    if top and not logprobs:
        raise bad("top_logprobs", "top_logprobs needs logprobs: true")
    return logprobs, top


def reject_present(body: dict[str, Any], names: tuple[str, ...], why: str) -> None:
    """Refuse fields that ask for behaviour the engine cannot provide, when set to a non-empty value."""
    for name in names:
        value = body.get(name, _MISSING)
        if value is _MISSING or value is None or value == "" or value == [] or value == {}:
            continue
        raise unsupported(name, f"{name} is not supported: {why}")


# llama.cpp sampler controls NInfer lacks: the neutral test for each.
_LLAMACPP_NEUTRAL: dict[str, Any] = {
    "repeat_penalty": lambda v: v == 1,
    "typical_p": lambda v: v == 1,
    "tfs_z": lambda v: v == 1,
    "dynatemp_range": lambda v: v == 0,
    "mirostat": lambda v: v == 0,
    "xtc_probability": lambda v: v == 0,
    "dry_multiplier": lambda v: v == 0,
    "top_n_sigma": lambda v: v <= 0,
    "n_probs": lambda v: v == 0,
    "n_indent": lambda v: v == 0,
    "t_max_predict_ms": lambda v: v <= 0,
}


def check_llamacpp_neutral(body: dict[str, Any]) -> None:
    """llama.cpp controls are accepted only at their neutral values (<field>_not_supported); its
    grammar is a constraint (structured.py)."""
    for name, neutral in _LLAMACPP_NEUTRAL.items():
        if name not in body or body[name] is None:
            continue
        value = body[name]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise bad(name, f"{name} must be a finite number")
        if not neutral(value):
            raise unsupported(name, f"{name} is not supported: this server has no such sampler; "
                                    "only its neutral value is accepted")
    lora = body.get("lora")
    if lora:
        raise unsupported("lora", "lora is not supported: no adapters are loaded")
    check_logit_bias(body.get("logit_bias"))


def join_text_parts(content: Any, where: str, other: Callable[[dict[str, Any], str], str]) -> str:
    """Message content: a string, or an array of content parts joined without separators. A part
    of type "text" gives its `text`; any other part goes to other(part, its path), which returns
    the part's text or raises."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad(where, f"{where} must be a string or an array of content parts")
    pieces = []
    for j, part in enumerate(content):
        p = f"{where}[{j}]"
        if not isinstance(part, dict):
            raise bad(p, f"{p} must be a content part object")
        if part.get("type") == "text":
            text = part.get("text")
            if not isinstance(text, str):
                raise bad(f"{p}.text", f"{p}.text must be a string")
            pieces.append(text)
        else:
            pieces.append(other(part, p))
    return "".join(pieces)


def message_role(message: Any, where: str, roles: tuple[str, ...]) -> str:
    """A message object's role, one of `roles`; a 400 naming the field otherwise."""
    if not isinstance(message, dict):
        raise bad(where, f"{where} must be an object")
    role = message.get("role")
    if role not in roles:
        raise bad(f"{where}.role", f"{where}.role must be one of {', '.join(roles)}")
    return role
