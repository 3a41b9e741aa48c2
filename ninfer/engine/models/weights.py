"""The one loader: reads an artifact's stored tensors and hands them to the backend's ops, which
decide their packing (dense, packed int4 for the CPU kernel, kept quantized for the GEMV kernel)."""
from __future__ import annotations

from typing import Any

import torch

from ninfer.engine.quant import TensorFormat, dequantize


class WeightReader:
    """Stored parts of an artifact (or a SyntheticArtifact) on the target device, by name."""

    def __init__(self, artifact: Any, ops: Any, device: torch.device) -> None:
        self.parts: dict[str, dict[str, torch.Tensor]] = artifact.load_parts(device)
        self.formats: dict[str, TensorFormat] = dict(artifact.meta.tensor_formats)
        self.ops = ops

    def float32(self, name: str) -> torch.Tensor:
        """A tensor expanded to float32 (norms, biases, conv taps, gate parameters)."""
        return dequantize(self.formats[name], self.parts[name], torch.float32)

    def vector(self, name: str, offset: float = 0.0) -> Any:
        """A norm weight or other small tensor for the ops; `offset` is added (1 for `1 + w` norms)."""
        t = self.float32(name)
        return self.ops.vector(t + offset if offset else t)

    def parameter(self, name: str) -> Any:
        """A small tensor kept in float32 whatever the compute dtype (per-head gate parameters)."""
        return self.ops.parameter(self.float32(name))

    def linear(self, names: list[str], bias: list[str] | None = None, glu: bool = False, logits: bool = False) -> Any:
        """One weight whose rows are the named weights stacked in order (a fused projection); glu:
        names are a gated MLP's [gate, up], used only through ops.gated_linear; logits: an untied
        lm_head, used only through ops.logits."""
        b = torch.cat([self.float32(n) for n in bias]) if bias else None
        return self.ops.linear_weight([(self.formats[n], self.parts[n]) for n in names], b, glu=glu, logits=logits)

    def embedding(self, name: str, lm_head: bool) -> Any:
        return self.ops.embedding_weight(self.formats[name], self.parts[name], lm_head)

    def select_rows(self, name: str, rows: torch.Tensor, as_name: str) -> str:
        """Store rows `rows` (output features, in that order) of weight `name` as a weight named
        `as_name`, to fuse or reorder part of a projection; rows move whole, so this holds for
        quantized parts (scales, mins) too. Returns as_name."""
        rows = rows.to(next(iter(self.parts[name].values())).device)
        self.parts[as_name] = {sfx: t.index_select(0, rows) for sfx, t in self.parts[name].items()}
        self.formats[as_name] = self.formats[name]
        return as_name

    def release(self, prefix: str) -> None:
        """Drop the stored parts under `prefix` once the backend holds its copies (peak memory)."""
        for n in [n for n in self.parts if n.startswith(prefix)]:
            del self.parts[n]
