"""`ninfer serve [MODEL]`: the OpenAI-/llama.cpp-compatible HTTP server (Granian, in-process).

Builds ServerConfig + SchedulerConfig from the flags (bad values name the option and exit 1),
then hands over to ninfer.server.runner, which binds first and loads the model behind it.
"""
from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable
from typing import Any, Optional

import typer

from ninfer.cli.common import (BACKEND, DEVICE, DEVICE_PROFILE, DEVICE_PROFILE_PATH, DEVICES, DRAFT_TOKENS, DTYPE,
                               NO_CUDA_GRAPH, SPEC, SPEC_NGRAM_MAX,
                               SPEC_NGRAM_MIN, THREADS, STAGE_LAYERS, prepare_threads, spec_from_flags)
from ninfer.errors import ConfigError


def _kv_capacity(value: Optional[str]) -> int | str | None:
    if value is None:
        return None
    if value == "auto":
        return "auto"
    try:
        n = int(value)
    except ValueError:
        raise ConfigError(f"--kv-capacity must be a positive integer or auto, got {value!r}") from None
    if n <= 0:
        raise ConfigError("--kv-capacity must be a positive integer or auto")
    return n


def serve(
    ctx: typer.Context,
    model: Optional[str] = typer.Argument(None, metavar="[MODEL]",
                                          help="A .ninfer file, a GGUF, a Hugging Face folder; default SmolLM2-135M-Instruct."),
    host: str = typer.Option("127.0.0.1", "--host", help="Listen address."),
    port: int = typer.Option(8080, "--port", help="Listen port."),
    api_key: Optional[str] = typer.Option(None, "--api-key", envvar="NINFER_API_KEY",
                                          help="Required bearer or x-api-key value."),
    model_id: Optional[str] = typer.Option(None, "--model-id", help="Public model alias (default: the artifact's model id)."),
    strict_model_name: bool = typer.Option(False, "--strict-model-name",
                                           help="Answer a request naming another model 404 model_not_found "
                                                "(default: any name is served by the one model)."),
    max_context: int = typer.Option(8192, "--max-context", help="Logical context ceiling of each sequence."),
    rope_yarn: bool = typer.Option(False, "--rope-yarn",
                                   help="Past the native window, YaRN at factor --max-context / native."),
    rope_yarn_factor: float = typer.Option(1.0, "--rope-yarn-factor", help="YaRN at this fixed factor in [1, 4]."),
    rope_scaling_factor: float = typer.Option(
        1.0, "--rope-scaling-factor",
        help="Linear position interpolation past --rope-scaling-original-context, by this factor in [1, 32]."),
    rope_scaling_original_context: Optional[int] = typer.Option(
        None, "--rope-scaling-original-context", help="The interpolation threshold (default: the native window)."),
    kv_capacity: Optional[str] = typer.Option(None, "--kv-capacity", help="Shared KV pool in tokens, or auto (default: --max-context)."),
    max_concurrency: int = typer.Option(1, "--max-concurrency", help="Requests running at once (1..8)."),
    max_pending_requests: int = typer.Option(16, "--max-pending-requests", help="Further requests allowed to wait."),
    pending_timeout_ms: int = typer.Option(600000, "--pending-timeout-ms", help="Most a request waits for admission (0: forever)."),
    prefill_chunk: int = typer.Option(1024, "--prefill-chunk", help="Text-prefill chunk in tokens."),
    decode_rounds_per_prefill: int = typer.Option(0, "--decode-rounds-per-prefill", help="Decode rounds before each prefill chunk (0: chunk / 64)."),
    concurrent_prefill: bool = typer.Option(False, "--concurrent-prefill", help="Admit to free lanes while another request prefills."),
    max_request_mib: int = typer.Option(384, "--max-request-mib", help="Body-size limit before JSON parsing."),
    default_max_tokens: Optional[int] = typer.Option(None, "--default-max-tokens", help="Output limit when a request names none."),
    no_prefix_reuse: bool = typer.Option(False, "--no-prefix-reuse", help="Disable the context (prefix) cache."),
    chat_template: Optional[str] = typer.Option(None, "--chat-template", help="Jinja chat template file instead of the artifact's."),
    cors: bool = typer.Option(False, "--cors", help="Permissive browser CORS headers."),
    cors_origin: Optional[list[str]] = typer.Option(None, "--cors-origin",
                                                    help="Answer CORS only for this origin (repeatable; implies --cors)."),
    usage_chunk_choice: bool = typer.Option(False, "--usage-chunk-choice", help="Give the streamed usage chunk a zero-delta choice."),
    stats_port: Optional[int] = typer.Option(None, "--stats-port", help="Also serve /health, /stats, /v1/load, /metrics on this port."),
    log_level: str = typer.Option("info", "--log-level", help="trace|debug|info|warning|error|critical|off"),
    log_stats_interval_ms: int = typer.Option(5000, "--log-stats-interval-ms",
                                              help="Aggregate throughput record interval; 0 disables it."),
    log_stats_panel: str = typer.Option("on", "--log-stats-panel",
                                        help="on|off. On (the default) pins the session statistics panel beneath "
                                             "the log, only on an interactive terminal at info verbosity or more; "
                                             "redirected output gets plain records."),
    request_log_jsonl: Optional[str] = typer.Option(None, "--request-log-jsonl",
                                                    help="Append full-precision server/request records to FILE."),
    request_log_max_mib: int = typer.Option(0, "--request-log-max-mib",
                                            help="Rotate the request log at N MiB: FILE.1 .. FILE.<keep> (0: never)."),
    request_log_keep: int = typer.Option(4, "--request-log-keep", help="Rotated request logs kept; 0 keeps none."),
    temperature: Optional[float] = typer.Option(None, "--temperature", help="Process-level temperature override."),
    top_p: Optional[float] = typer.Option(None, "--top-p", help="Process-level top-p override."),
    top_k: Optional[int] = typer.Option(None, "--top-k", help="Process-level top-k override (0..20; 0 is the top-20 cap)."),
    min_p: Optional[float] = typer.Option(None, "--min-p", help="Process-level min-p override."),
    presence_penalty: Optional[float] = typer.Option(None, "--presence-penalty", help="Process-level presence-penalty override."),
    frequency_penalty: Optional[float] = typer.Option(None, "--frequency-penalty", help="Process-level frequency-penalty override."),
    seed: Optional[int] = typer.Option(None, "--seed", help="Fixed seed when a request omits one."),
    greedy: bool = typer.Option(False, "--greedy", help="Force exact argmax for all requests."),
    structured_output: bool = typer.Option(False, "--structured-output",
                                           help="Accept JSON and JSON Schema response formats, enforced token by token."),
    unconstrained_response_format: bool = typer.Option(
        False, "--unconstrained-response-format",
        help="Without --structured-output, generate JSON-format requests unconstrained instead of refusing them."),
    assistant_prefill: bool = typer.Option(False, "--assistant-prefill",
                                           help="Continue a final assistant Chat message in place (as /v1/messages does)."),
    no_thinking: bool = typer.Option(False, "--no-thinking", help="Disable thinking by default (requests may enable it)."),
    default_reasoning_effort: Optional[str] = typer.Option(
        None, "--default-reasoning-effort",
        help="Effort for requests that name none: none, minimal, low, medium, high, xhigh or max "
             "(none turns thinking off by default)."),
    preserve_thinking: bool = typer.Option(False, "--preserve-thinking",
                                           help="Preserve closed-turn assistant reasoning by default."),
    default_thinking_budget: Optional[int] = typer.Option(None, "--default-thinking-budget",
                                                          help="Thinking-token cap of thinking requests that name none."),
    thinking_budget_message: Optional[str] = typer.Option(None, "--thinking-budget-message",
                                                          help="Guidance committed at the thinking budget (</think> appended when missing)."),
    post_thinking: bool = typer.Option(False, "--post-thinking",
                                       help="Sample the answer of thinking requests with the post-thinking preset."),
    post_thinking_temperature: Optional[float] = typer.Option(None, "--post-thinking-temperature", help="Implies --post-thinking."),
    post_thinking_top_p: Optional[float] = typer.Option(None, "--post-thinking-top-p", help="Implies --post-thinking."),
    post_thinking_top_k: Optional[int] = typer.Option(None, "--post-thinking-top-k", help="Implies --post-thinking."),
    post_thinking_sampler: Optional[str] = typer.Option(None, "--post-thinking-sampler",
                                                        help="temp=F,top_p=F,top_k=N[,min_p=F,presence=F,frequency=F]; implies --post-thinking."),
    kv_dtype: str = typer.Option("auto", "--kv-dtype",
                                 help="KV-cache storage: auto (f32 on CPU, bf16 on CUDA), bf16, int8 (torch backend)."),
    host_kv_mib: Optional[int] = typer.Option(None, "--host-kv-mib",
                                              help="Host tier for evicted conversations, MiB (default 8192; 0: none)."),
    host_cache_mib: Optional[str] = typer.Option(None, "--host-cache-mib",
                                                 help="One host-memory ceiling for the host tier in MiB, or auto."),
    prefix_cache_file: Optional[str] = typer.Option(None, "--prefix-cache-file",
                                                    help="Save the host tier here at stop, restore it at start."),
    slot_save_path: Optional[str] = typer.Option(None, "--slot-save-path",
                                                 help="Enable POST /slots/{id} save/restore/erase with files in DIR."),
    auto_save_evicted: bool = typer.Option(False, "--auto-save-evicted",
                                           help="Write an evicted session back to its bound slot file."),
    disk_kv_path: Optional[str] = typer.Option(None, "--disk-kv-path", help="Disk tier under the host tier, in DIR."),
    disk_kv_gib: float = typer.Option(64.0, "--disk-kv-gib", help="Disk tier budget in GiB."),
    disk_kv_restore: bool = typer.Option(False, "--disk-kv-restore",
                                         help="Seed a new request's matching prefix from the disk tier."),
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
    models_dir: Optional[str] = typer.Option(None, "--models-dir",
                                             help="Router: serve every model in DIR (with no MODEL argument)."),
    models_preset: Optional[str] = typer.Option(None, "--models-preset",
                                                help="Router: the models and their options in a llama.cpp preset INI."),
    models_max: int = typer.Option(1, "--models-max", help="Router: most models loaded at once (0: no limit)."),
    models_autoload: bool = typer.Option(True, "--models-autoload/--no-models-autoload",
                                         help="Load a model a request names (?autoload=0|1 per request)."),
    unload_idle_seconds: float = typer.Option(0, "--unload-idle-seconds",
                                              help="Unload a model idle this long (0: never); it reloads on demand."),
    sleep_idle_seconds: float = typer.Option(0, "--sleep-idle-seconds",
                                             help="Put a model idle this long to sleep (needs --model-suspend)."),
    model_suspend: bool = typer.Option(False, "--model-suspend",
                                       help="Let an idle model give its memory back (suspend, sleep)."),
    suspend_snapshot: str = typer.Option("pageable", "--suspend-snapshot",
                                         help="Where a suspend keeps the retained state: pageable (host memory "
                                              "allocated at suspend, sized to what is live) or pinned (a block for "
                                              "the whole state reserved at start-up and kept)."),
    suspend_weights: str = typer.Option("artifact", "--suspend-weights",
                                        help="Where a resume reads the weights: artifact (the file again) or host "
                                             "(a suspend copies them to host memory)."),
    no_auto_resume: bool = typer.Option(False, "--no-auto-resume",
                                        help="A request to a suspended model fails with 503 instead of resuming it."),
) -> None:
    prepare_threads(threads, backend, announce=False)  # before torch loads; the engine logs the choice
    from ninfer.server.router import ModelSpec, PoolOptions
    from ninfer.server.runner import serve_forever

    options = PoolOptions(router=bool(models_dir or models_preset), models_max=models_max,
                          autoload=models_autoload, unload_idle_seconds=unload_idle_seconds,
                          sleep_idle_seconds=sleep_idle_seconds)
    if sleep_idle_seconds and not options.router and not model_suspend:
        raise ConfigError("--sleep-idle-seconds needs --model-suspend")
    config, load = model_setup(ctx.params)
    if options.router:
        from ninfer.cli.router import router_models

        if model is not None:
            raise ConfigError("a router (--models-dir / --models-preset) takes no MODEL argument")
        if model_id is not None:
            raise ConfigError("--model-id names a single model; a router's models are named by their file, "
                              "folder or preset section (alias = ... adds names)")
        specs = router_models(ctx, models_dir, models_preset, model_setup)
    else:
        from ninfer.cli.router import explicit_argv

        specs = [ModelSpec(name=config.model_id or "", path=model or "", load=lambda: (load(), config),
                           args=tuple(explicit_argv(ctx)), load_on_startup=True)]
    level = {"trace": logging.DEBUG, "off": logging.CRITICAL + 10}.get(log_level, getattr(logging, log_level.upper()))
    logging.basicConfig(level=level, format="%(asctime)s.%(msecs)03d %(levelname)s %(message)s",
                        datefmt="%Y-%m-%d %H:%M:%S", stream=sys.stderr)

    def announce(line: str) -> None:
        print(line, flush=True)

    serve_forever(config, specs, announce, options)  # ends the process with the server's exit status


