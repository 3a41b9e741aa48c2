"""The .ninfer v3 artifact: one safetensors file whose `__metadata__` holds
`ninfer.format_version = "3"` and `ninfer.metadata`, a JSON document (see ArtifactMetadata).

Quantized weights are stored as parts (see quant.py): NAME, NAME.scales, NAME.mins.
"""
from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ninfer.engine.config import ModelConfig
from ninfer.engine.models import expected_weights
from ninfer.engine.quant import TensorFormat, dequantize
from ninfer.errors import ArtifactError, NInferError

FORMAT_VERSION = "3"
_SAFETENSORS_DTYPES = {
    "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I8": torch.int8, "U8": torch.uint8, "I32": torch.int32, "I64": torch.int64,
}
_ITEM_SIZES = {dtype: torch.empty((), dtype=dtype).element_size() for dtype in _SAFETENSORS_DTYPES.values()}


@dataclass(slots=True)
class SpecialTokens:
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)  # EOS included
    add_bos_token: bool = False
    bos_token: str | None = None
    eos_token: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__slots__}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SpecialTokens:
        return cls(**{k: d[k] for k in cls.__slots__ if k in d})


@dataclass(slots=True)
class ArtifactMetadata:
    """Everything in `ninfer.metadata` besides the tensors themselves."""

    name: str
    model_id: str
    config: ModelConfig
    tensor_formats: dict[str, TensorFormat]
    tokenizer_json: str
    chat_template: str | None
    special_tokens: SpecialTokens
    source: dict[str, Any]  # kind: gguf|hf|synthetic, sha256, path
    sampler_presets: dict[str, dict[str, float]] = field(default_factory=dict)

    @property
    def architecture(self) -> str:
        return self.config.architecture

    def to_json(self) -> str:
        return json.dumps({
            "name": self.name,
            "architecture": self.config.architecture,
            "identity": {"model_id": self.model_id},
            "config": self.config.to_dict(),
            "tensors": {k: v.to_dict() for k, v in self.tensor_formats.items()},
            "tokenizer": self.tokenizer_json,
            "chat_template": self.chat_template,
            "special_tokens": self.special_tokens.to_dict(),
            "sampler_presets": self.sampler_presets,
            "source": self.source,
        })

    @classmethod
    def from_json(cls, text: str) -> ArtifactMetadata:
        d = json.loads(text)
        for key in ("name", "architecture", "identity", "config", "tensors", "tokenizer", "special_tokens", "source"):
            if key not in d:
                raise ArtifactError(f"metadata lacks {key!r}")
        config = ModelConfig.from_dict(d["config"])
        if d["architecture"] != config.architecture:
            raise ArtifactError(f"architecture {d['architecture']!r} disagrees with its config")
        return cls(
            name=d["name"],
            model_id=d["identity"].get("model_id") or d["name"],
            config=config,
            tensor_formats={k: TensorFormat.from_dict(v) for k, v in d["tensors"].items()},
            tokenizer_json=d["tokenizer"],
            chat_template=d.get("chat_template"),
            special_tokens=SpecialTokens.from_dict(d["special_tokens"]),
            source=d["source"],
            sampler_presets=check_sampler_presets(d.get("sampler_presets") or {}),
        )


# sampler preset field -> (lowest, highest) it may hold
_PRESET_RANGES = {"temperature": (0.0, 2.0), "top_p": (0.0, 1.0), "top_k": (0, 2**31 - 1), "min_p": (0.0, 1.0),
                  "presence_penalty": (-2.0, 2.0), "frequency_penalty": (-2.0, 2.0)}


def check_sampler_presets(presets: Any) -> dict[str, dict[str, float]]:
    """The artifact's sampler presets, returned when they are an object of modes, each an object
    whose known numeric fields are in range (a bad one would otherwise fail every request)."""
    if not isinstance(presets, dict):
        raise ArtifactError("sampler_presets must be an object of modes")
    for mode, preset in presets.items():
        if not isinstance(preset, dict):
            raise ArtifactError(f"sampler preset {mode!r} must be an object")
        for name, value in preset.items():
            bounds = _PRESET_RANGES.get(name)
            if bounds is None:
                continue  # fields this server does not sample with (repetition_penalty, ...)
            ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            if ok and name == "top_k":
                ok = float(value).is_integer()
            if not ok or not bounds[0] <= value <= bounds[1]:
                raise ArtifactError(f"sampler preset {mode}.{name} = {value!r} is not a number in "
                                    f"[{bounds[0]}, {bounds[1]}]")
    return presets


def write_artifact(path: str | Path, tensors: dict[str, torch.Tensor], meta: ArtifactMetadata) -> Path:
    """Write stored tensors (quantized ones already split into parts) and metadata atomically.

    Validates the result against the architecture before it becomes visible at `path`.
    """
    from safetensors.torch import save_file

    path = Path(path)
    _validate_tensors(path, meta, {k: (tuple(v.shape), v.dtype) for k, v in tensors.items()})
    tmp = path.with_name(path.name + ".partial")
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp),
              metadata={"ninfer.format_version": FORMAT_VERSION, "ninfer.metadata": meta.to_json()})
    os.replace(tmp, path)
    return path


