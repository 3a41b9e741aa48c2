"""From a MODEL argument to a running Engine: resolve the artifact, pick the backend, size the
KV pool, build runner + tokenizer + engine."""
from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from ninfer.engine.artifact import Artifact, ArtifactMetadata
from ninfer.engine.config import MemoryConfig, SchedulerConfig, SpecConfig
from ninfer.engine.model_store import resolve_model
from ninfer.engine.rope import RopeOverride
from ninfer.engine.models import expected_weights
from ninfer.errors import ConfigError
from ninfer.formats import TensorFormat
from ninfer.kernels.profile import ProfileRequest

if TYPE_CHECKING:  # imported lazily at run time: they pull in torch
    from ninfer.engine.engine import Engine
    from ninfer.engine.tokenizer import Tokenizer

PAGE_SIZE = 64
DEFAULT_MAX_CONTEXT = 8192  # --max-context default (spec)
BACKENDS = ("auto", "torch", "cuda")


@dataclass(slots=True, frozen=True)
class ModelFacts:
    """What the loaded model is, computed once at load. The server reports these (/v1/models,
    /props, its start record) and never opens or parses the artifact itself."""

    path: str  # the artifact file ("synthetic:NAME" for random weights)
    vocab_size: int  # the tokenizer's vocabulary
    logits_size: int  # rows of the output head (config.vocab_size; may pad the vocabulary)
    max_context: int  # tokens one sequence may hold on this server (--max-context)
    trained_context: int  # max_position_embeddings
    hidden_size: int
    num_parameters: int  # logical elements of every weight
    stored_bytes: int  # the stored weight payload (quantized weights packed)
    weight_formats: tuple[str, ...]  # sorted, distinct: f32, bf16, int8g32, int4g32 (symmetric), int4ag32
    sampler_presets: dict[str, dict[str, float]]  # the model's presets by mode (thinking, non_thinking, ...)


@dataclass(slots=True)
class LoadedModel:
    engine: Engine  # started
    tokenizer: Tokenizer
    meta: ArtifactMetadata
    path: Path
    model_id: str
    max_context: int
    backend: str
    device: str
    facts: ModelFacts
    threads: int = 0  # CPU threads the torch backend computes with (0: not a CPU backend)
    device_profile: str = ""  # the cuda backend's profile in use (DeviceProfile.source); "" on torch
    devices: tuple[str, ...] = ()  # --devices: one pipeline stage per entry (empty: one device)


def model_facts(artifact, tokenizer: Tokenizer, max_context: int) -> ModelFacts:
    """The facts of an opened artifact (or a SyntheticArtifact) served with `max_context`."""
    meta = artifact.meta
    shapes = expected_weights(meta.config)
    return ModelFacts(
        path=str(artifact.path),
        vocab_size=tokenizer.vocab_size,
        logits_size=meta.config.vocab_size,
        max_context=max_context,
        trained_context=meta.config.max_position_embeddings,
        hidden_size=meta.config.hidden_size,
        num_parameters=sum(math.prod(shape) for shape in shapes.values()),
        stored_bytes=artifact.payload_bytes,
        weight_formats=tuple(sorted({weight_format_name(f) for f in meta.tensor_formats.values()})),
        sampler_presets=dict(meta.sampler_presets or {}),
    )


def weight_format_name(fmt: TensorFormat) -> str:
    """A format's short name: f32, bf16, int8g32, int4g32 (symmetric), int4ag32 (asymmetric) or a
    llama.cpp block format's (q4_k, q6_k, ...)."""
    if not fmt.quantized or fmt.blocks:
        return fmt.format
    kind = fmt.format if fmt.format == "int8" or fmt.symmetric else "int4a"
    return f"{kind}g{fmt.group_size}"


