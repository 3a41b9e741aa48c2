"""`ninfer run [MODEL] PROMPT`: one generation, streamed to the terminal."""
from __future__ import annotations

import json
import sys
import uuid
from typing import List, Optional

import typer

from ninfer.cli.common import (BACKEND, DEVICE, DEVICE_PROFILE, DEVICE_PROFILE_PATH, DEVICES, DRAFT_TOKENS, DTYPE,
                               NO_CUDA_GRAPH, SPEC, SPEC_NGRAM_MAX, SPEC_NGRAM_MIN,
                               STAGE_LAYERS, THREADS, prepare_threads, sampling_from_flags, spec_from_flags,
                               split_model_and_text, stderr_log)
from ninfer.errors import ConfigError


def run(
    args: List[str] = typer.Argument(..., metavar="[MODEL] PROMPT", help="Optional model (.ninfer, .gguf or HF folder), then the prompt."),
    max_tokens: Optional[int] = typer.Option(None, "--max-tokens", "-n", help="Output limit (default: the engine's default output limit)."),
    temperature: Optional[float] = typer.Option(None, "--temperature", help="<= 0 is greedy."),
    top_k: Optional[int] = typer.Option(None, "--top-k", help="0 or above 20 means 20."),
    top_p: Optional[float] = typer.Option(None, "--top-p"),
    min_p: Optional[float] = typer.Option(None, "--min-p"),
    presence_penalty: Optional[float] = typer.Option(None, "--presence-penalty"),
    frequency_penalty: Optional[float] = typer.Option(None, "--frequency-penalty"),
    seed: Optional[int] = typer.Option(None, "--seed", help="Same seed, same output."),
    stop: List[str] = typer.Option([], "--stop", help="Stop string (repeatable)."),
    system: Optional[str] = typer.Option(None, "--system", help="System message."),
    raw: bool = typer.Option(False, "--raw", help="Send the prompt as is, without the chat template."),
    reasoning_effort: Optional[str] = typer.Option(
        None, "--reasoning-effort",
        help="Reasoning effort for the template: none (thinking off), minimal, low, medium, high, xhigh or max; "
             "a value the template rejects renders as the nearest one it accepts."),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object: text, token ids, finish reason, timings."),
    json_schema: Optional[str] = typer.Option(None, "--json-schema",
                                              help="Constrain the answer to a JSON Schema (a file or inline JSON; {} for any JSON object)."),
    backend: str = BACKEND,
    device: int = DEVICE,
    devices: Optional[str] = DEVICES,
    stage_layers: Optional[str] = STAGE_LAYERS,
    no_cuda_graph: bool = NO_CUDA_GRAPH,
    dtype: str = DTYPE,
    spec: Optional[str] = SPEC,
    draft_tokens: int = DRAFT_TOKENS,
    spec_ngram_min: int = SPEC_NGRAM_MIN,
    spec_ngram_max: int = SPEC_NGRAM_MAX,
    threads: int = THREADS,
    device_profile: str = DEVICE_PROFILE,
    device_profile_path: Optional[str] = DEVICE_PROFILE_PATH,
) -> None:
    prepare_threads(threads, backend, announce=not json_out)
    from ninfer.engine.chat import EFFORTS, Message, render
    from ninfer.engine.config import SchedulerConfig
    from ninfer.engine.loader import load_engine
    from ninfer.engine.request import PreparedRequest
    from ninfer.kernels.profile import ProfileRequest

    model, prompt = split_model_and_text(args, "PROMPT")
    if not prompt.strip():
        raise ConfigError("the prompt is empty")
    if max_tokens is not None and max_tokens < 1:
        raise ConfigError("--max-tokens must be >= 1")
    if system is not None and raw:
        raise ConfigError("--system applies to the chat template; it cannot be combined with --raw")
    if reasoning_effort is not None and reasoning_effort not in EFFORTS:
        raise ConfigError(f"--reasoning-effort must be one of {', '.join(EFFORTS)}, got {reasoning_effort!r}")
    if reasoning_effort is not None and raw:
        raise ConfigError("--reasoning-effort applies to the chat template; it cannot be combined with --raw")
    flags = dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                 presence_penalty=presence_penalty, frequency_penalty=frequency_penalty, seed=seed)
    sampling_from_flags(**flags)  # bad values fail before the model loads
    schema = _read_schema(json_schema) if json_schema is not None else None
    profile = ProfileRequest.from_flags(device_profile, device_profile_path)
    if schema is not None and stop:
        raise ConfigError("--stop cannot be combined with --json-schema: the grammar ends the output")
    spec_config = spec_from_flags(spec, draft_tokens, spec_ngram_min, spec_ngram_max)
    loaded = load_engine(model, backend=backend, device=device, scheduler=SchedulerConfig(max_concurrency=1),
                         announce=not json_out, cuda_graph=not no_cuda_graph, dtype=dtype, spec=spec_config,
                         threads=threads or None, device_profile=profile, log=stderr_log, devices=devices,
                         stage_layers=stage_layers)
    sampling = sampling_from_flags(**flags, preset=loaded.meta.sampler_presets.get("default"))
    tok = loaded.tokenizer
    try:
        grammar = None
        if schema is not None:
            from ninfer.engine.grammar import JsonGrammars
            from ninfer.engine.errors import SchemaError
            grammars = JsonGrammars(tok, loaded.meta.config.vocab_size)
            try:
                grammar = (grammars.json_schema(schema, "--json-schema", strict=True) if schema
                           else grammars.json_object())
            except SchemaError as e:
                raise ConfigError(e.message) from None
        if raw:
            ids = tok.encode(prompt, add_special_tokens=True)
        else:
            messages = ([Message("system", system)] if system is not None else []) + [Message("user", prompt)]
            kwargs = {} if reasoning_effort is None else (
                {"enable_thinking": False} if reasoning_effort == "none" else {"reasoning_effort": reasoning_effort})
            ids = render(tok, messages, kwargs=kwargs).ids
        req = PreparedRequest(request_id=f"run-{uuid.uuid4().hex[:12]}", prompt_token_ids=ids, sampling=sampling,
                              max_tokens=max_tokens, stop=list(stop), raw_prompt=raw, grammar=grammar)
        text, token_ids, final = [], [], None
        for event in loaded.engine.submit(req):
            token_ids.extend(event.token_ids)
            text.append(event.text)
            if not json_out and event.text:
                sys.stdout.write(event.text)
                sys.stdout.flush()
            if event.finish_reason is not None:
                final = event
    finally:
        loaded.engine.shutdown()
    if final is not None and final.finish_reason == "error":
        raise ConfigError(f"generation failed: {final.error}")
    timings = final.timings if final is not None else None
    if json_out:
        print(json.dumps({
            "model": loaded.model_id,
            "text": "".join(text),
            "token_ids": token_ids,
            "prompt_tokens": len(ids),
            "finish_reason": final.finish_reason if final else None,
            "timings": timings.to_dict() if timings else None,
        }, ensure_ascii=False))
        return
    sys.stdout.write("\n")
    if timings is not None:
        print(f"[prompt: {timings.prompt_n} tokens, {timings.prompt_per_second:.1f} tok/s | "
              f"decode: {timings.predicted_n} tokens, {timings.predicted_per_second:.1f} tok/s | "
              f"finish: {final.finish_reason}]", file=sys.stderr)


def _read_schema(value: str) -> dict:
    """--json-schema: a file holding a JSON Schema, or the schema itself."""
    from pathlib import Path

    path = Path(value).expanduser()
    text = path.read_text() if not value.lstrip().startswith("{") and path.is_file() else value
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"--json-schema: not a file and not valid JSON ({e})") from None
    if not isinstance(schema, dict):
        raise ConfigError("--json-schema must be a JSON Schema object")
    return schema
