"""Typed launchers: one function per kernel, checking dtypes, shapes, strides, contiguity,
alignment and device before launching on the current torch stream.

Tensors are plain torch storage; kernels get `.data_ptr()`. Every launcher takes the
`KernelCompiler` of the device first (config flows in explicitly; no module state). Importing
this module needs no CUDA: only a launch does. Outputs are written, never allocated, except the
split-K workspace of decode attention when none is passed.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Sequence

import torch

from ninfer.formats import TensorFormat
from ninfer.kernels.compiler import F32, I32, I64, KernelError, ptr

if TYPE_CHECKING:
    from ninfer.kernels.compiler import KernelCompiler

BF16, F16, F32_DT, I32_DT = torch.bfloat16, torch.float16, torch.float32, torch.int32
MAX_GEMV_ROWS = 8
TOPK_MAX = 20
GEMV_WARPS = 8  # gemv.cu
ATTN_THREADS = 128  # attention.cu: NWARPS * 32
# attention_decode_mma.cu's warps per block (a partition's 16-key steps go round them): one value for
# every launch, since it orders the sums (batch invariance). 8 measured no faster than 4 (docs/PERF.md)
ATTN_MMA_WARPS = 4
# attention_decode_mma.cu's ATTN_PF: a warp's L2 prefetch of its K / V rows that many steps ahead (speed
# only, the same bits); 0 (off) until timed on a GPU (scripts/decode_variants.py label fN)
ATTN_PREFETCH = 0
# attention_decode_mma.cu's ATTN_EARLY: the lengths, positions and block table read, and the warps' first
# K / V rows and the RoPE row asked of L2, before the PDL wait (speed only, the same bits). H100, llama-8b
# tg128 (session 27, alternated twice): bf16 167.4 / 167.7 -> 168.8 / 168.7 tok/s, int4 424.6 / 424.1 ->
# 427.0 / 427.0, bf16 at a 16k context 143.1 -> 143.8 (decode_variants.py label a)
ATTN_EARLY = True
# gemv_mma.cu's MMA_L2PF and gemv_tiled.cu's T4_L2PF: a block asks L2 for up to this many 128-byte lines
# a thread of its weights before its PDL wait, so they stream while the kernel before finishes (speed
# only, the same bits). None: the rules (mma_variant: one line for bf16; tiled_variant: none); a number
# sets it for every mma and tiled launch (scripts/decode_variants.py label wN). H100, llama-8b tg128
# (docs/PERF.md, session 25): bf16 170.8 -> 176.1 tok/s with 1 line, 165.3 with 2, 140.8 with 4;
# int4 (tiled) 420.5 -> 396.3 with 1, 382.1 with 4.
WEIGHT_PREFETCH: int | None = None
# gemv_tiled.cu's T4_DQ for asym int4 in groups of 32 (Q4_1's shape): the nibbles dequantized to bf16 in
# registers (one bf16x2 fma a pair) and the mmas accumulating into the tile's sums, 165 instructions a KB
# against 181 (scripts/sass_count.py). H100, llama-8b int4 tg128 (session 26): 419.8 / 419.2 -> 435.1 / 435.7
# tok/s (+3.8 %), but the scale and m - 16 s rounded to bf16 put ~1 % (relative, random weights) on the
# gemv's output, a sixth of the 4-bit rounding's own: off (decode_variants.py label q).
TILED_DQ = False
# gemv_tiled.cu's T4_F16 for int8: the mmas in fp16 (a byte permute and an fp16 add give two exact weights,
# one mma a word pair where bf16 needs two), the activations scaled by 2^-8 and converted per slab (exact
# up to ~1.7e7; Gemma's MLP inputs pass fp16's 65,504), 114 instructions a KB against 138. H100, llama-8b
# int8 tg128 (session 27, alternated twice): 303.2 / 303.5 -> 310.6 / 310.2 tok/s (+2.3 %; label h)
TILED_F16 = True
# gemv_tiled.cu's T4_XSMEM: a block's activations copied once into shared memory (cp.async, after the PDL
# wait) where their M (K + 8) * 2 bytes fit TILED_XSMEM_BYTES, the slabs reading them there (speed only, the
# same bits). Nsight Compute (docs/PERF.md, session 27) has the tiled gemvs stalled on global loads. H100
# kernel sweep at the rule's own settings (session 28, scripts/gpu_int4_ab.py --on-rule): one int4 row of
# many outputs gains (lm_head 128256 x 4096: 127.3 -> 109.1 us, gate_up 29.0 -> 28.0), small shapes, two
# rows and int8 lose up to 37 %; so the rule takes it for int4, one row, N >= XSMEM_MIN_N only (label z0:
# never; a variant's T4_XSMEM 1: wherever it fits)
TILED_XSMEM = True
XSMEM_MIN_N = 16384
TILED_XSMEM_BYTES = 32 << 10
# gemv_tiled.cu defines over tiled_variant's for every int4 tiled launch (T4_STAGES, T4_XPRE, T4_MINB): the
# tuning scripts' override (decode_variants.py labels tN, xN, bN); speed only, the same bits
TILED_DEFINES: dict[str, int] = {}
ATTN_MAX_SPLIT = 32  # attention.cu: the most partitions a token's keys are cut into
ATTN_SPLIT_MIN = 256  # attention_split.cuh: a context of at most this many keys is one partition
SAMPLE_THREADS = 512  # sampling.cu
GEMV_FORMATS = {"bf16": 0, "int8": 1, "int4_sym": 2, "int4_asym": 3, "f32": 4}
GEMV_CHUNK = {0: 8, 1: 16, 2: 32, 3: 32, 4: 4}  # weights a lane reads per 16-byte load
# gemv routes: "warp" (gemv.cu: a warp per output, CUDA cores, every format and activation dtype),
# "mma" (gemv_mma.cu: tensor cores, bf16 activations, bf16 / int4 weights with K in 32s, int8 with K
# in 64s; group sizes powers of two from 32 / 16) and "tiled" (gemv_tiled.cu: tensor cores, int4 only,
# weights re-laid in 16-row x 64-k tiles streamed several slabs deep; N in 16s, K in 64s, group sizes
# powers of two from 32)
GEMV_ROUTES = ("warp", "mma", "tiled")
MMA_WARPS = 8  # gemv_mma.cu
TILED_WARPS = 8  # gemv_tiled.cu's warps per block unless a variant names T4_WARPS
ACT_DTYPES = (BF16, F32_DT)  # activations: bf16, or fp32 (modules compiled with ACT_F32=1)


def _act(dtype: torch.dtype, name: str) -> dict[str, int]:
    """The compile defines for activations of `dtype` (the dtype of tensor `name`)."""
    if dtype not in ACT_DTYPES:
        raise KernelError(f"{name} must be bfloat16 or float32 (the activation dtypes), got {dtype}")
    return {"ACT_F32": 1} if dtype == F32_DT else {}


def _check(t: torch.Tensor, name: str, dtype: torch.dtype, shape: Sequence[int | None], device: int,
           contiguous: bool = True, align16: bool = False) -> None:
    """dtype, rank and sizes (None: any), device, and contiguity (or a unit last stride)."""
    # the common case in few tensor calls (a prompt forward runs ~25 of these a layer), the
    # messages below only where it fails
    if isinstance(t, torch.Tensor) and t.dtype == dtype and t.get_device() == device:
        size = t.shape
        if (len(size) == len(shape) and all(s is None or s == d for s, d in zip(shape, size))
                and (t.is_contiguous() if contiguous else not size or t.stride(-1) == 1)
                and not (align16 and t.data_ptr() % 16)):
            return
    if not isinstance(t, torch.Tensor):
        raise KernelError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != dtype:
        raise KernelError(f"{name} must be {dtype}, got {t.dtype}")
    if t.dim() != len(shape) or any(s is not None and s != d for s, d in zip(shape, t.shape)):
        want = ", ".join("*" if s is None else str(s) for s in shape)
        raise KernelError(f"{name} must have shape [{want}], got {list(t.shape)}")
    if t.device.type != "cuda" or t.device.index != device:
        raise KernelError(f"{name} must be on cuda:{device}, got {t.device}")
    if contiguous and not t.is_contiguous():
        raise KernelError(f"{name} must be contiguous")
    if not contiguous and t.dim() > 0 and t.stride(-1) != 1:
        raise KernelError(f"{name} must have a unit last stride, got strides {t.stride()}")
    if align16 and t.data_ptr() % 16:
        raise KernelError(f"{name} must start on a 16-byte boundary")


def _rows(t: torch.Tensor, name: str, width: int) -> int:
    """Row stride (elements) of a 2-D row-major view whose rows are 16-byte aligned."""
    if t.stride(-1) != 1 or (t.dim() == 2 and t.shape[0] > 1 and t.stride(0) < width):
        raise KernelError(f"{name} must be row-major with unit element stride, got strides {t.stride()}")
    stride = t.stride(0) if t.dim() == 2 else width
    if (stride * t.element_size()) % 16:
        raise KernelError(f"{name} row stride {stride} is not a multiple of 16 bytes")
    return stride


def embedding(kc: KernelCompiler, ids: torch.Tensor, table: torch.Tensor, out: torch.Tensor) -> None:
    """out[t] = table[ids[t]]; ids [T] int32, table [V, H] and out [T, H] bf16 or fp32 (the same), H % 8 == 0."""
    V, H = table.shape
    T = ids.shape[0]
    defines = _act(out.dtype, "out")
    _check(ids, "ids", I32_DT, [T], kc.device)
    _check(table, "table", out.dtype, [V, H], kc.device, align16=True)
    _check(out, "out", out.dtype, [T, H], kc.device, align16=True)
    if H % 8:
        raise KernelError(f"hidden size {H} must be a multiple of 8")
    if T:
        kc.kernel("elementwise.cu", "embedding", defines).launch(
            (T, 1, 1), (128, 1, 1), [ptr(ids), ptr(table), ptr(out), I32(V), I32(H)])


def embedding_quant(kc: KernelCompiler, ids: torch.Tensor, fmt: TensorFormat, parts: dict[str, torch.Tensor],
                    out: torch.Tensor) -> None:
    """Gather rows of a groupwise int8/int4 table (quant.py parts '', '.scales', '.mins') into out [T, H]
    (bf16 or fp32)."""
    if not fmt.quantized:
        raise KernelError(f"embedding_quant needs an int8/int4 table, got {fmt.format}")
    T, H = out.shape
    q, g = parts[""], fmt.group_size
    V = q.shape[0]
    kind = 0 if fmt.format == "int8" else (1 if fmt.symmetric else 2)
    _check(ids, "ids", I32_DT, [T], kc.device)
    _check(q, "table", torch.int8 if kind == 0 else torch.uint8, [V, H if kind == 0 else H // 2], kc.device)
    _check(parts[".scales"], "scales", F16, [V, H // g], kc.device)
    mins = parts.get(".mins") if kind == 2 else None
    if kind == 2:
        _check(mins, "mins", F16, [V, H // g], kc.device)
    defines = _act(out.dtype, "out")
    _check(out, "out", out.dtype, [T, H], kc.device, align16=True)
    if H % 8 or g % 8 or H % g:
        raise KernelError(f"hidden size {H} and group size {g} must be multiples of 8, and H of g")
    if q.data_ptr() % 8:
        raise KernelError("table must start on an 8-byte boundary")
    if T:
        kc.kernel("elementwise.cu", "embedding_quant", defines).launch(
            (T, 1, 1), (128, 1, 1),
            [ptr(ids), ptr(q), ptr(parts[".scales"]), ptr(mins), ptr(out), I32(V), I32(H), I32(g), I32(kind)])


def rmsnorm_residual(kc: KernelCompiler, x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, eps: float,
                     residual: torch.Tensor | None = None) -> None:
    """out = rmsnorm(x) * weight; with `residual`: residual += x first and out = rmsnorm(residual) * weight.

    x, residual, out: [T, H] row-major (row strides may exceed H); weight [H]; all bf16 or all fp32.
    """
    T, H = x.shape
    defines = _act(x.dtype, "x")
    _check(x, "x", x.dtype, [T, H], kc.device, contiguous=False, align16=True)
    _check(weight, "weight", x.dtype, [H], kc.device, align16=True)
    _check(out, "out", x.dtype, [T, H], kc.device, contiguous=False, align16=True)
    if H % 8:
        raise KernelError(f"hidden size {H} must be a multiple of 8")
    res_stride = 0
    if residual is not None:
        _check(residual, "residual", x.dtype, [T, H], kc.device, contiguous=False, align16=True)
        res_stride = _rows(residual, "residual", H)
        if residual.data_ptr() == out.data_ptr() or residual.data_ptr() == x.data_ptr():
            raise KernelError("residual must not alias x or out")
    if T:
        kc.kernel("elementwise.cu", "rmsnorm_residual", defines).launch(
            (T, 1, 1), (rmsnorm_threads(H), 1, 1),
            [ptr(x), ptr(residual), ptr(weight), ptr(out), I32(H), I64(_rows(x, "x", H)), I64(res_stride),
             I64(_rows(out, "out", H)), F32(eps)])


def rmsnorm_threads(H: int) -> int:
    """rmsnorm_residual's block size for rows of H: its order of additions (the fused gemv epilogue,
    GEMV_NORM, uses the same count to give the same bits)."""
    return 256 if H >= 2048 else 128


def norm_epilogue(kc: KernelCompiler, y: torch.Tensor, M: int, N: int, norm: tuple | None) -> tuple[dict[str, int], list]:
    """Checks the residual RMSNorm a gemv may fuse into its epilogue (common.cuh GEMV_NORM) ->
    (compile defines, extra kernel arguments); norm None: ({}, []). norm = (residual [M, N],
    weight [N], normed [M, N], eps, counter [1] int32 zero between launches): the kernel's output y
    [M, N] (act) then goes through rmsnorm_residual(y, weight, normed, eps, residual=residual)."""
    if norm is None:
        return {}, []
    residual, weight, normed, eps, counter = norm
    act = y.dtype
    _check(weight, "norm weight", act, [N], kc.device, align16=True)
    for name, t in (("residual", residual), ("normed", normed)):
        _check(t, name, act, [M, N], kc.device, contiguous=False, align16=True)
    _check(counter, "counter", I32_DT, [1], kc.device)
    if N % 8 or (y.stride(0) * y.element_size()) % 16 or y.data_ptr() % 16:
        raise KernelError(f"a fused norm needs N ({N}) in 8s and 16-byte aligned output rows")
    if residual.data_ptr() in (y.data_ptr(), normed.data_ptr()):
        raise KernelError("residual must not alias the gemv output or the normed rows")
    return {"GEMV_NORM": 1}, [ptr(residual), I64(_rows(residual, "residual", N)), ptr(weight), ptr(normed),
                              I64(_rows(normed, "normed", N)), F32(eps), I32(rmsnorm_threads(N)), ptr(counter)]


def swiglu(kc: KernelCompiler, gate_up: torch.Tensor, out: torch.Tensor, interleaved: bool = False) -> None:
    """out [T, I] = silu(gate_up[:, :I]) * gate_up[:, I:]; bf16 or fp32 (both the same), I % 8 == 0.
    interleaved: gate_up's columns are in glu_rows' order (gate and up in alternating eights)."""
    _gated(kc, "swiglu", gate_up, out, interleaved)


def geglu(kc: KernelCompiler, gate_up: torch.Tensor, out: torch.Tensor, interleaved: bool = False) -> None:
    """out [T, I] = gelu_tanh(gate_up[:, :I]) * gate_up[:, I:]; bf16 or fp32 (both the same), I % 8 == 0."""
    _gated(kc, "geglu", gate_up, out, interleaved)


GLU_ACTIVATIONS = {"silu": 1, "gelu_tanh": 2}  # a gated MLP's activation -> common.cuh's GEMV_GLU


def glu_rows(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The rows of a gated MLP's gate [I, ...] and up [I, ...] projections (any stored part: codes,
    scales, mins, block bytes) interleaved in eights, gate 8j .. 8j + 7 then up 8j .. 8j + 7: the order
    in which the fused gemv epilogue (common.cuh tile_epilogue, GEMV_GLU) finds a gate row and its up
    row in one lane. I % 8 == 0."""
    I = gate.shape[0]
    if up.shape != gate.shape or I % 8:
        raise KernelError(f"gate {list(gate.shape)} and up {list(up.shape)} must match, with rows in 8s")
    return torch.stack((gate.reshape(I // 8, 8, -1), up.reshape(I // 8, 8, -1)), 1).reshape(2 * I, *gate.shape[1:])


def _gated(kc: KernelCompiler, kernel: str, gate_up: torch.Tensor, out: torch.Tensor, interleaved: bool) -> None:
    T, I2 = gate_up.shape
    inter = I2 // 2
    defines = _act(gate_up.dtype, "gate_up")
    _check(gate_up, "gate_up", gate_up.dtype, [T, 2 * inter], kc.device, contiguous=False, align16=True)
    _check(out, "out", gate_up.dtype, [T, inter], kc.device, contiguous=False, align16=True)
    if I2 % 2 or inter % 8:
        raise KernelError(f"gate_up width {I2} must be 2 * I with I a multiple of 8")
    n = T * inter // 8
    if n:
        blocks = min(math.ceil(n / 256), 132 * 16)
        kc.kernel("elementwise.cu", kernel, defines).launch(
            (blocks, 1, 1), (256, 1, 1),
            [ptr(gate_up), ptr(out), I32(T), I32(inter), I64(_rows(gate_up, "gate_up", I2)),
             I64(_rows(out, "out", inter)), I32(int(interleaved))])


def rope_cos_sin(head_dim: int, max_positions: int, theta: float, device: torch.device | str,
                 inv_freq: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 tables [max_positions, head_dim/2] for rope_kv_write (pass inv_freq for scaled RoPE)."""
    if inv_freq is None:
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    freqs = torch.outer(torch.arange(max_positions, dtype=torch.float64), inv_freq.to(torch.float64))
    return freqs.cos().to(torch.float32).to(device), freqs.sin().to(torch.float32).to(device)


def rope_kv_write(kc: KernelCompiler, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                  sin: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None,
                  eps: float = 1e-6, rotary_dim: int | None = None) -> None:
    """Rotate q in place and write rotated k and v into the paged cache at slot_mapping[t].

    q [T, Hq, D], k/v [T, Hkv, D] (token strides free, heads packed); cos/sin [P, rotary_dim/2] fp32;
    positions, slot_mapping [T] int32 (slot < 0: no write); caches [pages, page_size, Hkv, D];
    q_norm/k_norm [D]: per-head RMSNorm before RoPE (qwen3), both or neither. q, k, v, the caches
    and the norms are all bf16 or all fp32. rotary_dim (default D, a multiple of 4): only the first
    rotary_dim dims of each head rotate (partial rotary, qwen3.5); the rest pass through, normed.
    """
    T, Hq, D = q.shape
    R = D if rotary_dim is None else rotary_dim
    Hkv = k.shape[1]
    act, defines = q.dtype, _act(q.dtype, "q")
    pair = 2 * q.element_size()  # a lane moves two activations at a time
    for name, t, heads in (("q", q, Hq), ("k", k, Hkv), ("v", v, Hkv)):
        _check(t, name, act, [T, heads, D], kc.device, contiguous=False)
        if t.stride(1) != D or t.stride(0) < heads * D or t.data_ptr() % pair or t.stride(0) % 2:
            raise KernelError(f"{name} must have packed heads and {pair}-byte aligned rows, got strides {t.stride()}")
    if D % 4:
        raise KernelError(f"head_dim {D} must be a multiple of 4")
    if not 0 < R <= D or R % 4:
        raise KernelError(f"rotary_dim {R} must be a multiple of 4 in (0, head_dim {D}]")
    _check(cos, "cos", F32_DT, [None, R // 2], kc.device)
    _check(sin, "sin", F32_DT, list(cos.shape), kc.device)
    _check(positions, "positions", I32_DT, [T], kc.device)
    _check(slot_mapping, "slot_mapping", I32_DT, [T], kc.device)
    _check(k_cache, "k_cache", act, [None, None, Hkv, D], kc.device)
    _check(v_cache, "v_cache", act, list(k_cache.shape), kc.device)
    if (q_norm is None) != (k_norm is None):
        raise KernelError("pass both q_norm and k_norm, or neither")
    if q_norm is not None:
        _check(q_norm, "q_norm", act, [D], kc.device)
        _check(k_norm, "k_norm", act, [D], kc.device)
    if T:
        kc.kernel("rope_kv.cu", "rope_kv_write", defines).launch(
            (T, 1, 1), (128, 1, 1),
            [ptr(q), ptr(k), ptr(v), ptr(cos), ptr(sin), ptr(positions), ptr(slot_mapping), ptr(k_cache),
             ptr(v_cache), ptr(q_norm), ptr(k_norm), I32(Hq), I32(Hkv), I32(D), I32(R), I64(q.stride(0)),
             I64(k.stride(0)), I64(v.stride(0)), F32(eps)])


KV_CODE_DTYPES = {torch.int8: 0, torch.float8_e4m3fn: 1}  # compressed KV caches -> KV_FP8


def _kv_codes(k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: torch.Tensor | None,
              v_scale: torch.Tensor | None, device: int) -> dict[str, int]:
    """Checks a compressed cache (int8 or e4m3 codes, f16 scales [pages, page_size, Hkv]) -> its defines."""
    if k_cache.dtype not in KV_CODE_DTYPES:
        raise KernelError(f"a compressed KV cache is int8 or float8_e4m3fn, got {k_cache.dtype}")
    pages, page_size, Hkv, D = k_cache.shape
    _check(k_cache, "k_cache", k_cache.dtype, [pages, page_size, Hkv, D], device)
    _check(v_cache, "v_cache", k_cache.dtype, list(k_cache.shape), device)
    if k_scale is None or v_scale is None:
        raise KernelError("a compressed KV cache needs k_scale and v_scale")
    _check(k_scale, "k_scale", F16, [pages, page_size, Hkv], device)
    _check(v_scale, "v_scale", F16, [pages, page_size, Hkv], device)
    return {"KV_QUANT": 1, "KV_FP8": KV_CODE_DTYPES[k_cache.dtype]}


def kv_quantize_write(kc: KernelCompiler, k_rows: torch.Tensor, v_rows: torch.Tensor, slot_mapping: torch.Tensor,
                      k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: torch.Tensor,
                      v_scale: torch.Tensor) -> None:
    """Store new K and V rows [T, Hkv, D] (act, contiguous) into a compressed paged cache at
    slot_mapping[t] (negative: skipped): per row an f16 scale amax / (127 int8, 448 e4m3) and the
    codes of x / scale (int8: round half to even, clamped; e4m3: cvt.rn.satfinite)."""
    T, Hkv, D = k_rows.shape
    act = k_rows.dtype
    _check(k_rows, "k_rows", act, [T, Hkv, D], kc.device)
    _check(v_rows, "v_rows", act, [T, Hkv, D], kc.device)
    _check(slot_mapping, "slot_mapping", I32_DT, [T], kc.device)
    defines = {**_act(act, "k_rows"), **_kv_codes(k_cache, v_cache, k_scale, v_scale, kc.device)}
    defines.pop("KV_QUANT")
    if k_cache.shape[2:] != (Hkv, D):
        raise KernelError(f"the cache holds [{k_cache.shape[2]}, {k_cache.shape[3]}] per token, the rows [{Hkv}, {D}]")
    if T:
        kc.kernel("kv_quant.cu", "kv_quantize_write", defines).launch(
            (T, 2 * Hkv, 1), (32, 1, 1),
            [ptr(k_rows), ptr(v_rows), ptr(slot_mapping), ptr(k_cache), ptr(v_cache), ptr(k_scale), ptr(v_scale),
             I32(Hkv), I32(D)])


def _attention_checks(kc: KernelCompiler, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      block_tables: torch.Tensor, cu_seqlens: torch.Tensor | None, lens: torch.Tensor,
                      out: torch.Tensor, k_scale: torch.Tensor | None = None,
                      v_scale: torch.Tensor | None = None) -> dict[str, int]:
    """Validate paged-attention inputs; the kernels' compile defines (a compressed cache adds KV_QUANT)."""
    T, Hq, D = q.shape
    _, page_size, Hkv, _ = k_cache.shape
    B = block_tables.shape[0]
    act = q.dtype
    defines = {"HEAD_DIM": D, "GQA": Hq // Hkv, "MAX_SPLIT": ATTN_MAX_SPLIT, "SPLIT_MIN": ATTN_SPLIT_MIN, **_act(act, "q")}
    for name, t in (("q", q), ("out", out)):
        _check(t, name, act, [T, Hq, D], kc.device, contiguous=False, align16=True)
        if t.stride(1) != D or (t.stride(0) * t.element_size()) % 16:
            raise KernelError(f"{name} must have packed heads and 16-byte aligned rows, got strides {t.stride()}")
    if k_cache.dtype in KV_CODE_DTYPES:
        defines.update(_kv_codes(k_cache, v_cache, k_scale, v_scale, kc.device))
    else:
        _check(k_cache, "k_cache", act, [None, None, Hkv, D], kc.device, align16=True)
        _check(v_cache, "v_cache", act, list(k_cache.shape), kc.device, align16=True)
    _check(block_tables, "block_tables", I32_DT, [B, None], kc.device)
    _check(lens, "context_lens" if cu_seqlens is None else "start_pos", I32_DT, [B], kc.device)
    if cu_seqlens is not None:
        _check(cu_seqlens, "cu_seqlens", I32_DT, [B + 1], kc.device)
    elif B != T:
        raise KernelError(f"decode has one query token per sequence: {T} tokens for {B} sequences")
    if D not in (64, 128, 256):
        raise KernelError(f"head_dim {D} not supported (64, 128, 256)")
    if Hq % Hkv or (Hq // Hkv) * D > 2048:
        raise KernelError(f"{Hq} query heads over {Hkv} kv heads: need a whole group of at most {2048 // D}")
    return defines


def attention_parts(max_context_len: int, partition: int) -> int:
    """The split-K grid (and workspace) depth that covers every context up to max_context_len keys:
    a context of n keys is cut into min(ATTN_MAX_SPLIT, ceil(n / partition)) partitions, one of at
    most ATTN_SPLIT_MIN keys is not cut."""
    if max_context_len <= ATTN_SPLIT_MIN:
        return 1
    return max(1, min(ATTN_MAX_SPLIT, math.ceil(max_context_len / partition)))


ATTN_DECODE_ROUTES = ("warp", "mma")  # attention.cu (CUDA cores) or attention_decode_mma.cu (tensor cores)


def attention_decode_route_ok(route: str, act_dtype: torch.dtype, head_dim: int, gqa: int, page_size: int,
                              compressed: bool = False) -> bool:
    """Whether the decode attention `route` takes activations of act_dtype at this head_dim, group size
    (query heads per kv head) and page size, over a compressed (int8 / fp8 codes) cache or not."""
    if route == "mma":
        return (act_dtype == BF16 and head_dim in (64, 128) and 1 <= gqa <= 8 and not compressed
                and page_size > 0 and page_size & (page_size - 1) == 0)
    return route == "warp"


def _attention(kc: KernelCompiler, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               block_tables: torch.Tensor, cu_seqlens: torch.Tensor | None, lens: torch.Tensor,
               max_context_len: int, out: torch.Tensor, scale: float, partition: int,
               workspace: tuple[torch.Tensor, torch.Tensor] | None, window: int = 0, softcap: float = 0.0,
               k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
               rope: list | None = None, route: str = "warp") -> None:
    defines = _attention_checks(kc, q, k_cache, v_cache, block_tables, cu_seqlens, lens, out, k_scale, v_scale)
    if rope is not None:  # rope_attention_decode's arguments, checked there
        defines["ROPE_KV"] = 1
    T, Hq, D = q.shape
    _, page_size, Hkv, _ = k_cache.shape
    if route not in ATTN_DECODE_ROUTES:
        raise KernelError(f"decode attention route must be one of {', '.join(ATTN_DECODE_ROUTES)}, got {route!r}")
    if route == "mma" and not attention_decode_route_ok(route, q.dtype, D, Hq // Hkv, page_size, k_scale is not None):
        raise KernelError(f"the mma decode attention takes bfloat16 caches (not compressed), head_dim 64 or 128, "
                          f"at most 8 query heads per kv head and pages of a power of two keys; got {k_cache.dtype}, "
                          f"head_dim {D}, {Hq // Hkv} heads per kv head, pages of {page_size}")
    B = block_tables.shape[0]
    if partition <= 0 or max_context_len < 0:
        raise KernelError("partition must be positive and max_context_len non-negative")
    if window < 0 or softcap < 0:
        raise KernelError(f"window ({window}) and softcap ({softcap}) must be >= 0 (0: none)")
    if T == 0:
        return
    max_parts = attention_parts(max_context_len, partition)
    if workspace is None and max_parts > 1:
        workspace = (torch.empty((T, Hq, max_parts, D), dtype=F32_DT, device=q.device),
                     torch.empty((T, Hq, max_parts, 2), dtype=F32_DT, device=q.device))
    if max_parts > 1:
        _check(workspace[0], "workspace[0]", F32_DT, [None, Hq, None, D], kc.device)
        _check(workspace[1], "workspace[1]", F32_DT, [None, Hq, None, 2], kc.device)
        if workspace[0].shape[0] < T or workspace[0].shape[2] != max_parts or workspace[1].shape[:3] != workspace[0].shape[:3]:
            raise KernelError(f"workspace must be [>= {T}, {Hq}, {max_parts}, {D}] and [.., 2]")
    part_out, part_ml = workspace if max_parts > 1 else (None, None)
    seq_args = [ptr(cu_seqlens), ptr(lens), I32(B)]
    head = [ptr(out), I64(out.stride(0)), ptr(part_out), ptr(part_ml), I32(max_parts), I32(Hkv)]
    tail = [I32(partition), F32(scale), I32(window), F32(softcap), *(rope or [])]
    if route == "mma":  # decode only (the callers pass cu_seqlens=None)
        pf = {**({"ATTN_PF": ATTN_PREFETCH} if ATTN_PREFETCH else {}), **({"ATTN_EARLY": 1} if ATTN_EARLY else {})}
        kc.kernel("attention_decode_mma.cu", "paged_attention_decode_mma", {**defines, "NW": ATTN_MMA_WARPS, **pf}).launch(
            (Hkv, T, max_parts), (32 * ATTN_MMA_WARPS, 1, 1),
            [ptr(q), I64(q.stride(0)), ptr(k_cache), ptr(v_cache), ptr(block_tables), I32(block_tables.shape[1]),
             ptr(lens), *head, I32(page_size.bit_length() - 1), *tail])
    else:
        kc.kernel("attention.cu", "paged_attention", defines).launch(
            (Hkv, T, max_parts), (ATTN_THREADS, 1, 1),
            [ptr(q), I64(q.stride(0)), ptr(k_cache), ptr(v_cache), ptr(k_scale), ptr(v_scale), ptr(block_tables),
             I32(block_tables.shape[1]), *seq_args, *head, I32(page_size), *tail])
    if max_parts > 1:
        kc.kernel("attention.cu", "paged_attention_combine", defines).launch(
            (Hq, T, 1), (D, 1, 1),
            [ptr(part_out), ptr(part_ml), *seq_args, ptr(out), I64(out.stride(0)), I32(max_parts), I32(partition),
             I32(window)])


def paged_attention_decode(kc: KernelCompiler, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, max_context_len: int,
                           out: torch.Tensor, scale: float, partition: int = 512,
                           workspace: tuple[torch.Tensor, torch.Tensor] | None = None, window: int = 0,
                           softcap: float = 0.0, k_scale: torch.Tensor | None = None,
                           v_scale: torch.Tensor | None = None, route: str = "warp") -> None:
    """One query token per sequence attends its whole context (context_lens[b] keys, this token's included).

    q, out [B, Hq, D] and caches [pages, page_size, Hkv, D]: all bf16 or all fp32; block_tables [B, max_pages] int32;
    context_lens [B] int32; max_context_len: a host bound on context_lens, sizing the split-K grid.
    Contexts longer than ATTN_SPLIT_MIN and `partition` keys are split into min(ATTN_MAX_SPLIT, ceil(n / partition))
    equal partitions and merged in a fixed order; the split depends only on each sequence's own
    length, so results are batch-invariant. `workspace` (optional, reusable, e.g. under CUDA
    graphs): fp32 [>= B, Hq, attention_parts(max_context_len, partition), D] and [.., 2].
    window > 0: each sequence sees only its last `window` keys; softcap > 0: scores soft-capped.
    A compressed cache (int8 or float8_e4m3fn codes) comes with k_scale/v_scale f16 [pages, page_size, Hkv].
    route: ATTN_DECODE_ROUTES ("mma" where attention_decode_route_ok; its bits differ from "warp"'s).
    """
    _attention(kc, q, k_cache, v_cache, block_tables, None, context_lens, max_context_len, out, scale,
               partition, workspace, window, softcap, k_scale, v_scale, route=route)


def rope_attention_decode_ok(q: torch.Tensor, k_cache: torch.Tensor, rotary_dim: int, norms: bool) -> bool:
    """Whether rope_attention_decode takes this layer: act caches (not compressed), the whole head
    rotated, no per-head q/k norms."""
    return k_cache.dtype == q.dtype and rotary_dim == q.shape[2] and not norms


def rope_attention_decode(kc: KernelCompiler, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                          sin: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                          k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                          context_lens: torch.Tensor, max_context_len: int, out: torch.Tensor, scale: float,
                          partition: int = 512, workspace: tuple[torch.Tensor, torch.Tensor] | None = None,
                          window: int = 0, softcap: float = 0.0, route: str = "warp") -> None:
    """rope_kv_write (no q/k norms, rotary_dim = head_dim) then paged_attention_decode (on the same
    route) in one kernel launch, with the same bits (ROPE_KV): q [B, Hq, D] is read and rotated, not written;
    the rotated k and v [B, Hkv, D] of each token are stored at slot_mapping[b] (negative: not stored)
    before its attention reads the cache. Every token's other keys must already be in the cache (one
    new token per sequence: not speculative verification, whose rows see each other's keys)."""
    T, Hq, D = q.shape
    Hkv = k.shape[1]
    for name, t, heads in (("q", q, Hq), ("k", k, Hkv), ("v", v, Hkv)):
        _check(t, name, q.dtype, [T, heads, D], kc.device, contiguous=False)
        if t.stride(1) != D or (t.stride(0) * t.element_size()) % 16 or t.data_ptr() % 16:
            raise KernelError(f"{name} must have packed heads and 16-byte aligned rows, got strides {t.stride()}")
    if k_cache.dtype != q.dtype:
        raise KernelError(f"rope_attention_decode writes {q.dtype} caches, got {k_cache.dtype}")
    _check(cos, "cos", F32_DT, [None, D // 2], kc.device)
    _check(sin, "sin", F32_DT, list(cos.shape), kc.device)
    _check(positions, "positions", I32_DT, [T], kc.device)
    _check(slot_mapping, "slot_mapping", I32_DT, [T], kc.device)
    rope = [ptr(k), I64(k.stride(0)), ptr(v), I64(v.stride(0)), ptr(cos), ptr(sin), ptr(positions), ptr(slot_mapping)]
    _attention(kc, q, k_cache, v_cache, block_tables, None, context_lens, max_context_len, out, scale, partition,
               workspace, window, softcap, rope=rope, route=route)


ATTN_PREFILL_ROUTES = ("warp", "mma")  # attention.cu (CUDA cores, any dtype) or attention_mma.cu (tensor cores)


def attention_prefill_route_ok(route: str, act_dtype: torch.dtype, head_dim: int) -> bool:
    """Whether the prefill attention `route` takes activations of act_dtype at this head_dim."""
    if route == "mma":
        return act_dtype == BF16 and head_dim in (64, 128)
    return route == "warp"


def paged_attention_prefill(kc: KernelCompiler, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, cu_seqlens: torch.Tensor, start_pos: torch.Tensor,
                            max_context_len: int, out: torch.Tensor, scale: float, route: str = "warp",
                            window: int = 0, softcap: float = 0.0, k_scale: torch.Tensor | None = None,
                            v_scale: torch.Tensor | None = None) -> None:
    """Causal attention for new tokens of several sequences whose K/V are already in the cache.

    q, out [T, Hq, D]: sequence b's tokens are rows cu_seqlens[b]..cu_seqlens[b+1]-1 at positions
    start_pos[b].. (a prefix hit or an earlier chunk starts past 0); each sees keys 0..its position.
    max_context_len: a host bound on start_pos[b] + its token count. route: ATTN_PREFILL_ROUTES.
    window, softcap: as for decode (the warp route only).
    """
    if route not in ATTN_PREFILL_ROUTES:
        raise KernelError(f"prefill attention route must be one of {', '.join(ATTN_PREFILL_ROUTES)}, got {route!r}")
    if route == "warp":
        _attention(kc, q, k_cache, v_cache, block_tables, cu_seqlens, start_pos, max_context_len, out, scale,
                   max(1, max_context_len), None, window, softcap, k_scale, v_scale)
        return
    if k_scale is not None:
        raise KernelError("the mma prefill attention reads bf16 caches only: a compressed cache takes the warp route")
    if window or softcap:
        raise KernelError("the mma prefill attention has no sliding window or soft-capping: use the warp route")
    defines = _attention_checks(kc, q, k_cache, v_cache, block_tables, cu_seqlens, start_pos, out)
    T, Hq, D = q.shape
    _, page_size, Hkv, _ = k_cache.shape
    if not attention_prefill_route_ok(route, q.dtype, D):
        raise KernelError(f"the mma prefill attention takes bfloat16 with head_dim 64 or 128, got {q.dtype}, {D}")
    if T:
        kc.kernel("attention_mma.cu", "attention_prefill_mma", defines).launch(
            (math.ceil(T / 64), block_tables.shape[0], Hq), (128, 1, 1),
            [ptr(q), I64(q.stride(0)), ptr(k_cache), ptr(v_cache), ptr(block_tables), I32(block_tables.shape[1]),
             ptr(cu_seqlens), ptr(start_pos), ptr(out), I64(out.stride(0)), I32(Hkv), I32(page_size), F32(scale)])


def gemv_route_ok(route: str, fmt: TensorFormat, K: int, act_dtype: torch.dtype, N: int | None = None) -> bool:
    """Whether `route` takes weights of `fmt` at input width K with activations of `act_dtype` (and N
    outputs, where given: the tiled route takes N in 16s)."""
    if route == "tiled":
        return act_dtype == BF16 and _tiled(fmt, 16 if N is None else N, K)
    if fmt.format in ("bf16", "f32"):
        code, g = GEMV_FORMATS[fmt.format], 0
    elif fmt.format == "int8":
        code, g = 1, fmt.group_size
    elif fmt.format == "int4":
        code, g = (2 if fmt.symmetric else 3), fmt.group_size
    else:
        return False
    if route == "mma":  # group sizes: powers of two from 16 (int8) or 32 (int4)
        pow2 = g > 0 and g & (g - 1) == 0
        if code == 1:
            return act_dtype == BF16 and K % 64 == 0 and pow2 and g >= 16 and K % g == 0
        return act_dtype == BF16 and code in (0, 2, 3) and K % 32 == 0 and (g == 0 or (pow2 and g >= 32 and K % g == 0))
    chunk = GEMV_CHUNK[code]
    return route == "warp" and K % chunk == 0 and (g == 0 or (g % chunk == 0 and K % g == 0))


def _mma_wide(fmt: TensorFormat, K: int) -> bool:
    """Whether the mma route keeps weights of width K interleaved for 16-byte loads (int8 always: the
    route takes int8 only where K % 64 == 0; int4 where K % 128 == 0)."""
    return (fmt.format == "int4" and K % 128 == 0) or (fmt.format == "int8" and K % 64 == 0)


def _interleave(q: torch.Tensor) -> torch.Tensor:
    """Rows of bytes [N, B] (int4 [N, K/2] uint8 or int8 [N, K]): in each 64-byte block swap (chunk i,
    word t) with (word t, chunk i), a 4 x 4 transpose of 4-byte words (its own inverse)."""
    N, B = q.shape
    return q.view(N, B // 64, 4, 4, 4).transpose(2, 3).contiguous().view(N, B)


SLAB_K = {"int4": 64, "int8": 32}  # k a 512-byte slab of a 16-row tile holds (gemv_tiled.cu)


def _tiled(fmt: TensorFormat, N: int, K: int) -> bool:
    """Whether the tiled route lays out (and takes) int4 / int8 weights [N, K]: N in 16s, K in slabs
    (64 int4, 32 int8), group sizes powers of two from 32 that divide K."""
    g = fmt.group_size
    return (fmt.format in SLAB_K and N % 16 == 0 and K % SLAB_K[fmt.format] == 0 and g >= 32 and g & (g - 1) == 0
            and K % g == 0)


# Element e (0..7) of a word of gemv_tiled.cu's layout sits in nibble TILE_NIBBLE[e]; TILE_ORDER is
# the inverse (the element in nibble p), so nibbles p and p + 4 hold elements 2p and 2p + 1.
TILE_NIBBLE = (0, 4, 1, 5, 2, 6, 3, 7)
TILE_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def _nibbles(q: torch.Tensor) -> torch.Tensor:
    """int4 bytes [..., B] -> values [..., B, 2]: the low nibble first (quant.py's order)."""
    return torch.stack((q & 0x0F, q >> 4), dim=-1)


def _tile_int4(q: torch.Tensor) -> torch.Tensor:
    """quant.py's int4 rows [N, K/2] -> gemv_tiled.cu's tiles (the same shape; see the kernel's header):
    byte ((T S + j) 512 + 16 (4 g + t) + 4 (2 c + h) + b) holds elements 2b, 2b + 1 of TILE_ORDER of
    row 16 T + 8 h + g, k = 64 j + 32 c + 8 t + e."""
    N, B = q.shape
    v = _nibbles(q).view(N // 16, 2, 8, B // 32, 2, 4, 8)  # T, h, g, j, c, t, e
    v = v[..., list(TILE_ORDER)].permute(0, 3, 2, 5, 4, 1, 6)  # T, j, g, t, c, h, nibble
    return (v[..., 0::2] | (v[..., 1::2] << 4)).contiguous().view(N, B)


def _untile_int4(p: torch.Tensor) -> torch.Tensor:
    N, B = p.shape
    v = _nibbles(p).view(N // 16, B // 32, 8, 4, 2, 2, 8)  # T, j, g, t, c, h, nibble
    v = v.permute(0, 5, 2, 1, 4, 3, 6)[..., list(TILE_NIBBLE)].reshape(N, 2 * B)  # T, h, g, j, c, t, e
    return v[:, 0::2] | (v[:, 1::2] << 4)


# int8: element e (0..3) of a word of the tiled layout sits in byte TILE_BYTE[e] (its own inverse), so
# the bytes at bits 0 and 16 hold elements 0 and 1
TILE_BYTE = (0, 2, 1, 3)


def _tile_int8(q: torch.Tensor) -> torch.Tensor:
    """quant.py's int8 rows [N, K] -> gemv_tiled.cu's tiles (the same shape): byte
    ((T S + j) 512 + 16 (4 g + t) + 4 (2 c + h) + b) holds element TILE_BYTE[b] of row 16 T + 8 h + g,
    k = 32 j + 8 t + 4 c + e."""
    N, K = q.shape
    v = q.view(N // 16, 2, 8, K // 32, 4, 2, 4)[..., list(TILE_BYTE)]  # T, h, g, j, t, c, byte
    return v.permute(0, 3, 2, 4, 5, 1, 6).contiguous().view(N, K)  # T, j, g, t, c, h, byte


def _untile_int8(p: torch.Tensor) -> torch.Tensor:
    N, K = p.shape
    v = p.view(N // 16, K // 32, 8, 4, 2, 2, 4).permute(0, 5, 2, 1, 3, 4, 6)  # T, h, g, j, t, c, byte
    return v[..., list(TILE_BYTE)].contiguous().view(N, K)


def _tile_groups(fmt: TensorFormat) -> int:
    """Scale entries of one row per scale block of the tiled layout: 2 for int4 groups of 32 (a 64-k
    slab holds two groups), else 1 (a group spans slabs)."""
    return 2 if fmt.format == "int4" and fmt.group_size == 32 else 1


def _tile_scales(s: torch.Tensor, E: int) -> torch.Tensor:
    """Scales or mins [N, K/g] -> the tiled order (same shape): (row 16 T + 8 h + r, group b E + e) at
    ((T (K / (g E)) + b) 8 + r) 2 E + 2 e + h, E = _tile_groups(fmt)."""
    N, G = s.shape
    return s.view(N // 16, 2, 8, G // E, E).permute(0, 3, 2, 4, 1).contiguous().view(N, G)


def _untile_scales(s: torch.Tensor, E: int) -> torch.Tensor:
    N, G = s.shape
    return s.view(N // 16, G // E, 8, E, 2).permute(0, 4, 2, 1, 3).contiguous().view(N, G)


def _tile_parts(fmt: TensorFormat, parts: dict[str, torch.Tensor], tile: bool) -> dict[str, torch.Tensor]:
    int8 = fmt.format == "int8"
    fq = (_tile_int8 if int8 else _tile_int4) if tile else (_untile_int8 if int8 else _untile_int4)
    fs, E = _tile_scales if tile else _untile_scales, _tile_groups(fmt)
    out = {**parts, "": fq(parts[""]), ".scales": fs(parts[".scales"], E)}
    if ".mins" in parts:
        out[".mins"] = fs(parts[".mins"], E)
    return out


def _tiled_parts(fmt: TensorFormat, parts: dict[str, torch.Tensor]) -> bool:
    """Whether the tiled route lays out these parts (quant.py's shapes: int4 rows hold K / 2 bytes)."""
    w = parts[""]
    return _tiled(fmt, w.shape[0], w.shape[1] * (2 if fmt.format == "int4" else 1))


def gemv_pack(route: str, fmt: TensorFormat, parts: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The weight parts as `route` reads them, from quant.py's layout: the mma route interleaves int8
    rows and int4 rows whose width is a multiple of 128 (see gemv_mma.cu); the tiled route tiles int4 /
    int8 weights and reorders their scales and mins where it takes them (see gemv_tiled.cu); everything else
    is kept."""
    if route == "mma" and fmt.quantized and _mma_wide(fmt, parts[""].shape[1] * (2 if fmt.format == "int4" else 1)):
        return {**parts, "": _interleave(parts[""])}
    if route == "tiled" and _tiled_parts(fmt, parts):
        return _tile_parts(fmt, parts, True)
    return dict(parts)


def gemv_unpack(route: str, fmt: TensorFormat, parts: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """gemv_pack's inverse: quant.py's layout (what dequantize and the embedding kernels read)."""
    if route == "tiled" and _tiled_parts(fmt, parts):
        return _tile_parts(fmt, parts, False)
    return gemv_pack(route, fmt, parts)  # the interleave is its own inverse


def dequantize_weight(kc: KernelCompiler, fmt: TensorFormat, parts: dict[str, torch.Tensor], out: torch.Tensor,
                      route: str = "warp") -> None:
    """out [N, K] (bf16 or fp32) = the int8/int4 weight whose parts gemv_pack(route, ...) laid out, with
    exactly quant.dequantize's values; group sizes must be multiples of 32."""
    if not fmt.quantized or fmt.group_size % 32:
        raise KernelError(f"dequantize_weight takes int8/int4 with groups in 32s, got {fmt.format} "
                          f"(group {fmt.group_size})")
    N, K = out.shape
    code = 1 if fmt.format == "int8" else (2 if fmt.symmetric else 3)
    w = parts[""]
    _check(w, "weight", torch.int8 if code == 1 else torch.uint8, [N, K if code == 1 else K // 2], kc.device,
           align16=True)
    _check(parts[".scales"], "scales", F16, [N, K // fmt.group_size], kc.device)
    if code == 3:
        _check(parts[".mins"], "mins", F16, [N, K // fmt.group_size], kc.device)
    _check(out, "out", out.dtype, [N, K], kc.device, align16=True)
    if K % fmt.group_size:
        raise KernelError(f"K={K} must be a multiple of the group size {fmt.group_size}")
    chunks = N * K // 32
    if not chunks:
        return
    args = [ptr(w), ptr(parts[".scales"]), ptr(parts.get(".mins") if code == 3 else None), ptr(out), I32(N), I32(K),
            I32(fmt.group_size)]
    defines = {"DQ_FMT": code, **_act(out.dtype, "out")}
    if route == "tiled" and _tiled(fmt, N, K):  # a warp per 512-byte slab
        kernel, threads = "dequantize_tiles", N // 16 * (K // SLAB_K[fmt.format]) * 32
    elif route == "mma" and _mma_wide(fmt, K):  # a thread per 32-k chunk
        kernel, threads = "dequantize_mma", chunks
    else:  # a thread per 8 k
        kernel, threads = "dequantize_plain", N * K // 8
    kc.kernel("dequant.cu", kernel, defines).launch((math.ceil(threads / 256), 1, 1), (256, 1, 1), args)


def tiled_variant(N: int, K: int, sms: int = 0, int8: bool = False) -> dict[str, int]:
    """The tiled kernel's slabs in flight per warp, activation prefetch and register cap for a weight
    [N, K] on a GPU of `sms` SMs, from sweeps of scripts/gpu_int4_ab.py (docs/PERF.md). int4 (H200): long
    rows (down_proj) 3 stages with the activations loaded beside the weights, many rows (gate_up,
    lm_head) 2 stages without, the rest 2 with. Where two blocks an SM hold every tile at once (N / 16
    <= 2 sms: o_proj and down_proj of llama-8b), registers up to 128 (T4_MINB 2; ptxas then spends
    fewer instructions a slab): H100, 5.9 -> 5.1 us at 4096 x 4096 and 15.1 -> 14.3 at 4096 x 14336;
    with more tiles it costs the third block an SM holds (6144 x 4096: 6.9 -> 8.9 us). Variants change
    speed only: every one gives the same bits (tests/gpu/test_gemv_tiled.py).
    int8 (H100, llama-8b shapes): 4 stages everywhere; where two blocks an SM hold every tile, registers
    up to 128 and the activations loaded when computed (4096 x 4096: 8.5 -> 7.1 us, 4096 x 14336:
    26.1 -> 22.5), else loaded with the weights (6144 x 4096: 11.2 -> 10.2)."""
    minb = {"T4_MINB": 2} if 0 < N // 16 <= 2 * sms else {}
    if int8:
        return {"T4_STAGES": 4, "T4_XPRE": 0, **minb} if minb else {"T4_STAGES": 4, "T4_XPRE": 1}
    if K >= 8192:
        return {"T4_STAGES": 3, "T4_XPRE": 1, **minb}
    return {"T4_STAGES": 2, "T4_XPRE": 0 if N >= 16384 else 1, **minb}


def xsmem_bytes(M: int, N: int, K: int, int8: bool, force: int | None = None) -> int:
    """The tiled gemv's dynamic shared memory for its activations staged there (T4_XSMEM), 0 where it
    reads them from global memory: TILED_XSMEM's rule (int4, one row, N >= XSMEM_MIN_N) unless a
    variant's T4_XSMEM forces it on or off, and only where M (K + 8) * 2 bytes fit TILED_XSMEM_BYTES."""
    on = TILED_XSMEM and M == 1 and not int8 and N >= XSMEM_MIN_N if force is None else bool(force)
    nbytes = M * (K + 8) * 2
    return nbytes if on and nbytes <= TILED_XSMEM_BYTES else 0


MMA_PIPES = (0, 2, 4, 8)  # gemv_mma's bf16 MMA_PIPE values `ninfer calibrate` times (0: the built-in loop)


def mma_variant(code: int, N: int, K: int) -> dict[str, int]:
    """gemv_mma's tuning defines for a weight [N, K] of format code (speed only: every variant gives
    the same bits, tests/gpu/test_kernels.py), unless a device profile names its own MMA_PIPE. bf16:
    MMA_PIPE (iterations in flight a warp) 2, and 8 for rows in the tens of thousands (a 128k-vocab
    lm_head). H100, llama-8b's shapes (scripts/decode_variants.py sweep, docs/PERF.md session 24):
    4096 x 14336 45.4 -> 42.5 us, 4096 x 4096 14.4 -> 13.4, 6144 x 4096 and 28672 x 4096 even;
    128256 x 4096 414 -> 356 us with 8 (2: 424); tg128 bf16 167.8 -> 170.9 tok/s with 2. And MMA_L2PF 1
    (each thread asks L2 for one line of its block's weight rows before the PDL wait, WEIGHT_PREFETCH):
    tg128 bf16 170.8 -> 176.1 tok/s on an H100 (session 25; 2 lines lose). And MMA_EARLY (the pipeline's
    first weights loaded before the PDL wait): 164.4 / 164.7 -> 168.5 / 168.0 (H100, session 26)."""
    if code != 0:
        return {}
    return {"MMA_PIPE": 8 if N >= 65536 else 2, "MMA_L2PF": 1, "MMA_EARLY": 1}


def gemv(kc: KernelCompiler, x: torch.Tensor, fmt: TensorFormat, parts: dict[str, torch.Tensor],
         out: torch.Tensor, route: str = "warp", variant: dict[str, int] | None = None, glu: str = "",
         norm: tuple | None = None, prenorm: tuple | None = None, catchup: tuple | None = None,
         hwout: tuple | None = None, rscale: tuple | None = None) -> None:
    """out[M, N] = x[M, K] @ W[N, K]^T for M <= 8; W as quant.py stored parts ('' and, if quantized,
    '.scales' / '.mins'), bf16, f32 or groupwise int8/int4. x bf16 or fp32 (the activation dtype);
    out in x's dtype or fp32 (e.g. logits). Row strides of x and out may exceed their widths
    (16-byte multiples). `route` picks the kernel (GEMV_ROUTES); W as gemv_pack(route, ...) gives it.
    variant: tiled kernel compile defines (T4_STAGES, T4_XPRE, T4_WARPS, T4_MINB, T4_L2PF, T4_XSMEM) over
    tiled_variant's (tuning scripts; stages and prefetch change speed only, warps the order of the sum);
    mma: MMA_PIPE, MMA_EARLY, MMA_L2PF, MMA_XSMEM (bf16's activations staged in shared memory where they
    fit TILED_XSMEM_BYTES) over mma_variant's (speed only).
    glu ("silu" / "gelu_tanh", routes mma and tiled): W is a gated MLP's gate and up rows in glu_rows'
    order (N = 2 I) and out [M, I] (x's dtype) receives act(gate) * up, the bits of a gemv into x's
    dtype followed by swiglu / geglu.
    norm (routes mma and tiled; out in x's dtype): (residual, weight, normed, eps, counter), then
    out -> rmsnorm_residual into normed in the same launch (norm_epilogue).
    prenorm (routes tiled and mma (bf16 weights), one bf16 row whose K + 8 activations fit
    TILED_XSMEM_BYTES): (residual [1, K], weight [K], eps): x is a residual gemv's output before its norm,
    and the gemv takes rmsnorm(residual + x) * weight in its place, the bits of rmsnorm_residual then the
    gemv; residual is only read (common.cuh GEMV_PNORM).
    catchup (routes tiled and mma, bf16 rows, no glu): (y_prev [M, N], residual [M, N]): residual +=
    y_prev as well, rmsnorm_residual's add (common.cuh GEMV_CATCHUP), for the residual a prenorm gemv left
    one add behind.
    hwout (routes tiled and mma, bf16 rows, no glu): (residual [M, N], weight [N], parts [M, N / 16] fp32): a
    residual norm split with its consumer (common.cuh GEMV_HWOUT): residual += y, out = residual * weight
    (in place of y), parts = the sums of squares of residual's 16-column pieces.
    rscale (routes tiled and mma, bf16 rows, K % 64 == 0, K <= RSCALE_MAX_K): (parts [M, K / 16] fp32, eps): x is an
    hwout gemv's out, and each row's sums are scaled by rsqrt(sum(parts) / K + eps) (GEMV_RSCALE):
    rmsnorm(residual) * weight @ W^T, rounded once."""
    if route not in GEMV_ROUTES:
        raise KernelError(f"gemv route must be one of {', '.join(GEMV_ROUTES)}, got {route!r}")
    act_defines = _act(x.dtype, "x")
    M, K = x.shape
    w = parts[""]
    N = w.shape[0]
    if fmt.format in ("bf16", "f32"):
        code, g = GEMV_FORMATS[fmt.format], 0
        _check(w, "weight", BF16 if code == 0 else F32_DT, [N, K], kc.device, align16=True)
    elif fmt.format == "int8":
        code, g = 1, fmt.group_size
        _check(w, "weight", torch.int8, [N, K], kc.device, align16=True)
    elif fmt.format == "int4":
        code, g = (2 if fmt.symmetric else 3), fmt.group_size
        _check(w, "weight", torch.uint8, [N, K // 2], kc.device, align16=True)
    else:
        raise KernelError(f"gemv has no kernel for {fmt.format} weights")
    if not gemv_route_ok(route, fmt, K, x.dtype, N):
        raise KernelError(f"the {route} gemv does not take {fmt.format} weights with K={K}, N={N}, group size {g} "
                          f"and {x.dtype} activations")
    if fmt.quantized:
        _check(parts[".scales"], "scales", F16, [N, K // g], kc.device)
    mins = parts.get(".mins") if code == 3 else None
    if code == 3:
        _check(mins, "mins", F16, [N, K // g], kc.device)
    if not 1 <= M <= MAX_GEMV_ROWS:
        raise KernelError(f"gemv takes 1..{MAX_GEMV_ROWS} rows, got {M}; use torch.matmul for more")
    _check(x, "x", x.dtype, [M, K], kc.device, contiguous=False, align16=True)
    glu_defines, out_stride, norm_args = gemv_epilogue(kc, x, out, M, N, glu, route, GLU_ROUTES, norm)
    args = [ptr(x), I64(_rows(x, "x", K)), ptr(w), ptr(parts.get(".scales")), ptr(mins), ptr(out), I64(out_stride),
            I32(M), I32(N), I32(K), I32(g), I32(1 if out.dtype == F32_DT else 0), *norm_args]
    if norm is not None and any(f is not None for f in (prenorm, catchup, hwout, rscale)):
        raise KernelError("a fused norm takes no prenorm, catchup, hwout or rscale")
    if any(f is not None for f in (prenorm, catchup, hwout, rscale)) and route not in GLU_ROUTES:
        raise KernelError(f"prenorm, catchup, hwout and rscale take the {' / '.join(GLU_ROUTES)} routes, got {route!r}")
    if route == "tiled":
        g32 = int(code != 1 and g == 32)
        align = 8 if g32 else 4  # a lane reads its scales of a slab in one load
        if any(p.data_ptr() % align for p in (parts[".scales"], mins) if p is not None):
            raise KernelError(f"scales and mins must start on a {align}-byte boundary")
        defines = {"T4_WARPS": TILED_WARPS, **tiled_variant(N, K, kc.sm_count, int8=code == 1),
                   **(TILED_DEFINES if code != 1 else {}),
                   **({"T4_L2PF": WEIGHT_PREFETCH} if WEIGHT_PREFETCH is not None else {}),
                   **({"T4_DQ": 1} if TILED_DQ and code == 3 and g32 else {}),
                   **({"T4_F16": 1} if TILED_F16 and code == 1 else {}), **(variant or {})}
        force = defines.pop("T4_XSMEM", None)
        xs_bytes = xsmem_bytes(M, N, K, int8=code == 1, force=1 if prenorm is not None else force)
        fused, fused_args = residual_fusions(kc, x, out, M, N, K, glu, prenorm, catchup, xs_bytes,
                                             defines["T4_WARPS"] * 32, hwout, rscale)
        kc.kernel("gemv_tiled.cu", "gemv_tiled", {"T4_FMT": code, "T4_G32": g32, **defines,
                                                  **({"T4_XSMEM": 1} if xs_bytes else {}), **glu_defines,
                                                  **fused}).launch(
            (N // 16, 1, 1), (defines["T4_WARPS"] * 32, 1, 1), args + fused_args, shared_mem=xs_bytes)
    elif route == "mma":
        defines = {"MMA_FMT": code, "MMA_WIDE": int(_mma_wide(fmt, K)), **mma_variant(code, N, K),
                   **({"MMA_L2PF": WEIGHT_PREFETCH} if WEIGHT_PREFETCH is not None else {}), **(variant or {})}
        xs_bytes = 0
        staged = defines.pop("MMA_XSMEM", None)
        if prenorm is not None:  # the normed row in shared memory, for bf16's pipeline only
            if not (code == 0 and defines.get("MMA_PIPE")):
                raise KernelError("a prenorm gemv on the mma route takes bf16 weights and an MMA_PIPE variant")
            xs_bytes = xsmem_bytes(M, N, K, int8=False, force=1)
        elif staged and code == 0 and defines.get("MMA_PIPE"):  # where M (K + 8) * 2 bytes fit
            xs_bytes = xsmem_bytes(M, N, K, int8=False, force=1)
            defines.update({"MMA_XSMEM": 1} if xs_bytes else {})
        fused, fused_args = residual_fusions(kc, x, out, M, N, K, glu, prenorm, catchup, xs_bytes, MMA_WARPS * 32,
                                             hwout, rscale)
        kc.kernel("gemv_mma.cu", "gemv_mma", {**defines, **glu_defines, **fused}).launch(
            (math.ceil(N / 16), 1, 1), (MMA_WARPS * 32, 1, 1), args + fused_args, shared_mem=xs_bytes)
    else:
        kc.kernel("gemv.cu", "gemv", {"GEMV_FMT": code, **act_defines}).launch(
            (math.ceil(N / GEMV_WARPS), 1, 1), (GEMV_WARPS * 32, 1, 1), args)


GLU_ROUTES = ("mma", "tiled")  # gemv routes whose epilogue fuses a gated activation (common.cuh)


def _glu_out(out: torch.Tensor, act: torch.dtype, M: int, N: int, glu: str, route: str, takes: bool,
             device: int) -> dict[str, int]:
    """Checks the output of a gemv with a fused gated activation (none: {}) on a route that `takes`
    it (its epilogue is common.cuh's tile_epilogue) -> its compile defines."""
    if not glu:
        return {}
    if glu not in GLU_ACTIVATIONS:
        raise KernelError(f"glu must be one of {', '.join(GLU_ACTIVATIONS)}, got {glu!r}")
    if not takes:
        raise KernelError(f"the {route} gemv has no fused gated activation")
    if N % 16:
        raise KernelError(f"a fused gated activation takes gate and up rows in 8s (N = {N})")
    _check(out, "out", act, [M, N // 2], device, contiguous=False)
    return {"GEMV_GLU": GLU_ACTIVATIONS[glu]}


def gemv_epilogue(kc: KernelCompiler, x: torch.Tensor, out: torch.Tensor, M: int, N: int, glu: str, route: str,
                  glu_routes: tuple[str, ...], norm: tuple | None) -> tuple[dict[str, int], int, list]:
    """Checks a gemv's output for its epilogue: a fused gated activation, a fused residual norm (both
    on `glu_routes` only), or plain rows in x's dtype or float32 -> (compile defines, out's row
    stride, the norm's extra kernel arguments)."""
    defines = _glu_out(out, x.dtype, M, N, glu, route, route in glu_routes, kc.device)
    if not glu:
        if out.dtype not in (x.dtype, F32_DT):
            raise KernelError(f"out must be {' or '.join(sorted({str(x.dtype), str(F32_DT)}))}, got {out.dtype}")
        _check(out, "out", out.dtype, [M, N], kc.device, contiguous=False)
    out_stride = _out_stride(out, M)
    if norm is not None and (route not in glu_routes or glu or out.dtype != x.dtype):
        raise KernelError(f"a fused norm takes the {' / '.join(glu_routes)} routes, no glu, out in {x.dtype}")
    norm_defines, norm_args = norm_epilogue(kc, out, M, N, norm)
    return {**defines, **norm_defines}, out_stride, norm_args


def residual_fusions(kc: KernelCompiler, x: torch.Tensor, out: torch.Tensor, M: int, N: int, K: int, glu: str,
                     prenorm: tuple | None, catchup: tuple | None, xs_bytes: int, threads: int,
                     hwout: tuple | None = None, rscale: tuple | None = None) -> tuple[dict[str, int], list]:
    """Checks a tiled or mma gemv's residual fusions (gemv's prenorm, catchup, hwout and rscale; xs_bytes:
    the shared memory its launch gives the normed row, 0 where it cannot) -> (compile defines, extra
    kernel arguments in the kernels' order: GEMV_PNORM's, GEMV_CATCHUP's, GEMV_HWOUT's, GEMV_RSCALE's)."""
    if hwout is not None and (prenorm is not None or catchup is not None or rscale is not None):
        raise KernelError("an hwout gemv takes no prenorm, catchup or rscale")
    if rscale is not None and prenorm is not None:
        raise KernelError("an rscale gemv takes no prenorm")
    defines: dict[str, int] = {}
    args: list = []
    if prenorm is not None:
        residual, weight, eps = prenorm
        if M != 1 or not xs_bytes or x.dtype != BF16:
            raise KernelError(f"a prenorm gemv takes one bf16 row of at most {TILED_XSMEM_BYTES // 2 - 8} "
                              f"(got {M} rows of {K}, {x.dtype})")
        _check(residual, "residual", BF16, [1, K], kc.device, contiguous=False, align16=True)
        _check(weight, "norm weight", BF16, [K], kc.device, align16=True)
        if rmsnorm_threads(K) > threads:
            raise KernelError(f"a prenorm gemv needs {rmsnorm_threads(K)} threads, has {threads}")
        defines["GEMV_PNORM"] = 1
        args += [ptr(residual), ptr(weight), F32(eps), I32(rmsnorm_threads(K))]
    if catchup is not None:
        y_prev, residual = catchup
        if glu or x.dtype != BF16 or out.dtype != BF16:
            raise KernelError("a catchup gemv takes bf16 rows in and out, no glu")
        for name, t in (("y_prev", y_prev), ("residual", residual)):
            _check(t, name, BF16, [M, N], kc.device, contiguous=False)
        if residual.data_ptr() in (y_prev.data_ptr(), out.data_ptr(), x.data_ptr()):
            raise KernelError("the residual must not alias y_prev, out or x")
        defines["GEMV_CATCHUP"] = 1
        args += [ptr(y_prev), I64(_rows(y_prev, "y_prev", N)), ptr(residual), I64(_rows(residual, "residual", N))]
    if hwout is not None:
        residual, weight, parts = hwout
        if glu or x.dtype != BF16 or out.dtype != BF16 or N % 16:
            raise KernelError(f"an hwout gemv takes bf16 rows in and out, no glu, N % 16 == 0 (N = {N})")
        _check(residual, "residual", BF16, [M, N], kc.device, contiguous=False)
        _check(weight, "norm weight", BF16, [N], kc.device)
        _check(parts, "parts", F32_DT, [M, N // 16], kc.device, contiguous=False)
        if residual.data_ptr() in (out.data_ptr(), x.data_ptr()):
            raise KernelError("the residual must not alias out or x")
        defines.update(GEMV_HWOUT=1, **({"HW_EARLY": 1} if HWOUT_EARLY else {}))
        args += [ptr(residual), I64(_rows(residual, "residual", N)), ptr(weight), ptr(parts),
                 I64(_rows(parts, "parts", N // 16))]
    if rscale is not None:
        parts, eps = rscale
        if x.dtype != BF16 or K % 64 or K > RSCALE_MAX_K:
            raise KernelError(f"an rscale gemv takes bf16 rows, K % 64 == 0 and K <= {RSCALE_MAX_K} (K = {K})")
        _check(parts, "parts", F32_DT, [M, K // 16], kc.device, contiguous=False, align16=True)
        defines.update(GEMV_RSCALE=1, RS_P=K // 16, **({"RS_PAR": 1} if M >= RSCALE_PAR_ROWS else {}))
        args += [ptr(parts), I64(_rows(parts, "parts", K // 16)), F32(eps)]
    return defines, args


RSCALE_MAX_K = 8192  # an rscale gemv's 8 rows of K / 16 parts in static shared memory (16 KB)
# common.cuh RS_PAR (speed only, the same bits) from this many rows: an rscale gemv's warps reduce a row's parts
# each before the epilogue, where without it warp 0 reduces every row in the epilogue. H100 llama-8b tg128
# (docs/PERF.md, session 31): int4 at 2 / 4 / 8 streams +0.8 / +2.9 / +7.1 %, int8 at 8 +7.3 %; one stream
# loses 2.1 % (ptxas compiles the main loop 3 instructions longer, 171 -> 174, in a kernel bound by issue), so
# one row keeps warp 0's. decode_variants.py label y: every
# row count, y0: none.
RSCALE_PAR_ROWS = 2
# common.cuh HW_EARLY (speed only, the same bits): an hwout gemv's warp 0 loads its residual columns and norm
# weights right after the PDL wait rather than in the epilogue (a round trip in every block's tail). H100
# llama-8b tg128 (docs/PERF.md, session 32): int4 +0.8 / +1.0 % (o_proj 6.81 -> 6.58 us, down 16.19 -> 16.07),
# int8 and 8 streams even, no loss anywhere. decode_variants.py label l0 turns it off.
HWOUT_EARLY = True


def _out_stride(out: torch.Tensor, M: int) -> int:
    """The row stride of a gemv output [M, width] (rows must not overlap)."""
    width = out.shape[1]
    stride = out.stride(0) if M > 1 else width
    if M > 1 and stride < width:
        raise KernelError(f"out rows overlap: stride {stride} < {width}")
    return stride


# sampling.cu's SAMPLE_VEC scan (four logits a load, the k-th best in registers; the same tokens) where
# the rows allow it (tests/gpu/test_kernels.py runs both scans). H100, llama-8b bf16 tg128 (a 128k
# vocabulary, session 26, alternated twice): 164.4 / 164.7 -> 165.1 / 165.3 tok/s.
SAMPLE_VEC = True
# sampling.cu's scan split over blocks (SAMPLE_PHASE 1: each of a row's parts of ~SAMPLE_PART logits, at
# most SAMPLE_MAX_PARTS, writes its top k; 2: one block a row merges them and samples; the same tokens):
# one block reads a 128k row at one SM's pace (58 µs of an H200 bf16 step in session 23, before SAMPLE_VEC).
# H100 tg128 (session 28, alternated twice; decode_variants.py label r0 turns it off): llama-8b int4
# 434.5 / 434.7 -> 441.6 / 441.0 tok/s, bf16 183.2 / 183.3 -> 184.1 / 184.1, SmolLM2-135M int4 2,157 / 2,154
# -> 2,203 / 2,201.
SAMPLE_SPLIT = True
SAMPLE_PART = 4096
SAMPLE_MAX_PARTS = 32


def sample_vec_ok(logits: torch.Tensor, counts: torch.Tensor | None) -> bool:
    """Whether sampling.cu's SAMPLE_VEC scan takes these rows: V in 4s, rows (and counts' rows) 16-byte
    aligned."""
    def aligned(t: torch.Tensor) -> bool:
        return t.data_ptr() % 16 == 0 and t.stride(0) % 4 == 0 and t.stride(-1) == 1
    return logits.shape[1] % 4 == 0 and aligned(logits) and (counts is None or aligned(counts))


def sample_tokens(kc: KernelCompiler, logits: torch.Tensor, masks: torch.Tensor, temperature: torch.Tensor,
                  top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor, seeds: torch.Tensor,
                  steps: torch.Tensor, tokens: torch.Tensor, counts: torch.Tensor | None = None,
                  presence: torch.Tensor | None = None, frequency: torch.Tensor | None = None,
                  vec: bool | None = None, split: bool | None = None) -> None:
    """Sample one token per row of fp32 logits [B, V] into tokens [B] int32 (see sampling.cu; the
    same definition as ninfer.engine.sampler).

    masks [B, ceil(V/32)] int32 (unit last stride; any row stride, 0 included): the packed token
    bitmask, bit j of word w allowing id 32w + j, applied as -inf before candidates are chosen;
    always passed (every bit set for rows without a grammar: sampler.fill_mask_row), so a graph
    captures one static buffer. Per-row parameters [B]: temperature (<= 0: greedy), top_k int32
    (1..20), top_p, min_p fp32; seeds, steps int64 (the Philox key and counter: the same
    (seed, step) draws the same number). counts [B, V] int32 with presence/frequency [B] fp32:
    penalties on generated-token counts. vec (None: SAMPLE_VEC): the SAMPLE_VEC scan where
    sample_vec_ok; split (None: SAMPLE_SPLIT): the scan over ceil(V / SAMPLE_PART) blocks a row (at most
    SAMPLE_MAX_PARTS), then a merge; the same tokens either way.
    """
    B, V = logits.shape
    _check(logits, "logits", F32_DT, [B, V], kc.device, contiguous=False)
    _check(masks, "masks", I32_DT, [B, (V + 31) // 32], kc.device, contiguous=False)
    for name, t, dt in (("temperature", temperature, F32_DT), ("top_k", top_k, I32_DT), ("top_p", top_p, F32_DT),
                        ("min_p", min_p, F32_DT), ("seeds", seeds, torch.int64), ("steps", steps, torch.int64),
                        ("tokens", tokens, I32_DT)):
        _check(t, name, dt, [B], kc.device)
    if counts is not None:
        _check(counts, "counts", I32_DT, [B, V], kc.device, contiguous=False)
        if presence is None or frequency is None:
            raise KernelError("counts need presence and frequency penalties")
        _check(presence, "presence", F32_DT, [B], kc.device)
        _check(frequency, "frequency", F32_DT, [B], kc.device)
    vec = SAMPLE_VEC if vec is None else vec
    split = SAMPLE_SPLIT if split is None else split
    if not B:
        return
    defines = {"SAMPLE_VEC": 1} if vec and sample_vec_ok(logits, counts) else {}
    args = [ptr(logits), I64(logits.stride(0)), I32(V), ptr(masks), I64(masks.stride(0)), ptr(counts),
            I64(counts.stride(0) if counts is not None else 0),
            ptr(presence if counts is not None else None), ptr(frequency if counts is not None else None),
            ptr(temperature), ptr(top_k), ptr(top_p), ptr(min_p), ptr(seeds), ptr(steps), ptr(tokens)]
    parts = min(SAMPLE_MAX_PARTS, -(-V // SAMPLE_PART)) if split else 1
    if parts == 1:
        kc.kernel("sampling.cu", "sample_tokens", defines).launch((B, 1, 1), (SAMPLE_THREADS, 1, 1), args)
        return
    part_v = torch.empty((B, parts, TOPK_MAX), dtype=F32_DT, device=logits.device)
    part_i = torch.empty((B, parts, TOPK_MAX), dtype=I32_DT, device=logits.device)
    args += [ptr(part_v), ptr(part_i), I32(parts)]
    kc.kernel("sampling.cu", "sample_tokens", {**defines, "SAMPLE_PHASE": 1}).launch(
        (B, parts, 1), (SAMPLE_THREADS, 1, 1), args)
    kc.kernel("sampling.cu", "sample_tokens", {**defines, "SAMPLE_PHASE": 2}).launch(
        (B, 1, 1), (SAMPLE_THREADS, 1, 1), args)
