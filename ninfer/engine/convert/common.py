"""Pieces both importers share: the target format of each weight, progress, hashing, stop tokens."""
from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import torch

from ninfer.engine.models import is_quantizable
from ninfer.engine.quant import DEFAULT_GROUP_SIZE, TensorFormat, dequantize, quantize
from ninfer.errors import ArtifactError

if TYPE_CHECKING:
    from ninfer.engine.config import ModelConfig

WEIGHT_MODES = ("keep", "bf16", "int8", "int4")
_FLOAT_NAMES = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}

# Tokens that end a turn or the text in common vocabularies; those present become stop tokens.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|endoftext|>", "<|end_of_text|>", "<|eom_id|>",
                      "<|end|>", "<end_of_turn>", "<|return|>", "</s>")

T = TypeVar("T")


def check_weights_mode(weights: str) -> None:
    if weights not in WEIGHT_MODES:
        raise ArtifactError(f"unknown weights format {weights!r} (choose one of {', '.join(WEIGHT_MODES)})")


def float_format(dtype: torch.dtype) -> TensorFormat:
    if dtype not in _FLOAT_NAMES:
        raise ArtifactError(f"unsupported tensor dtype {dtype}")
    return TensorFormat(_FLOAT_NAMES[dtype])


def encode_weight(name: str, fmt: TensorFormat, parts: dict[str, torch.Tensor], shape: tuple[int, ...],
                  weights: str, config: ModelConfig) -> tuple[TensorFormat, dict[str, torch.Tensor]]:
    """Convert one weight's stored parts (in `fmt`) to what `weights` asks for.

    keep: as stored (a quantized non-linear weight is expanded to f32/bf16);
    bf16: 2-D weights bf16; others (norms, biases, conv taps, gate parameters) f32;
    int8 / int4: the architecture's linear and embedding weights quantized with group 32 (int4
    asymmetric), kept bit-exact when already in that format (int4 symmetric included); other 2-D
    weights bf16, the rest f32.
    """
    ndim = len(shape)
    plain_dtype = torch.bfloat16 if ndim == 2 else torch.float32  # 1-D and 3-D tensors are small: keep f32
    plain = TensorFormat("bf16" if ndim == 2 else "f32")
    linear = is_quantizable(name, config) and ndim == 2
    if weights == "keep":
        if fmt.quantized and not linear:
            return plain, {"": dequantize(fmt, parts, torch.float32).to(plain_dtype)}
        return fmt, parts
    if weights in ("int8", "int4") and linear:
        if fmt.format == weights and fmt.group_size == DEFAULT_GROUP_SIZE:
            return fmt, parts
        target = TensorFormat(weights, DEFAULT_GROUP_SIZE, symmetric=weights == "int8")
        if shape[1] % DEFAULT_GROUP_SIZE:
            raise ArtifactError(f"{name}: input width {shape[1]} is not a multiple of {DEFAULT_GROUP_SIZE}, "
                                f"cannot store it as {weights}")
        return target, quantize(dequantize(fmt, parts, torch.float32), target)
    if fmt == plain:
        return fmt, parts
    return plain, {"": dequantize(fmt, parts, torch.float32).to(plain_dtype)}


def sha256_file(path: Path, chunk: int = 1 << 24) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def stop_token_ids(lookup: Mapping[str, int], eos_ids: Iterable[int | None]) -> list[int]:
    """EOS ids plus the ids of well-known end-of-turn tokens present in `lookup` (text -> id)."""
    ids = {i for i in eos_ids if i is not None}
    ids.update(lookup[t] for t in END_OF_TURN_TOKENS if t in lookup)
    return sorted(ids)


def progress_bar(items: Iterable[T], total: int, description: str, enabled: bool) -> Iterator[T]:
    """Iterate `items`, drawing a rich progress bar when `enabled`."""
    if not enabled:
        yield from items
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn())
    with Progress(*columns, transient=True) as bar:
        task = bar.add_task(description, total=total)
        for item in items:
            yield item
            bar.advance(task)
