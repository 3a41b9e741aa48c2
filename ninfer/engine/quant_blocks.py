"""llama.cpp's block formats (formats.BLOCK_FORMATS), kept as GGUF stores them, and their exact
dequantization in torch (any device). A weight [out, in] is stored as uint8 [out, in/QK * bytes]:
each row its blocks in order. Within a block, element e (0 <= e < QK) is (offsets in bytes;
d, dmin, m: f16; `x[i] >> s & mask` reads bits of byte i):

  q5_0   (32, 22)   d@0 qh:u32@2 qs[16]@6      q = (qs[e%16] >> 4*(e//16) & 15) | (qh >> e & 1) << 4;  w = d * (q - 16)
  q5_1   (32, 24)   d@0 m@2 qh@4 qs[16]@8      q as q5_0;                                             w = d * q + m
  iq4_nl (32, 18)   d@0 qs[16]@2               q = qs[e%16] >> 4*(e//16) & 15;                        w = d * KVALUES[q]
  q4_k  (256, 144)  d@0 dmin@2 scales[12]@4 qs[128]@16
                    sub-block j = e//32 (6-bit scale sc_j, min m_j: see _k_scale_min);
                    q = qs[32*(j//2) + e%32] >> 4*(j%2) & 15;                                         w = d*sc_j*q - dmin*m_j
  q5_k  (256, 176)  d@0 dmin@2 scales[12]@4 qh[32]@16 qs[128]@48
                    q = q4_k's q | (qh[e%32] >> j & 1) << 4;                                          w as q4_k
  q6_k  (256, 210)  ql[128]@0 qh[64]@128 scales:i8[16]@192 d@208;  h = e//128, r = e%128
                    q = (ql[64h + r%64] >> 4*(r//64) & 15) | (qh[32h + r%32] >> 2*(r//32) & 3) << 4;  w = d * scales[e//16] * (q - 32)
  q2_k  (256, 84)   scales[16]@0 qs[64]@16 d@80 dmin@82;  h = e//128, r = e%128, s = scales[e//16]
                    q = qs[32h + r%32] >> 2*(r//32) & 3;                                              w = d*(s & 15)*q - dmin*(s >> 4)
  q3_k  (256, 110)  hmask[32]@0 qs[64]@32 scales[12]@96 d@108;  h, r as q2_k
                    q = (qs[32h + r%32] >> 2*(r//32) & 3) - 4 * (1 - (hmask[e%32] >> e//32 & 1));    w = d * sc3(e//16) * q
                    sc3(i) = ((scales[i%8] >> 4*(i//8) & 15) | (scales[8 + i%4] >> 2*(i//4) & 3) << 4) - 32
  iq4_xs (256, 136) d@0 scales_h:u16@2 scales_l[4]@4 qs[128]@8;  sub-block j = e//32, t = e%32
                    ls_j = ((scales_l[j//2] >> 4*(j%2) & 15) | (scales_h >> 2j & 3) << 4) - 32
                    q = qs[16j + t%16] >> 4*(t//16) & 15;                                             w = d * ls_j * KVALUES[q]

The CUDA kernels (ninfer/kernels/blocks.cuh) decode the same layouts; gguf-py's reference
dequantize is what the tests compare all of them with.
"""
from __future__ import annotations

import torch

from ninfer.formats import BLOCK_FORMATS, TensorFormat

KVALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)  # iq4_nl / iq4_xs
# GGUF type name -> our block format name
GGUF_BLOCK_TYPES = {name.upper(): name for name in BLOCK_FORMATS}


def _f16(b: torch.Tensor, offset: int) -> torch.Tensor:
    """[n, bytes] -> [n, 1] float32 from the f16 at `offset`."""
    return b[:, offset:offset + 2].contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[n, 16k] bytes -> [n, k, 32]: each 16-byte group's low nibbles, then its high nibbles."""
    n = qs.shape[0]
    g = qs.reshape(n, -1, 16)
    return torch.cat((g & 15, g >> 4), dim=-1)


def _bits(x: torch.Tensor, shifts: range | list[int], mask: int) -> torch.Tensor:
    """[..., m] -> [..., len(shifts), m]: (x >> s) & mask for each shift."""
    s = torch.tensor(list(shifts), dtype=torch.uint8, device=x.device).view(-1, 1)
    return (x.unsqueeze(-2) >> s) & mask


