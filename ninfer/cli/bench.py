"""`ninfer bench [MODEL]`: llama-bench's shape over the Engine.

pp<N>: prompt processing of N random tokens (prompt_ms from the engine's timings).
tg<N>: N generated tokens from a one-token prompt; with --concurrency C, C requests at once and
the aggregate decode rate (tokens after each request's first / wall time once all are decoding).
With -d D, tg tests start from a D-token prompt ("tg<N> @ d<D>").
Beside llama-bench's columns, the roofline (ninfer/engine/roofline.py): bytes and FLOPs per token,
the achieved GB/s and TFLOP/s and, with --ceilings on, their ratios to the device's read bandwidth
and matmul peak, measured once per run by short probes (ninfer/kernels/probes.py). With --spec the
bytes per token count one weight read per generated token, so GB/s is the effective rate.
"""
from __future__ import annotations

import json
import math
import platform
import random
import statistics
import sys
import threading
import time
from datetime import datetime, timezone
from typing import List, Optional

import typer

from ninfer.cli.common import (BACKEND, DEVICE, DEVICE_PROFILE, DEVICE_PROFILE_PATH, DEVICES, DRAFT_TOKENS, DTYPE, NO_CUDA_GRAPH, SPEC, SPEC_NGRAM_MAX, SPEC_NGRAM_MIN,
                               THREADS, STAGE_LAYERS, prepare_threads, spec_from_flags, stderr_log)
from ninfer.engine.roofline import model_cost, roofline_fields, stored_bytes
from ninfer.errors import ConfigError


def _int_list(values: List[str], flag: str) -> list[int]:
    out: list[int] = []
    for v in values:
        for part in str(v).split(","):
            try:
                n = int(part)
            except ValueError:
                raise ConfigError(f"{flag}: {part!r} is not an integer") from None
            if n < 0:
                raise ConfigError(f"{flag}: {n} must be >= 0")
            out.append(n)
    return out