def model_setup(p: dict[str, Any]) -> tuple[Any, Callable[[], Any]]:
    """The ServerConfig and the model loader of one set of serve parameters (click's names):
    every bad value fails here, naming its option."""
    from ninfer.engine.config import SchedulerConfig
    from ninfer.engine.loader import resolve_dtype
    from ninfer.engine.rope import RopeOverride
    from ninfer.kernels.profile import ProfileRequest
    from ninfer.server.config import SamplerOverrides, ServerConfig

    if p["backend"] not in ("auto", "torch", "cuda"):
        raise ConfigError(f"--backend must be one of auto, torch, cuda, got {p['backend']!r}")
    if p["device"] < 0:
        raise ConfigError("--device must be >= 0")
    resolve_dtype(p["dtype"])  # a bad value fails before the server starts
    from ninfer.engine.stages import Pipeline
    if Pipeline.from_flags(p["devices"], p["stage_layers"], p["backend"]) is not None and p["model_suspend"]:
        raise ConfigError("--model-suspend with --devices is not supported yet")
    profile = ProfileRequest.from_flags(p["device_profile"], p["device_profile_path"])
    from ninfer.engine.loader import KV_DTYPES
    if p["kv_dtype"] not in KV_DTYPES:
        raise ConfigError(f"--kv-dtype must be one of {', '.join(KV_DTYPES)}, got {p['kv_dtype']!r}")
    if p["max_context"] < 1:
        raise ConfigError("--max-context must be >= 1")
    seed = p["seed"] if p["seed"] is None or p["seed"] >= 0 else None  # negative: a fresh random seed per
    # request, as on the wire
    kv = _kv_capacity(p["kv_capacity"])
    rope = RopeOverride(yarn=p["rope_yarn"], yarn_factor=p["rope_yarn_factor"], scaling_factor=p["rope_scaling_factor"],
                        original_context=p["rope_scaling_original_context"])
    spec_config = spec_from_flags(p["spec"], p["draft_tokens"], p["spec_ngram_min"], p["spec_ngram_max"])
    scheduler = SchedulerConfig(
        max_concurrency=p["max_concurrency"], max_pending_requests=p["max_pending_requests"],
        pending_timeout_ms=p["pending_timeout_ms"], prefill_chunk=p["prefill_chunk"],
        decode_rounds_per_prefill=p["decode_rounds_per_prefill"] or None, concurrent_prefill=p["concurrent_prefill"],
        max_context=p["max_context"], default_max_tokens=p["default_max_tokens"], prefix_reuse=not p["no_prefix_reuse"],
    )
    from ninfer.cli.memory_options import memory_config
    memory = memory_config(host_kv_mib=p["host_kv_mib"], host_cache_mib=p["host_cache_mib"],
                           prefix_cache_file=p["prefix_cache_file"], slot_save_path=p["slot_save_path"],
                           auto_save_evicted=p["auto_save_evicted"], disk_kv_path=p["disk_kv_path"],
                           disk_kv_gib=p["disk_kv_gib"], disk_kv_restore=p["disk_kv_restore"],
                           prefix_reuse=not p["no_prefix_reuse"])
    sampler = SamplerOverrides(temperature=p["temperature"], top_p=p["top_p"], top_k=p["top_k"], min_p=p["min_p"],
                               presence_penalty=p["presence_penalty"], frequency_penalty=p["frequency_penalty"],
                               seed=seed, greedy=p["greedy"])
    config = ServerConfig(host=p["host"], port=p["port"], api_key=p["api_key"], model_id=p["model_id"], max_request_mib=p["max_request_mib"],
                          strict_model_name=p["strict_model_name"], cors=p["cors"] or bool(p["cors_origin"]),
                          cors_origins=tuple(p["cors_origin"] or ()), usage_chunk_choice=p["usage_chunk_choice"], stats_port=p["stats_port"],
                          log_level=p["log_level"], default_max_tokens=p["default_max_tokens"], sampler=sampler,
                          structured_output=p["structured_output"], log_stats_interval_ms=p["log_stats_interval_ms"],
                          request_log_jsonl=p["request_log_jsonl"], request_log_max_mib=p["request_log_max_mib"],
                          request_log_keep=p["request_log_keep"], model_suspend=p["model_suspend"],
                          auto_resume=not p["no_auto_resume"], suspend_snapshot=p["suspend_snapshot"],
                          suspend_weights=p["suspend_weights"],
                          log_stats_panel=_on_off(p["log_stats_panel"], "--log-stats-panel"),
                          unconstrained_response_format=p["unconstrained_response_format"], model_path=p["model"] or "",
                          no_thinking=p["no_thinking"], preserve_thinking=p["preserve_thinking"],
                          default_reasoning_effort=p["default_reasoning_effort"],
                          assistant_prefill=p["assistant_prefill"],
                          default_thinking_budget=p["default_thinking_budget"],
                          thinking_budget_message=p["thinking_budget_message"],
                          post_thinking=_post_thinking(p["post_thinking"], p["post_thinking_temperature"], p["post_thinking_top_p"],
                                                       p["post_thinking_top_k"], p["post_thinking_sampler"]),
                          slot_save_path=memory.slot_save_path, prefix_cache_file=memory.prefix_cache_file)
    if p["chat_template"] is not None:
        from pathlib import Path
        if not Path(p["chat_template"]).expanduser().is_file():
            raise ConfigError(f"--chat-template {p['chat_template']!r}: no such file")

    fault = os.environ.get("NINFER_INJECT_ENGINE_FAULT")  # tests of exit status 2 (engine/fault.py)

    def load():
        from ninfer.engine.loader import load_engine
        loaded = load_engine(p["model"], backend=p["backend"], scheduler=scheduler, kv_capacity=kv, device=p["device"],
                             chat_template=p["chat_template"], cuda_graph=not p["no_cuda_graph"], dtype=p["dtype"],
                             rope=rope, spec=spec_config, threads=p["threads"] or None, device_profile=profile,
                             memory=memory, kv_dtype=p["kv_dtype"], devices=p["devices"],
                             stage_layers=p["stage_layers"])
        if fault:
            from ninfer.engine.fault import fail_after_batches
            fail_after_batches(loaded.engine, int(fault))
        return loaded

    return config, load


