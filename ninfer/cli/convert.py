"""`ninfer convert SRC -o OUT.ninfer`: GGUF file or Hugging Face folder -> .ninfer v3 artifact."""
from __future__ import annotations

from pathlib import Path

import typer

from ninfer.errors import ConfigError

WEIGHT_CHOICES = ("keep", "bf16", "int8", "int4")


def convert(
    src: Path = typer.Argument(..., help="A .gguf file or a Hugging Face model folder."),
    out: Path = typer.Option(..., "--out", "-o", help="Output .ninfer path."),
    weights: str = typer.Option("keep", "--weights", help="keep, bf16, int8 or int4."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar."),
) -> None:
    from ninfer.engine.artifact import Artifact
    from ninfer.engine.convert import convert as do_convert

    if weights not in WEIGHT_CHOICES:
        raise ConfigError(f"--weights must be one of {', '.join(WEIGHT_CHOICES)}, got {weights!r}")
    if out.suffix != ".ninfer":
        raise ConfigError(f"--out {out}: the output name must end in .ninfer")
    path = do_convert(src, out, weights=weights, progress=not quiet)
    meta = Artifact.open(path).meta
    size = path.stat().st_size / 1e6
    print(f"wrote {path} ({meta.architecture}, {meta.config.num_hidden_layers} layers, {size:.1f} MB, weights={weights})")