def resolve_backend(backend: str, device: int) -> tuple[str, str]:
    """(backend, torch device string). auto: cuda when a CUDA device is present, else torch on CPU."""
    import torch

    if backend not in BACKENDS:
        raise ConfigError(f"--backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    has_cuda = torch.cuda.is_available()
    if backend == "cuda" and not has_cuda:
        raise ConfigError("--backend cuda needs a CUDA device, and none is visible")
    if has_cuda and not 0 <= device < torch.cuda.device_count():
        raise ConfigError(f"--device {device}: there are {torch.cuda.device_count()} CUDA devices")
    if backend == "cuda":
        from ninfer.engine.backends import cuda_available
        if not cuda_available():
            raise ConfigError("--backend cuda is not supported by this build yet; use --backend torch")
    if backend == "auto":
        from ninfer.engine.backends import cuda_available
        backend = "cuda" if has_cuda and cuda_available() else "torch"
    return backend, (f"cuda:{device}" if has_cuda else "cpu")


def resolve_dtype(name: str):
    """--dtype: None for auto (the backend's default, bf16), else torch.bfloat16 or torch.float32.
    float32 runs activations and the KV cache in fp32: the faithful mode, for small models."""
    import torch

    dtypes = {"auto": None, "bfloat16": torch.bfloat16, "float32": torch.float32}
    if name not in dtypes:
        raise ConfigError(f"--dtype must be one of {', '.join(dtypes)}, got {name!r}")
    return dtypes[name]


def resolve_kv_pages(kv_capacity: int | str | None, max_context: int, kv_bytes_per_token: int,
                     device: str, stages: tuple | None = None) -> int:
    """Pages in the shared KV pool. None: follow --max-context; "auto": device memory (CUDA: free
    memory less 1 GiB headroom; CPU: a quarter of available RAM), capped at 8 lanes x max_context.
    stages: (layer kinds, devices, layers per stage) of a --devices split, whose pages every
    device holds for its own stages' layers: auto takes what the tightest device allows."""
    if kv_capacity is None:
        tokens = max_context
    elif kv_capacity == "auto":
        if stages is not None:
            from ninfer.engine.stages import auto_kv_tokens
            tokens = auto_kv_tokens(*stages, kv_bytes_per_token, _kv_budget)
        else:
            tokens = _kv_budget(device) // max(kv_bytes_per_token, 1)
        tokens = min(tokens, 8 * max_context)
    elif isinstance(kv_capacity, int) and not isinstance(kv_capacity, bool) and kv_capacity > 0:
        tokens = kv_capacity
    else:
        raise ConfigError(f"--kv-capacity must be a positive integer or auto, got {kv_capacity!r}")
    pages = -(-tokens // PAGE_SIZE)
    if pages * PAGE_SIZE < PAGE_SIZE:
        raise ConfigError("--kv-capacity leaves no room for a single KV page")
    return pages


def _kv_budget(device: str) -> int:
    """Bytes --kv-capacity auto gives the KV pool on `device`."""
    import torch

    if device.startswith("cuda"):
        free, _ = torch.cuda.mem_get_info(torch.device(device))
        return max(free - (1 << 30), 0)
    import os
    return max(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 4, 0)


def resolve_state_slots(config, scheduler: SchedulerConfig) -> int:
    """Recurrent-state slots of a hybrid model (0 for pure attention): per lane a working slot and a
    slot for the page checkpoint its prefill captures, and per retained continuation the prefix
    cache may hold its two checkpoints (page and frontier): 2 x max_concurrency + 2 x entries.
    With that many a capture always finds a spare slot, and admission always finds a working
    slot for the queue's head by evicting unpinned entries."""
    from ninfer.engine.models import state_spec

    if state_spec(config).recurrent is None:
        return 0
    entries = scheduler.max_private_continuations
    entries = 2 * scheduler.max_concurrency if entries is None else entries
    if not scheduler.prefix_reuse:
        return scheduler.max_concurrency  # nothing is retained, so nothing is captured
    return 2 * scheduler.max_concurrency + 2 * entries


def load_engine(model: str | None, *, backend: str = "auto", scheduler: SchedulerConfig | None = None,
                kv_capacity: int | str | None = None, device: int = 0, chat_template: str | None = None,
                cache_dir: Path | None = None, announce: bool = True, cuda_graph: bool = True,
                dtype: str = "auto", rope: RopeOverride | None = None, spec: SpecConfig | None = None,
                threads: int | None = None,
                device_profile: ProfileRequest | None = None,
                log: Callable[[str], None] | None = None, memory: MemoryConfig | None = None,
                kv_dtype: str = "auto", devices: str | None = None, stage_layers: str | None = None) -> LoadedModel:
    """Load `model` (None: the default model) and start an Engine over it. `rope`: the serve
    options' RoPE scaling, in place of the model's own; `spec`: speculative decoding (--spec);
    devices / stage_layers: the --devices and --stage-layers values (pipeline stages)."""
    if cache_dir is None:
        from ninfer.paths import cache_dir as default_cache_dir
        cache_dir = default_cache_dir()
    backend, torch_device = resolve_backend(backend, device)
    compute_dtype = resolve_dtype(dtype)
    from ninfer.engine.stages import Pipeline
    pipeline = Pipeline.from_flags(devices, stage_layers, backend)
    path = resolve_model(model, cache_dir, announce=announce)
    artifact = Artifact.open(path)
    if chat_template is not None:
        artifact.meta = replace(artifact.meta, chat_template=_read_template(chat_template))
    check_start_up_inputs(artifact, chat_template)
    return start_engine(artifact, backend=backend, torch_device=torch_device,
                        scheduler=scheduler or SchedulerConfig(), kv_capacity=kv_capacity,
                        cuda_graph=cuda_graph, kernel_cache_dir=cache_dir / "kernels", dtype=compute_dtype,
                        rope=rope, spec=spec, threads=threads,
                        device_profile=device_profile, cache_dir=cache_dir, log=log, memory=memory, kv_dtype=kv_dtype,
                        pipeline=pipeline)


def start_engine(artifact, *, backend: str, torch_device: str, scheduler: SchedulerConfig,
                 kv_capacity: int | str | None, cuda_graph: bool = True,
                 kernel_cache_dir: Path | None = None, dtype=None, rope: RopeOverride | None = None,
                 spec: SpecConfig | None = None, threads: int | None = None,
                 device_profile: ProfileRequest | None = None, cache_dir: Path | None = None,
                 log: Callable[[str], None] | None = None, memory: MemoryConfig | None = None,
                 kv_dtype: str = "auto", pipeline=None) -> LoadedModel:
    """Build runner, tokenizer and Engine over an opened artifact (or a SyntheticArtifact) and start it.
    dtype: None (the backend's default) or a torch dtype from `resolve_dtype`. rope: RoPE scaling
    options (the default context and the KV pool follow the native window whatever they say).
    spec: speculative decoding (--spec); raises ConfigError for a backend the artifact cannot serve.
    threads: CPU threads of the torch backend on CPU (None or 0: the plan `cpu_threads.prepare`
    made, else chosen now from the free cores). device_profile: how the cuda backend finds its
    route profile (None: the built-in defaults; the CLI's default is auto); `log` gets the line
    naming it (default: the "ninfer" logger). pipeline: a `stages.Pipeline` (--devices), whose
    first device replaces torch_device."""
    from ninfer.engine import cpu_threads
    from ninfer.engine.backends.torch_runner import kv_bytes_per_token
    from ninfer.engine.engine import Engine
    from ninfer.engine.tokenizer import Tokenizer

    meta = artifact.meta
    check_spec(spec, meta, backend)
    native = meta.config.max_position_embeddings
    max_context = scheduler.max_context or min(DEFAULT_MAX_CONTEXT, native)
    if max_context < 1:
        raise ConfigError("--max-context must be positive")
    scheduler = replace(scheduler, max_context=max_context)
    if rope is not None and rope.active:
        artifact.meta = replace(meta, config=rope.apply(meta.config, max_context))
        meta = artifact.meta
    tokenizer = Tokenizer.from_metadata(meta)
    tokenizer.token_bytes(0)  # build the byte table now (~0.4 s), not on the first request's first token
    check_kv_dtype(kv_dtype, backend, dtype)
    devices = split = stages = None
    if pipeline is not None:
        from ninfer.engine.models import state_spec
        kinds = state_spec(meta.config).kinds
        split = pipeline.check(backend, len(kinds))
        devices = list(pipeline.devices)
        torch_device = devices[0]
        if spec is not None and spec.method == "mtp":
            raise ConfigError("--spec mtp with --devices is not supported yet (use --spec lookup)")
        stages = (kinds, devices, split)
    bytes_per_token = kv_bytes_per_token(meta.config, torch_device, dtype, kv_dtype)  # the same for both backends
    num_pages = resolve_kv_pages(kv_capacity, max_context, bytes_per_token, torch_device, stages)
    num_state_slots = resolve_state_slots(meta.config, scheduler)
    on_cpu = backend != "cuda" and torch_device == "cpu"
    plan = None
    if on_cpu:
        plan = cpu_threads.current()
        if plan is None or (threads and plan.threads != threads):
            plan = cpu_threads.prepare(threads)
    profile = None
    if backend == "cuda":
        from ninfer.engine.backends.calibrate import resolve_device_profile
        from ninfer.paths import cache_dir as default_cache_dir

        root = cache_dir if cache_dir is not None else default_cache_dir()
        profile = resolve_device_profile(device_profile or ProfileRequest("off"), artifact, device=torch_device,
                                         kernel_cache_dir=kernel_cache_dir or root / "kernels", cache_dir=root,
                                         log=log or logging.getLogger("ninfer").info)

    def build_runner():  # runs on the engine's worker thread (Engine.spawn says why)
        if backend == "cuda":
            from ninfer.engine.backends.cuda_runner import CudaModelRunner
            return CudaModelRunner(artifact, num_pages=num_pages, page_size=PAGE_SIZE, device=torch_device,
                                   cuda_graph=cuda_graph, kernel_cache_dir=kernel_cache_dir,
                                   num_state_slots=num_state_slots, profile=profile, kv_dtype=kv_dtype,
                                   max_draft_tokens=spec.draft_tokens if spec is not None and spec.method == "lookup" else 0,
                                   devices=devices, stage_layers=split,
                                   **({"dtype": dtype} if dtype is not None else {}))
        from ninfer.engine.backends.torch_runner import TorchModelRunner
        adapter = None
        if plan is not None:
            cpu_threads.apply(plan)
            adapter = cpu_threads.ThreadAdapter(plan) if plan.source == "measured" else None
        return TorchModelRunner(artifact, num_pages=num_pages, page_size=PAGE_SIZE, device=torch_device, dtype=dtype,
                                num_state_slots=num_state_slots, thread_adapter=adapter,
                                mtp_draft_tokens=spec.draft_tokens if spec is not None and spec.method == "mtp" else 0, kv_dtype=kv_dtype,
                                devices=devices, stage_layers=split, kernel_cache_dir=kernel_cache_dir)

    facts = model_facts(artifact, tokenizer, max_context)
    engine = Engine.spawn(build_runner, tokenizer, scheduler, model_max_context=max_context, spec=spec, memory=memory,
                          profile=session_profile(meta, facts, backend, spec), model_name=meta.model_id)
    return LoadedModel(engine=engine, tokenizer=tokenizer, meta=meta, path=artifact.path, model_id=meta.model_id,
                       max_context=max_context, backend=backend, device=torch_device, facts=facts,
                       threads=plan.threads if plan is not None else 0,
                       device_profile=profile.source if profile is not None else "",
                       devices=tuple(devices or ()))


def check_start_up_inputs(artifact, chat_template_option: str | None) -> None:
    """What a request would otherwise find broken, refused before the model loads: the chat
    template, compiled and rendered once (Artifact.open already checked the rest of the metadata)."""
    from ninfer.engine.errors import TemplateError
    from ninfer.engine.tokenizer import Tokenizer

    try:
        Tokenizer.from_metadata(artifact.meta).check_chat_template()
    except TemplateError as e:
        where = (f"--chat-template {chat_template_option!r}" if chat_template_option is not None
                 else f"{artifact.path}: the model's chat template")
        raise ConfigError(f"{where}: {e}") from None


def check_spec(spec: SpecConfig | None, meta, backend: str) -> None:
    """Refuse a speculative backend this artifact or backend cannot serve, with a clear message."""
    if spec is None or spec.method != "mtp":
        return
    if not meta.config.mtp_layers:
        raise ConfigError(f"--spec mtp needs an artifact that carries MTP layers (mtp.* tensors, kept when "
                          f"converting a Hugging Face folder that has them); {meta.name} has none (use --spec lookup)")
    if backend == "cuda":
        raise ConfigError("--spec mtp runs on the torch backend only so far (use --backend torch, or --spec lookup)")


KV_DTYPES = ("auto", "bf16", "int8", "fp8")


def check_kv_dtype(kv_dtype: str, backend: str, dtype) -> None:
    """--kv-dtype: auto (the backend's attention dtype: f32 on CPU, bf16 on CUDA); bf16 or int8 on
    the torch backend; bf16, int8 or fp8 (e4m3) on the cuda backend, whose kernels read the codes."""
    import torch

    if kv_dtype not in KV_DTYPES:
        raise ConfigError(f"--kv-dtype must be one of {', '.join(KV_DTYPES)}, got {kv_dtype!r}")
    if backend == "cuda" and kv_dtype == "bf16" and dtype == torch.float32:
        raise ConfigError("--kv-dtype bf16 with --dtype float32: the cuda backend keeps KV in its compute dtype")
    if backend != "cuda" and kv_dtype == "fp8":
        raise ConfigError("--kv-dtype fp8 needs the cuda backend (the torch backend takes auto, bf16 or int8)")


def session_profile(meta: ArtifactMetadata, facts: ModelFacts, backend: str, spec: SpecConfig | None = None) -> dict:
    """What a session file (slot file, prefix-cache file, disk tier) must match to be restored on
    this server: the artifact, its weight formats, the layer kinds (state kinds) and the speculative
    backend with its draft tokens (spec: Slots; under --spec mtp the head's K/V travel with the
    pages); ContextTiers adds the KV dtype and the pool layout."""
    from ninfer.engine.models import state_spec

    source = meta.source or {}
    return {"artifact": f"{meta.model_id}@{source.get('sha256') or source.get('path') or ''}",
            "architecture": meta.config.architecture, "weight_formats": list(facts.weight_formats),
            "state_kinds": list(state_spec(meta.config).kinds),
            "speculative": f"{spec.method}/{spec.draft_tokens}" if spec is not None and spec.enabled else None}


def _read_template(value: str) -> str:
    """--chat-template takes a file path or the template text itself."""
    p = Path(value).expanduser()
    if "{" not in value and p.is_file():
        return p.read_text()
    if "{" not in value:
        raise ConfigError(f"--chat-template {value!r}: no such file")
    return value
