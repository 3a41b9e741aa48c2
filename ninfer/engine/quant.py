"""Groupwise weight formats and their exact (de)quantization in torch. `TensorFormat` itself
lives in ninfer/formats.py (the kernels read it too) and is re-exported here.

Storage of a weight NAME with logical shape [out, in] and group size g:
  int8:            NAME [out, in] int8,      NAME.scales [out, in/g] f16;   w = q * s
  int4 symmetric:  NAME [out, in/2] uint8,   NAME.scales [out, in/g] f16;   w = (q - 8) * s     (GGUF Q4_0)
  int4 asymmetric: NAME [out, in/2] uint8,   NAME.scales, NAME.mins f16;    w = q * s + m       (GGUF Q4_1)
int4 packs element 2j in the low nibble and 2j+1 in the high nibble of byte j.
llama.cpp's block formats (q4_k, q6_k, q5_0, iq4_xs, ...) are one uint8 part NAME of raw GGUF blocks;
quant_blocks.py holds their layouts and dequantization.
"""
from __future__ import annotations

import torch

from ninfer.formats import FLOAT_FORMATS, QUANT_FORMATS, TensorFormat  # noqa: F401 - re-exported

DEFAULT_GROUP_SIZE = 32


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """[out, in] values 0..15 -> [out, in/2] uint8."""
    q = q.to(torch.uint8)
    return q[:, 0::2] | (q[:, 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """[out, in/2] uint8 -> [out, in] uint8 values 0..15."""
    low = packed & 0x0F
    high = packed >> 4
    return torch.stack((low, high), dim=-1).reshape(packed.shape[0], packed.shape[1] * 2)


def dequantize(fmt: TensorFormat, parts: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Rebuild the logical tensor from its stored parts (keys '', '.scales', '.mins')."""
    main = parts[""]
    if not fmt.quantized:
        return main.to(dtype)
    if fmt.blocks:
        from ninfer.engine.quant_blocks import dequantize_blocks

        return dequantize_blocks(fmt, main, dtype)
    g = fmt.group_size
    scales = parts[".scales"].to(torch.float32)
    if fmt.format == "int8":
        q = main.to(torch.float32)
    else:
        q = unpack_int4(main).to(torch.float32)
        if fmt.symmetric:
            q = q - 8.0
    out, inp = q.shape
    w = q.view(out, inp // g, g) * scales.unsqueeze(-1)
    if fmt.format == "int4" and not fmt.symmetric:
        w = w + parts[".mins"].to(torch.float32).unsqueeze(-1)
    return w.reshape(out, inp).to(dtype)


def int_codes(fmt: TensorFormat, parts: dict[str, torch.Tensor]
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, int]:
    """A quantized weight's stored parts as integer codes within int8, with a float32 scale and, where
    the format has one, a zero per group of g inputs: w = scale * q (+ zero), `dequantize`'s value
    exactly. -> (q [out, in] int8, scale [out, in/g], zero [out, in/g] or None, g)."""
    if fmt.blocks:
        from ninfer.engine.quant_blocks import code_group, int8_codes

        q, scale, zero = int8_codes(fmt, parts[""])
        return q, scale, zero, code_group(fmt)
    scale = parts[".scales"].to(torch.float32)
    if fmt.format == "int8":
        return parts[""].to(torch.int8), scale, None, fmt.group_size
    q = unpack_int4(parts[""]).to(torch.int8)
    if fmt.symmetric:
        return q - 8, scale, None, fmt.group_size
    return q, scale, parts[".mins"].to(torch.float32), fmt.group_size


def quantize(w: torch.Tensor, fmt: TensorFormat) -> dict[str, torch.Tensor]:
    """Quantize a logical [out, in] float tensor into stored parts (round to nearest)."""
    if not fmt.quantized:
        return {"": w.to(FLOAT_FORMATS[fmt.format]).contiguous()}
    if fmt.blocks:
        from ninfer.engine.quant_blocks import quantize_blocks

        return {"": quantize_blocks(fmt, w)}
    g = fmt.group_size
    out, inp = w.shape
    x = w.to(torch.float32).reshape(out, inp // g, g)
    if fmt.format == "int8":
        amax = x.abs().amax(dim=-1)
        scales = (amax / 127.0).to(torch.float16)
        s = scales.to(torch.float32).unsqueeze(-1)
        q = torch.where(s > 0, torch.round(x / torch.where(s > 0, s, 1.0)), 0.0).clamp(-127, 127)
        return {"": q.reshape(out, inp).to(torch.int8).contiguous(), ".scales": scales.contiguous()}
    if fmt.symmetric:
        # Q4_0: the value of largest magnitude maps to -8.
        idx = x.abs().argmax(dim=-1, keepdim=True)
        vmax = torch.gather(x, -1, idx).squeeze(-1)
        scales = (vmax / -8.0).to(torch.float16)
        s = scales.to(torch.float32).unsqueeze(-1)
        q = torch.where(s != 0, torch.round(x / torch.where(s != 0, s, 1.0)) + 8.0, 8.0).clamp(0, 15)
        return {"": pack_int4(q.reshape(out, inp)).contiguous(), ".scales": scales.contiguous()}
    lo = x.amin(dim=-1)
    hi = x.amax(dim=-1)
    scales = ((hi - lo) / 15.0).to(torch.float16)
    mins = lo.to(torch.float16)
    s = scales.to(torch.float32).unsqueeze(-1)
    m = mins.to(torch.float32).unsqueeze(-1)
    q = torch.where(s > 0, torch.round((x - m) / torch.where(s > 0, s, 1.0)), 0.0).clamp(0, 15)
    return {"": pack_int4(q.reshape(out, inp)).contiguous(), ".scales": scales.contiguous(), ".mins": mins.contiguous()}
