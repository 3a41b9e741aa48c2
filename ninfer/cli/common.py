"""Pieces several commands share: the [MODEL] TEXT argument pair, sampler flags, backend flags."""
from __future__ import annotations

import typer

from ninfer.engine.errors import InvalidRequest
from ninfer.engine.request import SamplingParams
from ninfer.errors import ConfigError


# The backend flags of serve, run and bench (typer reads these as the parameters' defaults).
BACKEND = typer.Option("auto", "--backend", help="auto, torch or cuda.")
DEVICE = typer.Option(0, "--device", help="CUDA device index.")
DEVICES = typer.Option(None, "--devices",
                       help="Pipeline stages: one per listed device, 2 to 8 (CUDA indices such as 0,1; cpu,cpu on "
                            "the torch backend); overrides --device.")
STAGE_LAYERS = typer.Option(None, "--stage-layers",
                            help="Layers per --devices stage, in order (default: split by each device's free "
                                 "memory; on CPU, evenly).")
NO_CUDA_GRAPH = typer.Option(False, "--no-cuda-graph", help="Disable CUDA graphs (cuda backend: decode steps, and one sequence's prompt chunks).")
DEVICE_PROFILE = typer.Option("auto", "--device-profile",
                              help="cuda route profile: auto (stored one; calibrate a GPU without one), off "
                                   "(built-in routes), calibrate (measure anew) or a profile file.")
DEVICE_PROFILE_PATH = typer.Option(None, "--device-profile-path",
                                   help="Profile file to read and write instead of the user cache.")
DTYPE = typer.Option("auto", "--dtype", help="Activation and KV-cache dtype: auto (bfloat16), bfloat16 or "
                                             "float32 (exact, slower).")
THREADS = typer.Option(0, "--threads", "-t", help="CPU threads of the torch backend (0: as many as cores "
                                                  "other processes leave free, measured at start).")


def prepare_threads(threads: int, backend: str, announce: bool) -> None:
    """Choose the CPU thread plan before torch loads (the OpenMP wait policy is read then); the
    choice is printed to stderr when `announce`, and logged by the engine."""
    if backend == "cuda":
        return
    from ninfer.engine import cpu_threads

    plan = cpu_threads.prepare(threads or None)
    if announce:
        import sys
        print(f"ninfer: {plan.describe()}", file=sys.stderr, flush=True)

# Speculative decoding flags of serve, run and bench.
SPEC = typer.Option(None, "--spec", help="Speculative decoding: lookup (n-gram lookup in the request's own "
                                         "context) or mtp (the artifact's MTP layers). Off by default.")
DRAFT_TOKENS = typer.Option(3, "--draft-tokens", help="Most draft tokens verified per round (1..15).")
SPEC_NGRAM_MIN = typer.Option(2, "--spec-ngram-min", help="--spec lookup: shortest n-gram matched.")
SPEC_NGRAM_MAX = typer.Option(4, "--spec-ngram-max", help="--spec lookup: longest n-gram matched (tried first).")


def spec_from_flags(spec: str | None, draft_tokens: int, ngram_min: int, ngram_max: int):
    """The SpecConfig of the speculative flags (None when --spec is not given)."""
    from ninfer.engine.config import SpecConfig

    if spec is None:
        return None
    return SpecConfig(method=spec, draft_tokens=draft_tokens, ngram_min=ngram_min, ngram_max=ngram_max)


def split_model_and_text(args: list[str], what: str) -> tuple[str | None, str]:
    """`[MODEL] TEXT`: one argument is the text (default model), two are model and text."""
    if len(args) == 1:
        return None, args[0]
    if len(args) == 2:
        return args[0], args[1]
    raise ConfigError(f"expected [MODEL] {what}, got {len(args)} arguments (quote the {what.lower()})")


def sampling_from_flags(*, temperature: float | None, top_k: int | None, top_p: float | None,
                        min_p: float | None, presence_penalty: float | None,
                        frequency_penalty: float | None, seed: int | None,
                        preset: dict | None = None) -> SamplingParams:
    """Flags over the model's preset over SamplingParams' defaults; bad values name the flag."""
    values = dict(preset or {})
    flags = {"temperature": temperature, "top_k": top_k, "top_p": top_p, "min_p": min_p,
             "presence_penalty": presence_penalty, "frequency_penalty": frequency_penalty, "seed": seed}
    values.update({k: v for k, v in flags.items() if v is not None})
    known = set(SamplingParams.__slots__)
    try:
        return SamplingParams(**{k: v for k, v in values.items() if k in known})
    except InvalidRequest as e:
        flag = "--" + (e.field or "").replace("_", "-")
        raise ConfigError(f"{flag}: {e.message}") from None


def stderr_log(line: str) -> None:
    """Log lines of run and bench (stdout is the command's output)."""
    import sys

    print(line, file=sys.stderr, flush=True)