def _k_scale_min(sc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q4_k / q5_k's 12 scale bytes [n, 12] -> 6-bit scales and mins [n, 8] float32:
    j < 4: sc = b[j] & 63, m = b[j+4] & 63; j >= 4: sc = b[j+4] & 15 | (b[j-4] >> 6) << 4,
    m = b[j+4] >> 4 | (b[j] >> 6) << 4."""
    lo, mid, hi = sc[:, 0:4], sc[:, 4:8], sc[:, 8:12]
    scales = torch.cat((lo & 63, (hi & 15) | ((lo >> 6) << 4)), dim=1)
    mins = torch.cat((mid & 63, (hi >> 4) | ((mid >> 6) << 4)), dim=1)
    return scales.float(), mins.float()


def _q5_high(qh: torch.Tensor) -> torch.Tensor:
    """[n, 4] bytes of a little-endian u32 -> [n, 32] bit e."""
    return _bits(qh, range(8), 1).transpose(1, 2).reshape(qh.shape[0], 32)


def _codes(fmt: str, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """b [n, bytes] uint8, one block per row -> the block's integer codes q [n, groups, G] (float32,
    each within int8), and per group its scale and zero [n, groups] float32 (zero None where the
    format has none), with w = scale * q (+ zero) exactly as gguf-py dequantizes (G: 32, or 16 for
    q6_k, q2_k, q3_k)."""
    n = b.shape[0]
    if fmt in ("q5_0", "q5_1"):
        off = 4 if fmt == "q5_1" else 2
        q = (_nibbles(b[:, off + 4:off + 20]).reshape(n, 1, 32) | (_q5_high(b[:, off:off + 4]) << 4).reshape(n, 1, 32)).float()
        return (q - 16.0, _f16(b, 0), None) if fmt == "q5_0" else (q, _f16(b, 0), _f16(b, 2))
    if fmt == "iq4_nl":
        kv = torch.tensor(KVALUES, dtype=torch.float32, device=b.device)
        return kv[_nibbles(b[:, 2:18]).reshape(n, 1, 32).long()], _f16(b, 0), None
    if fmt in ("q4_k", "q5_k"):
        d, dmin = _f16(b, 0), _f16(b, 2)
        sc, m = _k_scale_min(b[:, 4:16])
        qs = b[:, 48:176] if fmt == "q5_k" else b[:, 16:144]
        q = _bits(qs.reshape(n, 4, 32), [0, 4], 15).reshape(n, 8, 32)  # [n, pair, nibble, 32] -> sub-blocks
        if fmt == "q5_k":
            q = q | (_bits(b[:, 16:48], range(8), 1) << 4)
        return q.float(), d * sc, -(dmin * m)
    if fmt == "q6_k":
        ql = _bits(b[:, 0:128].reshape(n, 2, 64), [0, 4], 15).reshape(n, 2, 128)
        qh = _bits(b[:, 128:192].reshape(n, 2, 32), [0, 2, 4, 6], 3).reshape(n, 2, 128)
        q = (ql | (qh << 4)).reshape(n, 16, 16).float() - 32.0
        return q, _f16(b, 208) * b[:, 192:208].contiguous().view(torch.int8).float(), None
    if fmt == "q2_k":
        s = b[:, 0:16]
        q = _bits(b[:, 16:80].reshape(n, 2, 32), [0, 2, 4, 6], 3).reshape(n, 16, 16).float()
        return q, _f16(b, 80) * (s & 15).float(), -(_f16(b, 82) * (s >> 4).float())
    if fmt == "q3_k":
        sc = b[:, 96:108]
        low = torch.cat((sc[:, 0:8] & 15, sc[:, 0:8] >> 4), dim=1)  # [n, 16]
        high = _bits(sc[:, 8:12], [0, 2, 4, 6], 3).reshape(n, 16)
        scales = (low | (high << 4)).float() - 32.0
        ql = _bits(b[:, 32:96].reshape(n, 2, 32), [0, 2, 4, 6], 3).reshape(n, 256)
        hbit = _bits(b[:, 0:32], range(8), 1).reshape(n, 256)
        q = (ql.float() - 4.0 * (1 - hbit).float()).reshape(n, 16, 16)
        return q, _f16(b, 108) * scales, None
    if fmt == "iq4_xs":
        sh = b[:, 2:4].contiguous().view(torch.int16).int() & 0xFFFF  # [n, 1]
        sl = torch.stack((b[:, 4:8] & 15, b[:, 4:8] >> 4), dim=-1).reshape(n, 8).int()
        hi = (sh >> torch.arange(0, 16, 2, device=b.device, dtype=torch.int32)) & 3
        ls = (sl | (hi << 4)).float() - 32.0
        kv = torch.tensor(KVALUES, dtype=torch.float32, device=b.device)
        return kv[_nibbles(b[:, 8:136]).long()], _f16(b, 0) * ls, None  # q [n, 8, 32]
    raise ValueError(f"not a block format: {fmt!r}")


def _dequant_blocks(fmt: str, b: torch.Tensor) -> torch.Tensor:
    """b [n, bytes] uint8, one block per row -> [n, elements] float32."""
    q, scale, zero = _codes(fmt, b)
    w = scale.unsqueeze(-1) * q
    return (w if zero is None else w + zero.unsqueeze(-1)).reshape(b.shape[0], -1)


def dequantize_blocks(fmt: TensorFormat, data: torch.Tensor, dtype: torch.dtype = torch.float32,
                      max_elements: int = 1 << 24) -> torch.Tensor:
    """Stored blocks [out, in/QK * bytes] uint8 -> the logical [out, in] tensor in `dtype`, a slab
    of rows at a time (the float32 temporaries stay near `max_elements`)."""
    elements, nbytes = BLOCK_FORMATS[fmt.format]
    rows, width = data.shape
    nb = width // nbytes
    out = torch.empty(rows, nb * elements, dtype=dtype, device=data.device)
    step = max(1, max_elements // max(1, nb * elements))
    for r in range(0, rows, step):
        slab = data[r:r + step].reshape(-1, nbytes)
        out[r:r + step] = _dequant_blocks(fmt.format, slab).reshape(-1, nb * elements).to(dtype)
    return out


INT4_CODED = ("q4_k", "q5_0", "q5_1")  # formats that are exact sums of int4 codes in groups of 32


def int4_codes(fmt: TensorFormat, data: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Blocks [out, in/QK * bytes] of an INT4_CODED format -> halves (q [out, in] int32 0..15,
    scale, zero [out, in/32] float32) with w = sum over halves of (q - 8) * scale + zero, exactly:
    the form of torch's packed int4 CPU kernel. q4_k is one half (scale d*sc, zero min + 8 scale);
    q5_0 / q5_1 split each 5-bit code into its high bit and low nibble (two halves)."""
    rows = data.shape[0]
    elements, nbytes = BLOCK_FORMATS[fmt.format]
    b = data.reshape(-1, nbytes)
    n = b.shape[0]
    if fmt.format == "q4_k":
        sc, m = _k_scale_min(b[:, 4:16])
        scale = _f16(b, 0) * sc
        zero = 8.0 * scale - _f16(b, 2) * m
        q = _bits(b[:, 16:144].reshape(n, 4, 32), [0, 4], 15).reshape(rows, -1)
        return [(q.int(), scale.reshape(rows, -1), zero.reshape(rows, -1))]
    if fmt.format not in ("q5_0", "q5_1"):
        raise ValueError(f"{fmt.format} is not an int4 code")
    off = 4 if fmt.format == "q5_1" else 2
    low = _nibbles(b[:, off + 4:off + 20]).reshape(rows, -1).int()
    high = _q5_high(b[:, off:off + 4]).reshape(rows, -1).int()
    # d rounded to bf16 first (the kernel keeps scales and zeros in bf16), so the multiples of d
    # below stay exact there: w = 16d hi + d lo + c, c = -16d (q5_0) or m (q5_1),
    # = [(hi - 8) 16d + 128d] + [(lo - 8) d + (8d + c)]
    d = _f16(b, 0).to(torch.bfloat16).float().reshape(rows, -1)
    c = -16.0 * d if fmt.format == "q5_0" else _f16(b, 2).reshape(rows, -1)
    return [(high, 16.0 * d, 128.0 * d), (low, d, 8.0 * d + c)]


