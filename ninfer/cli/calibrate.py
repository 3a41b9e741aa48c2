"""`ninfer calibrate [MODEL]`: time the cuda backend's candidate routes on this GPU for the model's
shapes (ninfer/engine/backends/calibrate.py), write the device profile into the user cache (or
--device-profile-path) and print the chosen routes."""
from __future__ import annotations

import dataclasses
import sys
from typing import Optional

import typer

from ninfer.cli.common import DEVICE, DEVICE_PROFILE_PATH
from ninfer.errors import ConfigError


def calibrate(
    model: Optional[str] = typer.Argument(None, help="Model (.ninfer, .gguf or HF folder); default: the default model."),
    synthetic: Optional[str] = typer.Option(None, "--synthetic", help="Random weights of a named shape (e.g. llama-8b)."),
    weights: str = typer.Option("bf16", "--weights", help="Synthetic weight format: bf16, int8, int4."),
    device: int = DEVICE,
    quick: bool = typer.Option(False, "--quick", help="Fewer points of each measurement (a few seconds)."),
    gemv_policy: str = typer.Option("latency", "--gemv-policy",
                                    help="latency: the fastest gemv at one row (a single stream) decides; "
                                         "throughput: the least time over row counts 1..8 (batch-heavy serving)."),
    device_profile_path: Optional[str] = DEVICE_PROFILE_PATH,
) -> None:
    import torch

    from ninfer.engine.backends.calibrate import GEMV_POLICIES

    if gemv_policy not in GEMV_POLICIES:
        raise ConfigError(f"--gemv-policy must be one of {', '.join(GEMV_POLICIES)}, got {gemv_policy!r}")
    if not torch.cuda.is_available():
        raise ConfigError("ninfer calibrate times GPU routes, and no CUDA GPU is visible")
    if synthetic is not None and model is not None:
        raise ConfigError("give either MODEL or --synthetic, not both")
    if not 0 <= device < torch.cuda.device_count():
        raise ConfigError(f"--device {device}: there are {torch.cuda.device_count()} CUDA devices")
    from pathlib import Path

    from rich.console import Console
    from rich.progress import Progress

    from ninfer.engine.artifact import Artifact
    from ninfer.engine.backends.calibrate import CalibrationPlan
    from ninfer.engine.backends.calibrate import calibrate as run_calibration
    from ninfer.engine.model_store import resolve_model
    from ninfer.kernels.profile import device_key, profile_path
    from ninfer.paths import cache_dir

    if synthetic is not None:
        from ninfer.engine.synthetic import SyntheticArtifact
        artifact = SyntheticArtifact(synthetic, weights)
    else:
        artifact = Artifact.open(resolve_model(model, cache_dir()))
    key = device_key(device)
    path = Path(device_profile_path).expanduser() if device_profile_path else profile_path(cache_dir(), key)
    plan = dataclasses.replace(CalibrationPlan.quick() if quick else CalibrationPlan(), gemv_policy=gemv_policy)
    err = Console(file=sys.stderr)
    with Progress(console=err, transient=True) as progress:
        task = progress.add_task("calibrating", total=None)
        profile = run_calibration(
            artifact, device=torch.device("cuda", device), kernel_cache_dir=cache_dir() / "kernels", key=key,
            plan=plan, progress=lambda what: progress.update(task, advance=1, description=what),
            on_plan=lambda total: progress.update(task, total=total))
    profile.save(path)
    print_profile(profile, Console())
    print(f"wrote {path}", file=sys.stderr)


def print_profile(profile, console) -> None:
    """The chosen routes, and the timings behind each choice (microseconds)."""
    from rich.table import Table

    m = profile.measured
    dev = profile.device
    console.print(f"device profile for {dev.gpu} (sm {dev.compute_capability}, driver {dev.driver}, ninfer "
                  f"{dev.ninfer}), measured on {profile.calibrated_on}")
    gemv = Table(title="decode matmuls per step (us): route per weight format, rows 1..8")
    rows = sorted({r for routes in m["gemv"].values() for t in routes.values() for r in t})
    gemv.add_column("format")
    gemv.add_column("route")
    for r in rows:
        gemv.add_column(f"x{r}", justify="right")
    for key, routes in m["gemv"].items():
        for route, times in routes.items():
            mark = " *" if profile.gemv[key] == route else ""
            gemv.add_row(key, route + mark, *(f"{1e6 * times[r]:.1f}" for r in rows))
    mark = " *" if profile.gemv["bf16"] == "cublas" else ""
    gemv.add_row("bf16 (dense)", "cublas" + mark, *(f"{1e6 * m['cublas'][r]:.1f}" for r in rows))
    console.print(gemv)
    if m.get("mma_pipe"):
        _choice_table(console, "bf16 decode matmuls on the mma route per step (us) by pipe (iterations in flight a "
                      "warp; rule: by shape)", "pipe", m["mma_pipe"], "rule" if profile.mma_pipe is None else profile.mma_pipe)
    _choice_table(console, "decode attention per layer (us) by split partition", "partition", m["attention"],
                  profile.attention_partition)
    _choice_table(console, "prompt matmuls per layer set (us) by cuBLAS row block", "rows", m["prompt_rows"],
                  profile.prompt_rows)
    if m.get("decode_step"):
        steps = ", ".join(f"x{n} {1e6 * t:.0f}" for n, t in m["decode_step"].items())
        console.print(f"decode step from its graph (us): {steps}")
    console.print(f"graph rows: {list(profile.graph_rows)}  (* marks the chosen route)")


def _choice_table(console, title: str, what: str, table: dict, chosen) -> None:
    from rich.table import Table

    points = list(dict.fromkeys(p for t in table.values() for p in t))
    out = Table(title=title)
    out.add_column(what)
    for p in points:
        out.add_column(str(p), justify="right")
    for cand, times in table.items():
        out.add_row(f"{cand}{' *' if cand == chosen else ''}", *(f"{1e6 * times[p]:.1f}" for p in points))
    console.print(out)
