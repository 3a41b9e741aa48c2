"""Importers: GGUF (llama.cpp) files and Hugging Face safetensors folders -> .ninfer artifacts."""
from __future__ import annotations

from pathlib import Path

from ninfer.engine.convert.common import WEIGHT_MODES
from ninfer.engine.convert.gguf import convert_gguf
from ninfer.engine.convert.gguf_reader import GGUF_MAGIC, GGUFFile
from ninfer.engine.convert.hf import convert_hf
from ninfer.errors import ArtifactError

__all__ = ["WEIGHT_MODES", "check_source", "convert", "convert_gguf", "convert_hf"]


def check_source(src: str | Path) -> None:
    """Raise ArtifactError (naming the file and the problem) for a source `convert` cannot read:
    a GGUF's header is parsed, a folder needs config.json. Cheap: checked before announcing work."""
    src = Path(src)
    if not src.exists():
        raise ArtifactError(f"{src}: no such file or folder")
    if src.is_dir():
        if not (src / "config.json").is_file():
            raise ArtifactError(f"{src}: not a Hugging Face model folder (no config.json)")
    elif _is_gguf(src):
        GGUFFile(src)
    else:
        raise ArtifactError(f"{src}: not a GGUF file or a Hugging Face model folder")


def convert(src: str | Path, out: str | Path, weights: str = "keep", progress: bool = True) -> Path:
    """Convert a GGUF file or a Hugging Face model folder to a .ninfer artifact at `out`.

    weights: keep | bf16 | int8 | int4. Returns `out`; raises ArtifactError naming the source.
    """
    src = Path(src)
    if not src.exists():
        raise ArtifactError(f"{src}: no such file or folder")
    if src.is_dir():
        if (src / "config.json").is_file():
            return convert_hf(src, out, weights=weights, progress=progress)
    elif _is_gguf(src):
        return convert_gguf(src, out, weights=weights, progress=progress)
    raise ArtifactError(f"{src}: not a GGUF file or a Hugging Face model folder")


def _is_gguf(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == GGUF_MAGIC
    except OSError:
        return False