def _pack_k_scales(sc: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """6-bit scales and mins [n, 8] (0..63) -> q4_k / q5_k's 12 bytes (the inverse of _k_scale_min)."""
    sc, m = sc.to(torch.uint8), m.to(torch.uint8)
    lo = (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6)
    mid = (m[:, :4] & 63) | ((m[:, 4:] >> 4) << 6)
    hi = (sc[:, 4:] & 15) | ((m[:, 4:] & 15) << 4)
    return torch.cat((lo, mid, hi), dim=1)


def _f16_bytes(x: torch.Tensor) -> torch.Tensor:
    """[n] float -> [n, 2] uint8 (f16, little endian)."""
    return x.to(torch.float16).reshape(-1, 1).view(torch.uint8)


def _quantize_q4_k(x: torch.Tensor) -> torch.Tensor:
    """[n, 256] float32 -> [n, 144] q4_k blocks: per sub-block of 32 a scale and a min from its range,
    both coded in 6 bits against the super-block's d and dmin, then round to nearest."""
    n = x.shape[0]
    sub = x.reshape(n, 8, 32)
    lo = sub.amin(-1).clamp(max=0.0)
    scale = (sub.amax(-1) - lo) / 15.0
    d = (scale.amax(-1) / 63.0).to(torch.float16).float()
    dmin = ((-lo).amax(-1) / 63.0).to(torch.float16).float()
    sc = torch.where(d[:, None] > 0, scale / d[:, None].clamp(min=1e-30), 0.0).round().clamp(0, 63)
    m = torch.where(dmin[:, None] > 0, -lo / dmin[:, None].clamp(min=1e-30), 0.0).round().clamp(0, 63)
    step = (d[:, None] * sc).unsqueeze(-1)
    q = torch.where(step > 0, (sub + (dmin[:, None] * m).unsqueeze(-1)) / step.clamp(min=1e-30), 0.0)
    q = q.round().clamp(0, 15).to(torch.uint8).reshape(n, 4, 2, 32)
    qs = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(n, 128)
    return torch.cat((_f16_bytes(d), _f16_bytes(dmin), _pack_k_scales(sc, m), qs), dim=1)


def _quantize_q6_k(x: torch.Tensor) -> torch.Tensor:
    """[n, 256] float32 -> [n, 210] q6_k blocks: per 16 a signed 8-bit scale against d, round to nearest."""
    n = x.shape[0]
    sub = x.reshape(n, 16, 16)
    s = sub.abs().amax(-1) / 31.0
    d = (s.amax(-1) / 127.0).to(torch.float16).float()
    sc = torch.where(d[:, None] > 0, s / d[:, None].clamp(min=1e-30), 0.0).round().clamp(-128, 127)
    step = (d[:, None] * sc).unsqueeze(-1)
    q = torch.where(step != 0, sub / torch.where(step != 0, step, 1.0), 0.0).round().clamp(-32, 31) + 32
    q = q.to(torch.uint8).reshape(n, 2, 128)  # [n, h, r]
    low, high = q & 15, q >> 4
    ql = (low[:, :, :64] | (low[:, :, 64:] << 4)).reshape(n, 128)
    h4 = high.reshape(n, 2, 4, 32)
    qh = (h4[:, :, 0] | (h4[:, :, 1] << 2) | (h4[:, :, 2] << 4) | (h4[:, :, 3] << 6)).reshape(n, 64)
    return torch.cat((ql, qh, sc.to(torch.int8).view(torch.uint8), _f16_bytes(d)), dim=1)


_QUANTIZERS = {"q4_k": _quantize_q4_k, "q6_k": _quantize_q6_k}


def quantize_blocks(fmt: TensorFormat, w: torch.Tensor) -> torch.Tensor:
    """A float [out, in] weight -> stored blocks, round to nearest (synthetic weights and tests; not
    llama.cpp's searched quantization). q4_k and q6_k only."""
    if fmt.format not in _QUANTIZERS:
        raise ValueError(f"no quantizer for {fmt.format} (ninfer quantizes only to {', '.join(_QUANTIZERS)})")
    elements, nbytes = BLOCK_FORMATS[fmt.format]
    rows, cols = w.shape
    if cols % elements:
        raise ValueError(f"input width {cols} is not a multiple of the {fmt.format} block size {elements}")
    blocks = _QUANTIZERS[fmt.format](w.float().reshape(-1, elements))
    return blocks.reshape(rows, cols // elements * nbytes).contiguous()


def code_group(fmt: TensorFormat) -> int:
    """Inputs per scale (and zero) of a block format's codes (`int8_codes`)."""
    return 16 if fmt.format in ("q6_k", "q2_k", "q3_k") else 32


def int8_codes(fmt: TensorFormat, data: torch.Tensor,
               max_elements: int = 1 << 24) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Stored blocks [out, in/QK * bytes] of any block format -> (q [out, in] int8, scale [out, in/G]
    float32, zero [out, in/G] float32 or None), G = code_group(fmt): w = scale * q (+ zero) exactly
    (the int8 form of the CPU decode kernel), a slab of rows at a time."""
    elements, nbytes = BLOCK_FORMATS[fmt.format]
    rows, width = data.shape
    k = width // nbytes * elements
    g = code_group(fmt)
    q = torch.empty(rows, k, dtype=torch.int8, device=data.device)
    scale = torch.empty(rows, k // g, dtype=torch.float32, device=data.device)
    zero = None
    step = max(1, max_elements // max(1, k))
    for r in range(0, rows, step):
        slab = data[r:r + step]
        cq, cs, cz = _codes(fmt.format, slab.reshape(-1, nbytes))
        n = slab.shape[0]
        q[r:r + n] = cq.reshape(n, k).to(torch.int8)
        scale[r:r + n] = cs.reshape(n, k // g)
        if cz is not None:
            if zero is None:
                zero = torch.empty(rows, k // g, dtype=torch.float32, device=data.device)
            zero[r:r + n] = cz.reshape(n, k // g)
    return q, scale, zero
