"""Weight tensor formats: what a stored weight is (float dtype, int8/int4 groupwise, or one of
llama.cpp's block formats kept as GGUF stores it) and the shapes and dtypes of its stored parts. Neutral ground: the engine (quant, artifact, models,
backends) and the kernels' launchers both read it, and it imports neither.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ninfer.errors import ArtifactError

FLOAT_FORMATS = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}
QUANT_FORMATS = ("int8", "int4")
# llama.cpp block formats, kept byte for byte as a GGUF file stores them: a weight [out, in] is one
# uint8 part [out, in / elements * bytes], each row its blocks in order (ninfer/engine/quant_blocks.py
# documents each layout). name -> (elements per block, bytes per block).
BLOCK_FORMATS: dict[str, tuple[int, int]] = {
    "q4_k": (256, 144), "q5_k": (256, 176), "q6_k": (256, 210), "q2_k": (256, 84), "q3_k": (256, 110),
    "q5_0": (32, 22), "q5_1": (32, 24), "iq4_nl": (32, 18), "iq4_xs": (256, 136),
}


@dataclass(slots=True, frozen=True)
class TensorFormat:
    format: str  # f32 | f16 | bf16 | int8 | int4 | a BLOCK_FORMATS name
    group_size: int | None = None  # block formats: the elements per block (implied by the format)
    symmetric: bool = True

    def __post_init__(self) -> None:
        if self.format in BLOCK_FORMATS:
            object.__setattr__(self, "group_size", BLOCK_FORMATS[self.format][0])
            object.__setattr__(self, "symmetric", True)
            return
        if self.format not in FLOAT_FORMATS and self.format not in QUANT_FORMATS:
            raise ArtifactError(f"unknown tensor format {self.format!r}")
        if self.format in QUANT_FORMATS and (not isinstance(self.group_size, int) or self.group_size <= 0):
            raise ArtifactError(f"{self.format} tensor needs a positive group_size")

    @property
    def quantized(self) -> bool:
        return self.format in QUANT_FORMATS or self.format in BLOCK_FORMATS

    @property
    def blocks(self) -> bool:
        """A llama.cpp block format (stored as raw GGUF blocks)."""
        return self.format in BLOCK_FORMATS

    def to_dict(self) -> dict:
        d: dict = {"format": self.format}
        if self.format in QUANT_FORMATS:
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
        if self.blocks:
            if inp % g:
                raise ArtifactError(f"input width {inp} is not a multiple of the {self.format} block size {g}")
            return {"": (out, inp // g * BLOCK_FORMATS[self.format][1])}
        if inp % g or (self.format == "int4" and inp % 2):
            raise ArtifactError(f"input width {inp} is not a multiple of group size {g}")
        shapes = {"": (out, inp if self.format == "int8" else inp // 2), ".scales": (out, inp // g)}
        if self.format == "int4" and not self.symmetric:
            shapes[".mins"] = (out, inp // g)
        return shapes

    def stored_dtypes(self) -> dict[str, torch.dtype]:
        if not self.quantized:
            return {"": FLOAT_FORMATS[self.format]}
        if self.blocks:
            return {"": torch.uint8}
        dtypes = {"": torch.int8 if self.format == "int8" else torch.uint8, ".scales": torch.float16}
        if self.format == "int4" and not self.symmetric:
            dtypes[".mins"] = torch.float16
        return dtypes