def _run_requests(engine, prompts: list[list[int]], max_tokens: int) -> tuple[float, float, int, list]:
    """Submit all prompts at once; return (t_all_first, t_end, tokens after first, final events)."""
    from ninfer.engine.request import PreparedRequest, SamplingParams

    finals: list = [None] * len(prompts)
    firsts: list[float] = [math.inf] * len(prompts)
    counts = [0] * len(prompts)
    handles = [engine.submit(PreparedRequest(
        request_id=f"bench-{i}-{random.getrandbits(32):08x}", prompt_token_ids=p,
        sampling=SamplingParams(temperature=0.0), max_tokens=max_tokens, ignore_eos=True, cache_prompt=False,
        raw_prompt=True)) for i, p in enumerate(prompts)]

    def drain(i: int) -> None:
        for ev in handles[i]:
            if ev.token_ids and firsts[i] == math.inf:
                firsts[i] = time.perf_counter()
                counts[i] += len(ev.token_ids) - 1
            else:
                counts[i] += len(ev.token_ids)
            if ev.finish_reason is not None:
                finals[i] = ev

    threads = [threading.Thread(target=drain, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for f in finals:
        if f is None or f.finish_reason == "error":
            raise ConfigError(f"benchmark request failed: {getattr(f, 'error', 'no final event')}")
    return max(firsts), time.perf_counter(), sum(counts), finals


def _model_stats(artifact) -> tuple[int, int]:
    """(size in bytes of the stored weights, parameter count)."""
    from ninfer.engine.models import expected_weights

    shapes = expected_weights(artifact.meta.config)
    n_params = sum(math.prod(s) for s in shapes.values())
    size = sum(stored_bytes(artifact.meta.tensor_formats[name], shape) for name, shape in shapes.items())
    return size, n_params


def _model_cost(artifact, device: str, dtype, kv_dtype: str = "auto"):
    """The roofline accounting of the model as this run computes it: K/V in the runner's attention
    dtype, or as --kv-dtype stores them (int8 / fp8: a byte a value plus the per-token-head scales)."""
    import dataclasses

    import torch

    from ninfer.engine.backends.torch_runner import attention_dtype, default_dtype, kv_bytes_per_token

    dev = torch.device(device)
    kv_elem = attention_dtype(dev, dtype or default_dtype(dev)).itemsize
    cost = model_cost(artifact.meta.config, artifact.meta.tensor_formats, kv_elem)
    if kv_dtype == "auto":
        return cost
    return dataclasses.replace(cost, kv_bytes_per_token=kv_bytes_per_token(artifact.meta.config, dev, dtype, kv_dtype))


def _ceilings(engine, device: str, dtype):
    """The device's ceilings, probed once per run, matmuls in the dtype the model computes in.

    The probes run on the engine's worker thread, where every torch call of the model runs: on the
    CPU, a torch op on another thread gives that thread its own OpenMP team, and with more OpenMP
    threads in the process than cores libgomp stops spinning at its barriers (every parallel op
    then wakes its workers through the kernel): measured on this 2-core machine, 2-thread decode
    at 36 tok/s after probes on the main thread against 72 without them."""
    import torch

    from ninfer.engine.backends.torch_runner import default_dtype
    from ninfer.kernels.probes import measure_ceilings

    dev = torch.device(device)
    return engine.call_on_worker(lambda: measure_ceilings(dev, dtype or default_dtype(dev))).result()


def _test_name(p: int, n: int, d: int) -> str:
    """llama-bench's test names: pp512, tg128, tg128 @ d4096."""
    return f"pp{p}" if p else f"tg{n}" + (f" @ d{d}" if d else "")


def bench(
    model: Optional[str] = typer.Argument(None, help="Model (.ninfer, .gguf or HF folder); default: the default model."),
    n_prompt: List[str] = typer.Option(["512"], "-p", "--n-prompt", help="Prompt sizes (comma list or repeated; 0 skips)."),
    n_gen: List[str] = typer.Option(["128"], "-n", "--n-gen", help="Generation lengths (comma list or repeated; 0 skips)."),
    repetitions: int = typer.Option(5, "-r", "--repetitions", help="Runs per test (after one warm-up)."),
    ubatch: int = typer.Option(1024, "-ub", "--ubatch-size", help="Prompt tokens a forward pass takes (the "
                                                                  "engine's --prefill-chunk)."),
    concurrency: List[str] = typer.Option(["1"], "--concurrency", "-c", help="Concurrent requests for tg tests (1..8)."),
    n_depth: List[str] = typer.Option(["0"], "-d", "--n-depth", help="Context depth of tg tests: a prompt of D "
                                                                     "tokens before the timed tokens (comma list; "
                                                                     "pp tests run at depth 0)."),
    ceilings: str = typer.Option("on", "--ceilings", help="on: measure the read bandwidth and matmul peak by short "
                                                          "probes and show each row's ratio to them; off: skip."),
    output: str = typer.Option("md", "-o", "--output", help="md, json or jsonl."),
    synthetic: Optional[str] = typer.Option(None, "--synthetic", help="Random weights of a named shape (e.g. smollm2-135m, llama-8b, qwen3-8b)."),
    weights: str = typer.Option("bf16", "--weights", help="Synthetic weight format: bf16, f32, int8, int4, q4_k, q6_k, q4_k_m (llama.cpp blocks)."),
    backend: str = BACKEND,
    device: int = DEVICE,
    devices: Optional[str] = DEVICES,
    stage_layers: Optional[str] = STAGE_LAYERS,
    seed: int = typer.Option(0, "--seed", help="Seed of the random prompts."),
    no_cuda_graph: bool = NO_CUDA_GRAPH,
    dtype: str = DTYPE,
    spec: Optional[str] = SPEC,
    draft_tokens: int = DRAFT_TOKENS,
    spec_ngram_min: int = SPEC_NGRAM_MIN,
    spec_ngram_max: int = SPEC_NGRAM_MAX,
    prompt_file: Optional[str] = typer.Option(None, "--prompt-file",
                                              help="tg tests continue this file's text (raw tokens) instead of one "
                                                   "random token: a context a --spec lookup can draft from."),
    threads: int = THREADS,
    device_profile: str = DEVICE_PROFILE,
    device_profile_path: Optional[str] = DEVICE_PROFILE_PATH,
    kv_dtype: str = typer.Option("auto", "--kv-dtype", help="KV-cache storage: auto, bf16, int8, fp8 (cuda)."),
    decode_ahead: str = typer.Option("on", "--decode-ahead",
                                     help="on: launch each decode step before the last one's tokens are read "
                                          "(cuda backend); off: step by step."),
) -> None:
    prepare_threads(threads, backend, announce=output == "md")
    from rich.progress import Progress

    from ninfer.engine.artifact import Artifact
    from ninfer.engine.config import SchedulerConfig
    from ninfer.engine.loader import resolve_backend, resolve_dtype, start_engine
    from ninfer.engine.model_store import resolve_model
    from ninfer.kernels.profile import ProfileRequest
    from ninfer.paths import cache_dir
    from ninfer.version import build_id, version_string

    prompts = _int_list(n_prompt, "-p")
    gens = _int_list(n_gen, "-n")
    concs = _int_list(concurrency, "--concurrency")
    depths = _int_list(n_depth, "-d")
    profile = ProfileRequest.from_flags(device_profile, device_profile_path)
    if ceilings not in ("on", "off"):
        raise ConfigError(f"--ceilings must be on or off, got {ceilings!r}")
    if output not in ("md", "json", "jsonl"):
        raise ConfigError(f"-o must be md, json or jsonl, got {output!r}")
    if repetitions < 1:
        raise ConfigError("-r must be >= 1")
    if ubatch < 1:
        raise ConfigError("-ub must be >= 1")
    if decode_ahead not in ("on", "off"):
        raise ConfigError(f"--decode-ahead must be on or off, got {decode_ahead!r}")
    if any(not 1 <= c <= 8 for c in concs):
        raise ConfigError("--concurrency values must be in 1..8")
    if synthetic is not None and model is not None:
        raise ConfigError("give either MODEL or --synthetic, not both")
    spec_config = spec_from_flags(spec, draft_tokens, spec_ngram_min, spec_ngram_max)
    context_text = None
    if prompt_file is not None:
        from pathlib import Path
        if not Path(prompt_file).is_file():
            raise ConfigError(f"--prompt-file {prompt_file!r}: no such file")
        context_text = Path(prompt_file).read_text()
        if any(depths):
            raise ConfigError("give -d or --prompt-file, not both: each sets the context of the tg tests")
    tests = [(p, 0, 0, 1) for p in prompts if p > 0] + \
            [(0, n, d, c) for n in gens if n > 0 for d in depths for c in concs]
    if not tests:
        raise ConfigError("nothing to run: every -p and -n value is 0")

    backend, torch_device = resolve_backend(backend, device)
    compute_dtype = resolve_dtype(dtype)
    from ninfer.engine.stages import Pipeline
    pipeline = Pipeline.from_flags(devices, stage_layers, backend)
    if synthetic is not None:
        from ninfer.engine.synthetic import SyntheticArtifact
        artifact = SyntheticArtifact(synthetic, weights)
    else:
        artifact = Artifact.open(resolve_model(model, cache_dir(), announce=output == "md"))
    max_c = max(c for *_, c in tests)
    context_ids: list[int] = []  # filled once the tokenizer is loaded
    span = max(max(p, d) for p, _, d, _ in tests) + max(n for _, n, _, _ in tests) + 2
    if context_text is not None:  # room for the file's tokens (at most ~1 token per byte)
        span += len(context_text.encode())
    scheduler = SchedulerConfig(max_concurrency=max_c, max_pending_requests=8, max_context=span,
                                prefill_chunk=ubatch, prefix_reuse=False, decode_ahead=decode_ahead == "on")
    loaded = start_engine(artifact, backend=backend, torch_device=torch_device, scheduler=scheduler,
                          kv_capacity=max_c * (span + 64), cuda_graph=not no_cuda_graph,
                          kernel_cache_dir=cache_dir() / "kernels", dtype=compute_dtype, spec=spec_config,
                          threads=threads or None, device_profile=profile, cache_dir=cache_dir(), log=stderr_log,
                          kv_dtype=kv_dtype, pipeline=pipeline)
    rng = random.Random(seed)
    if context_text is not None:
        context_ids = loaded.tokenizer.encode(context_text, add_special_tokens=False)
    excluded = set(loaded.tokenizer.special_token_ids) | set(loaded.tokenizer.stop_token_ids)
    vocab = [i for i in range(min(loaded.meta.config.vocab_size, loaded.tokenizer.vocab_size)) if i not in excluded]
    size, n_params = _model_stats(artifact)
    n_threads = loaded.threads or torch_threads()
    cost = _model_cost(artifact, loaded.device, compute_dtype, kv_dtype)
    results = []
    try:
        with Progress(transient=True, console=_stderr_console()) as progress:
            limits = None
            if ceilings == "on":
                probing = progress.add_task("ceilings (probes)", total=None)
                limits = _ceilings(loaded.engine, loaded.device, compute_dtype)
                progress.remove_task(probing)
            task = progress.add_task("bench", total=len(tests) * (repetitions + 1))
            for p, n, d, c in tests:
                name = _test_name(p, n, d)
                progress.update(task, description=f"{name} x{c}" if c > 1 else name)
                samples_ns = []
                drafted = accepted = 0
                for rep in range(repetitions + 1):  # rep 0 is the warm-up
                    if p:
                        _, _, _, finals = _run_requests(loaded.engine, [rng.choices(vocab, k=p)], 1)
                        ns = finals[0].timings.prompt_ms * 1e6
                        tokens = p
                    else:
                        starts = [list(context_ids) or rng.choices(vocab, k=max(d, 1)) for _ in range(c)]
                        first, end, after_first, finals = _run_requests(loaded.engine, starts, n)
                        ns = (end - first) * 1e9
                        tokens = after_first
                    if rep:
                        samples_ns.append((ns, tokens))
                        if not p:
                            drafted += sum(f.timings.draft_n for f in finals if f.timings)
                            accepted += sum(f.timings.draft_n_accepted for f in finals if f.timings)
                    progress.advance(task)
                ts = [t / (ns / 1e9) for ns, t in samples_ns]
                roofline = roofline_fields(cost, n_prompt=p, n_gen=n, n_depth=len(context_ids) or d, concurrency=c,
                                           tokens_per_s=statistics.fmean(ts), ceilings=limits)
                results.append({
                    "build_commit": build_id(), "build_number": version_string(),
                    "cpu_info": platform.processor() or platform.machine(),
                    "gpu_info": _gpu_info(torch_device), "backends": loaded.backend,
                    "device_profile": loaded.device_profile, "kv_dtype": kv_dtype,
                    "devices": list(loaded.devices) or [loaded.device],
                    "model_filename": str(artifact.path), "model_type": f"{artifact.meta.architecture} {artifact.meta.name}",
                    "model_size": size, "model_n_params": n_params, "n_threads": n_threads,
                    "n_prompt": p, "n_gen": n, "n_depth": d, "n_concurrency": c, "n_ubatch": ubatch,
                    "test_time": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
                    "avg_ns": int(statistics.fmean(ns for ns, _ in samples_ns)),
                    "stddev_ns": int(statistics.stdev([ns for ns, _ in samples_ns])) if len(samples_ns) > 1 else 0,
                    "avg_ts": statistics.fmean(ts),
                    "stddev_ts": statistics.stdev(ts) if len(ts) > 1 else 0.0,
                    "samples_ns": [int(ns) for ns, _ in samples_ns], "samples_ts": ts,
                    **({"spec": spec_config.method, "draft_tokens": spec_config.draft_tokens,
                        "draft_n": drafted, "draft_n_accepted": accepted} if spec_config else {}),
                    **roofline,
                })
    finally:
        loaded.engine.shutdown()
    _print(results, output)


def torch_threads() -> int:
    import torch

    return torch.get_num_threads()


def _gpu_info(device: str) -> str:
    if not device.startswith("cuda"):
        return ""
    import torch

    return torch.cuda.get_device_name(torch.device(device))


def _stderr_console():
    from rich.console import Console

    return Console(file=sys.stderr)


def _print(results: list[dict], output: str) -> None:
    if output == "json":
        print(json.dumps(results, indent=2))
        return
    if output == "jsonl":
        for r in results:
            print(json.dumps(r))
        return
    show_c = any(r["n_concurrency"] != 1 for r in results)
    limits = next((r["ceilings"] for r in results if "ceilings" in r), None)
    show_spec = any("spec" in r for r in results)
    header = ["model", "size", "params", "backend", "threads"] + (["conc"] if show_c else []) + ["test", "t/s"] + \
        (["drafts accepted"] if show_spec else []) + ["MB/tok", "GB/s"] + (["% BW"] if limits else []) + ["GFLOP/tok", "TFLOP/s"] + (["% peak"] if limits else [])
    print("| " + " | ".join(header) + " |")
    print("| " + " | ".join("---" if h in ("model", "backend", "test") else "---:" for h in header) + " |")
    for r in results:
        test = _test_name(r["n_prompt"], r["n_gen"], r.get("n_depth", 0))
        row = [r["model_type"], f"{r['model_size'] / 2**20:.2f} MiB", f"{r['model_n_params'] / 1e6:.2f} M",
               r["backends"], str(r["n_threads"])] + ([str(r["n_concurrency"])] if show_c else []) + \
              [test, f"{r['avg_ts']:.2f} ± {r['stddev_ts']:.2f}"]
        if show_spec:
            n, a = r.get("draft_n", 0), r.get("draft_n_accepted", 0)
            row.append(f"{a}/{n} ({100 * a / n:.0f} %)" if n else "-")
        row += _roofline_cells(r, bool(limits))
        print("| " + " | ".join(row) + " |")
    if limits:
        probes = "; ".join(f"{k}: {v}" for k, v in limits["probes"].items())
        print(f"\nceilings ({limits['device']}): read {limits['read_gbs']:.1f} GB/s, matmul "
              f"{limits['matmul_tflops']:.4g} TFLOP/s {limits['matmul_dtype']} ({probes})")
    print(f"\nbuild: {results[0]['build_number']}", file=sys.stderr)


def _roofline_cells(r: dict, ratios: bool) -> list[str]:
    """tg rows: bytes per token, GB/s (and % of the read bandwidth); pp rows: FLOPs per token,
    TFLOP/s (and % of the matmul peak); the other group's cells stay empty."""
    def pct(x: float | None) -> str:
        return f"{100 * x:.1f} %" if x is not None else ""

    if r["n_prompt"]:
        flops = [f"{r['flops_per_token'] / 1e9:.4g}", f"{r['achieved_tflops']:.4g}"] + \
            ([pct(r.get("matmul_ratio"))] if ratios else [])
        return ["", ""] + ([""] if ratios else []) + flops
    moved = [f"{r['bytes_per_token'] / 1e6:.2f}", f"{r['achieved_gbs']:.4g}"] + \
        ([pct(r.get("bandwidth_ratio"))] if ratios else [])
    return moved + ["", ""] + ([""] if ratios else [])
