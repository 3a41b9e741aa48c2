"""Weight tensor formats: what a stored weight is (float dtype, or int8/int4 groupwise) and the
shapes and dtypes of its stored parts. Neutral ground: the engine (quant, artifact, models,
backends) and the kernels' launchers both read it, and it imports neither.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ninfer.errors import ArtifactError

FLOAT_FORMATS = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}
QUANT_FORMATS = ("int8", "int4")


@dataclass(slots=True, frozen=True)
class TensorFormat:
    format: str  # f32 | f16 | bf16 | int8 | int4
    group_size: int | None = None
    symmetric: bool = True

    def __post_init__(self) -> None:
        if self.format not in FLOAT_FORMATS and self.format not in QUANT_FORMATS:
            raise ArtifactError(f"unknown tensor format {self.format!r}")
        if self.format in QUANT_FORMATS and (not isinstance(self.group_size, int) or self.group_size <= 0):
            raise ArtifactError(f"{self.format} tensor needs a positive group_size")

    @property
    def quantized(self) -> bool:
        return self.format in QUANT_FORMATS

    def to_dict(self) -> dict:
        d: dict = {"format": self.format}
        if self.quantized:
            d["group_size"] = self.group_size
            d["symmetric"] = self.symmetric
        return d

    @classmethod
    def from_dict(cls, d: dict) -> TensorFormat:
        if not isinstance(d, dict) or "format" not in d:
            raise ArtifactError(f"bad tensor format entry {d!r}")
        return cls(d["format"], d.get("group_size"), bool(d.get("symmetric", True)))

    def stored_shapes(self, shape: tuple[int, ...]) -> dict[str, tuple[int, ...]]:
        """Suffix ('' for the main tensor) -> stored shape, for a logical shape."""
        if not self.quantized:
            return {"": shape}
        if len(shape) != 2:
            raise ArtifactError(f"{self.format} needs a 2-D tensor, got shape {list(shape)}")
        out, inp = shape
        g = self.group_size
        if inp % g or (self.format == "int4" and inp % 2):
            raise ArtifactError(f"input width {inp} is not a multiple of group size {g}")
        shapes = {"": (out, inp if self.format == "int8" else inp // 2), ".scales": (out, inp // g)}
        if self.format == "int4" and not self.symmetric:
            shapes[".mins"] = (out, inp // g)
        return shapes

    def stored_dtypes(self) -> dict[str, torch.dtype]:
        if not self.quantized:
            return {"": FLOAT_FORMATS[self.format]}
        dtypes = {"": torch.int8 if self.format == "int8" else torch.uint8, ".scales": torch.float16}
        if self.format == "int4" and not self.symmetric:
            dtypes[".mins"] = torch.float16
        return dtypes