def _read_header(path: Path) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise ArtifactError(f"{path}: not a safetensors file (too short)")
            (n,) = struct.unpack("<Q", head)
            size = path.stat().st_size
            if n <= 0 or n > 100 * 1024 * 1024:
                raise ArtifactError(f"{path}: not a safetensors file (its first 8 bytes give a header "
                                    f"length of {n})")
            if n > size - 8:
                raise ArtifactError(f"{path}: truncated: the header alone needs {8 + n} bytes but the "
                                    f"file has {size} (an interrupted copy or download?)")
            header = json.loads(f.read(n))
    except FileNotFoundError:
        raise ArtifactError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise ArtifactError(f"{path}: is a directory, not a .ninfer file") from None
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise ArtifactError(f"{path}: not a safetensors file (header is not JSON)") from None
    if not isinstance(header, dict):
        raise ArtifactError(f"{path}: not a safetensors file (header is not an object)")
    header["__header_bytes__"] = 8 + n
    return header


def _validate_tensors(path: Path, meta: ArtifactMetadata,
                      stored: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> None:
    expected = expected_weights(meta.config)
    for name, shape in expected.items():
        fmt = meta.tensor_formats.get(name)
        if fmt is None:
            raise ArtifactError(f"{path}: tensor {name} has no format entry")
        for suffix, want in fmt.stored_shapes(shape).items():
            key = name + suffix
            if key not in stored:
                raise ArtifactError(f"{path}: missing tensor {key}")
            got_shape, got_dtype = stored[key]
            if tuple(got_shape) != tuple(want):
                raise ArtifactError(f"{path}: tensor {key} has shape {list(got_shape)}, expected {list(want)}")
            want_dtype = fmt.stored_dtypes()[suffix]
            if got_dtype != want_dtype:
                raise ArtifactError(f"{path}: tensor {key} has dtype {got_dtype}, expected {want_dtype}")
    extra = sorted(set(meta.tensor_formats) - set(expected))
    if extra:
        raise ArtifactError(f"{path}: unexpected tensor {extra[0]} for architecture {meta.architecture}")


class Artifact:
    """An opened, validated .ninfer file. Tensors are read lazily (memory-mapped).
    `payload_bytes`: the stored tensor data (after the header), as the header's offsets say."""

    def __init__(self, path: Path, meta: ArtifactMetadata, payload_bytes: int = 0) -> None:
        self.path = path
        self.meta = meta
        self.payload_bytes = payload_bytes

    @classmethod
    def open(cls, path: str | Path) -> Artifact:
        path = Path(path)
        header = _read_header(path)
        md = header.get("__metadata__") or {}
        version = md.get("ninfer.format_version")
        if version is None:
            raise ArtifactError(f"{path}: a safetensors file without ninfer metadata (not a .ninfer artifact)")
        if version != FORMAT_VERSION:
            raise ArtifactError(f"{path}: format_version {version!r} is not supported (this build reads {FORMAT_VERSION!r})")
        try:
            meta = ArtifactMetadata.from_json(md.get("ninfer.metadata", ""))
        except json.JSONDecodeError:
            raise ArtifactError(f"{path}: ninfer.metadata is not valid JSON") from None
        except ArtifactError as e:
            raise ArtifactError(f"{path}: {e}") from None
        except NInferError as e:
            raise ArtifactError(f"{path}: {e}") from None
        except (KeyError, TypeError, ValueError) as e:
            raise ArtifactError(f"{path}: malformed ninfer.metadata ({e})") from None
        header_bytes = header.pop("__header_bytes__")
        stored = {}
        payload_bytes = 0
        for key, info in header.items():
            if key == "__metadata__":
                continue
            dtype = _SAFETENSORS_DTYPES.get(info.get("dtype") if isinstance(info, dict) else None)
            if dtype is None:
                raise ArtifactError(f"{path}: tensor {key} has unsupported dtype "
                                    f"{info.get('dtype') if isinstance(info, dict) else info!r}")
            shape, offsets = info.get("shape", ()), info.get("data_offsets")
            if (not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape)
                    or not isinstance(offsets, list) or len(offsets) != 2
                    or not all(isinstance(o, int) for o in offsets)
                    or not 0 <= offsets[0] <= offsets[1]
                    or offsets[1] - offsets[0] != math.prod(shape) * _ITEM_SIZES[dtype]):
                raise ArtifactError(f"{path}: tensor {key} has a corrupt shape or data_offsets entry")
            stored[key] = (tuple(shape), dtype)
            payload_bytes = max(payload_bytes, offsets[1])
        size = path.stat().st_size
        if header_bytes + payload_bytes > size:
            raise ArtifactError(f"{path}: truncated: its tensors need {header_bytes + payload_bytes} bytes but the "
                                f"file has {size} (an interrupted copy or download?)")
        _validate_tensors(path, meta, stored)
        return cls(path, meta, payload_bytes)

    def load_parts(self, device: str | torch.device = "cpu",
                   names: set[str] | None = None) -> dict[str, dict[str, torch.Tensor]]:
        """name -> {suffix: stored tensor} for every expected weight (only `names`, when given)."""
        from safetensors import safe_open

        from safetensors import SafetensorError

        parts: dict[str, dict[str, torch.Tensor]] = {}
        try:
            with safe_open(str(self.path), framework="pt", device=str(device)) as f:
                for name, fmt in self.meta.tensor_formats.items():
                    if names is None or name in names:
                        parts[name] = {s: f.get_tensor(name + s) for s in fmt.stored_dtypes()}
        except (SafetensorError, OSError) as e:  # changed or damaged since it was opened
            raise ArtifactError(f"{self.path}: cannot read its tensors ({e})") from None
        return parts

    def load_dequantized(self, dtype: torch.dtype = torch.float32,
                         device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
        """name -> logical tensor in `dtype` (quantized weights expanded)."""
        return {name: dequantize(self.meta.tensor_formats[name], p, dtype).to(device)
                for name, p in self.load_parts().items()}