def _on_off(value: str, option: str) -> bool:
    if value not in ("on", "off"):
        raise ConfigError(f"{option} must be on or off, got {value!r}")
    return value == "on"


_SAMPLER_KEYS = {"temp": "temperature", "temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
                 "min_p": "min_p", "presence": "presence_penalty", "frequency": "frequency_penalty"}


def _post_thinking(on: bool, temperature: Optional[float], top_p: Optional[float], top_k: Optional[int],
                   sampler: Optional[str]) -> dict | None:
    """The post-thinking overrides (None: off). Any override implies --post-thinking."""
    fields: dict = {}
    if sampler:
        for item in sampler.split(","):
            key, _, value = item.partition("=")
            name = _SAMPLER_KEYS.get(key.strip())
            if name is None or not value:
                raise ConfigError(f"--post-thinking-sampler: {item!r} is not one of "
                                  "temp=F,top_p=F,top_k=N,min_p=F,presence=F,frequency=F")
            try:
                fields[name] = int(value) if name == "top_k" else float(value)
            except ValueError:
                raise ConfigError(f"--post-thinking-sampler: {item!r} needs a number") from None
    for name, value in (("temperature", temperature), ("top_p", top_p), ("top_k", top_k)):
        if value is not None:
            fields[name] = value
    if "temperature" in fields and not 0.0 <= fields["temperature"] <= 2.0:
        raise ConfigError("--post-thinking-temperature must be in [0, 2]")
    if "top_p" in fields and not 0.0 <= fields["top_p"] <= 1.0:
        raise ConfigError("--post-thinking-top-p must be in [0, 1]")
    return fields if (on or fields) else None
