"""Launchers for blocks.cu: llama.cpp block formats (formats.BLOCK_FORMATS) read in place.

Same contract as launchers.py: the KernelCompiler first, every argument checked before a launch on
the current torch stream, outputs written into the tensors given. A weight is its one stored part,
uint8 [N, K / QK * bytes] (row n: its K / QK blocks in order).
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from ninfer.formats import BLOCK_FORMATS, TensorFormat
from ninfer.kernels.compiler import I32, I64, KernelError, ptr
from ninfer.kernels.launchers import F32_DT, I32_DT, MAX_GEMV_ROWS, _act, _check, _rows, gemv_epilogue

if TYPE_CHECKING:
    from ninfer.kernels.compiler import Kernel, KernelCompiler

BLOCK_CODES = {"q4_k": 0, "q5_k": 1, "q6_k": 2, "q2_k": 3, "q3_k": 4, "q5_0": 5, "q5_1": 6, "iq4_nl": 7, "iq4_xs": 8}
GEMV_WARPS = 8  # blocks.cu
TILE, XPAD = 32, 36  # blocks.cu: chunks of x staged at a time, floats per staged chunk
DEQUANT_THREADS = 256


def _weight(kc: KernelCompiler, fmt: TensorFormat, w: torch.Tensor, K: int) -> tuple[int, int]:
    """(N, format code) after checking a block weight of input width K."""
    if fmt.format not in BLOCK_CODES:
        raise KernelError(f"no block kernel for {fmt.format} weights")
    elements, nbytes = BLOCK_FORMATS[fmt.format]
    if K % elements:
        raise KernelError(f"K={K} is not a multiple of the {fmt.format} block size {elements}")
    N = w.shape[0] if w.dim() == 2 else -1
    _check(w, "weight", torch.uint8, [N, K // elements * nbytes], kc.device)
    if w.data_ptr() % 16:
        raise KernelError("weight must start on a 16-byte boundary")
    return N, BLOCK_CODES[fmt.format]


# gemv_blocks (fp32 math, any activation dtype), gemv_blocks_mma (bf16, tensor cores), gemv_blocks_tile
# (bf16, tensor cores, whole blocks per lane: the formats in TILE_FORMATS)
ROUTES = ("warp", "mma", "tile")
TILE_FORMATS = ("q4_k", "q5_k", "q6_k", "q5_0", "q5_1", "iq4_nl", "iq4_xs")  # blocks.cu's TILE_FMT
GLU_ROUTES = ("mma", "tile")  # routes whose epilogue fuses a gated activation (common.cuh tile_epilogue)
MMA_WARPS = 8  # blocks.cu
TILE_SMALL_N_BLOCKS = 256  # below this many 16-row blocks the tile route splits K over 16 warps, not 8
# gemv_blocks_tile's warps load one unit at a time, or with blocks.cu's TILE_PREFETCH the next unit
# while one computes: more bytes in flight per warp, but more registers and so fewer blocks per SM. It
# wins where the grid fits on the SMs at once anyway and loses where blocks queue (H200, llama-8b
# Q4_K_M: o and down 16-24 % faster, q6_k's down 27-37 %, gate/up and q/k/v slower; docs/PERF.md), for
# the formats of PREFETCH_FORMATS (q5_k's prefetching kernel spills).
PREFETCH_FORMATS = ("q4_k", "q6_k")
TILE_PREFETCH: bool | None = None  # forced on or off for every shape (tests, gpu_blocks.py); None: tile_prefetch
_PREFETCH: dict[tuple[int, str, int, int], bool] = {}  # (device, format, N, K) -> tile_prefetch's choice
# Without the prefetch, the kernel's registers may be bounded to fit TILE_MIN_BLOCKS blocks of 8 warps on
# an SM (blocks.cu TILE_MIN_BLOCKS; q4_k: 4 instead of 3). H200, llama-8b Q4_K_M: gate/up (1,792 blocks)
# 5 % faster (q5_k's 15 %), q6_k down 14 %, but q/k/v (320-384 blocks, about one wave) 20 % slower:
# tile_bounded.
TILE_MIN_BLOCKS = 4
TILE_BOUNDED: bool | None = None  # forced on or off for every 8-warp shape; None: tile_bounded


def tile_warps(N: int) -> int:
    """Warps per block of gemv_blocks_tile for N output rows (never a function of M: batch invariance)."""
    return 16 if math.ceil(N / 16) < TILE_SMALL_N_BLOCKS else 8


def tile_blocks(fmt: TensorFormat, K: int, prefetch: bool = False) -> int:
    """Format blocks per unit of gemv_blocks_tile (blocks.cu's TILE_BLOCKS) at input width K: 1 for the
    256-element formats; for the 32-element ones the most of 8, 4, 2, 1 that divides K / 32 and keeps
    every unit 4-byte aligned (q5_0's 22-byte and iq4_nl's 18-byte blocks: an even count); at most 4 with
    the prefetch (two units of 8 in registers spill). 0: the tile route does not take K."""
    elements, nbytes = BLOCK_FORMATS[fmt.format]
    if K % elements:
        return 0
    if elements != 32:
        return 1
    sizes = (4, 2, 1) if prefetch else (8, 4, 2, 1)
    return next((b for b in sizes if (K // 32) % b == 0 and b * nbytes % 4 == 0), 0)


def _tile_kernel(kc: KernelCompiler, defines: dict[str, int], fmt: TensorFormat, N: int, K: int,
                 prefetch: bool) -> Kernel:
    tile = {"TILE_PREFETCH": int(prefetch), "TILE_BLOCKS": tile_blocks(fmt, K, prefetch)}
    if not prefetch and tile_bounded(kc, fmt, N):
        tile["TILE_MIN_BLOCKS"] = TILE_MIN_BLOCKS
    return kc.kernel("blocks.cu", "gemv_blocks_tile", {**defines, **tile})


def tile_bounded(kc: KernelCompiler, fmt: TensorFormat, N: int) -> bool:
    """Whether the plain tile kernel is compiled with its registers bounded so that TILE_MIN_BLOCKS
    blocks of 8 warps fit on an SM (TILE_BOUNDED where forced): for q6_k, and where the grid queues for
    more than two waves at that occupancy."""
    if tile_warps(N) != 8:
        return False
    if TILE_BOUNDED is not None:
        return TILE_BOUNDED
    return fmt.format == "q6_k" or math.ceil(N / 16) > 2 * TILE_MIN_BLOCKS * kc.sm_count


def tile_prefetch(kc: KernelCompiler, defines: dict[str, int], fmt: TensorFormat, N: int, K: int) -> bool:
    """Whether the tile route prefetches for a shape (TILE_PREFETCH where forced): for PREFETCH_FORMATS
    where the grid of N / 16 blocks fits on the GPU's SMs at once at the prefetching kernel's occupancy.
    A function of the shape and the GPU only (batch invariance), decided once per shape."""
    if TILE_PREFETCH is not None:
        return TILE_PREFETCH
    key = (kc.device, fmt.format, N, K)
    if key not in _PREFETCH:
        fits = False
        if fmt.format in PREFETCH_FORMATS:
            per_sm = _tile_kernel(kc, defines, fmt, N, K, True).blocks_per_sm(tile_warps(N) * 32)
            fits = math.ceil(N / 16) <= kc.sm_count * per_sm
        _PREFETCH[key] = fits
    return _PREFETCH[key]


def route_ok(route: str, fmt: TensorFormat, dtype: torch.dtype, K: int) -> bool:
    """Whether gemv_blocks takes weights of `fmt` at input width K with activations of `dtype` on `route`."""
    if fmt.format not in BLOCK_CODES or route not in ROUTES or K % fmt.group_size:
        return False
    if route == "warp":
        return True
    if dtype != torch.bfloat16:
        return False
    return route == "mma" or (fmt.format in TILE_FORMATS and tile_blocks(fmt, K) > 0)


def gemv_blocks(kc: KernelCompiler, x: torch.Tensor, fmt: TensorFormat, w: torch.Tensor, out: torch.Tensor,
                route: str = "warp", glu: str = "", norm: tuple | None = None) -> None:
    """out[M, N] = x[M, K] @ W[N, K]^T for M <= 8, W in block format `fmt` (its stored uint8 part).
    x bf16 or fp32 (the activation dtype; routes "mma" and "tile": bf16 only); out in x's dtype or fp32. Row
    strides of x and out may exceed their widths (x's: a 16-byte multiple).
    glu ("silu" / "gelu_tanh", routes mma and tile): as launchers.gemv's (W in glu_rows' order, out [M, N/2]).
    norm (routes mma and tile, out in x's dtype): the residual RMSNorm in the same launch (launchers.norm_epilogue)."""
    M, K = x.shape
    N, code = _weight(kc, fmt, w, K)
    if route not in ROUTES:
        raise KernelError(f"unknown block gemv route {route!r} (one of {', '.join(ROUTES)})")
    if route != "warp" and x.dtype != torch.bfloat16:
        raise KernelError(f"the {route} route takes bfloat16 activations, got {x.dtype}")
    if route == "tile" and fmt.format not in TILE_FORMATS:
        raise KernelError(f"the tile route takes {', '.join(TILE_FORMATS)} weights, not {fmt.format}")
    if route == "tile" and not tile_blocks(fmt, K):
        raise KernelError(f"the tile route takes {fmt.format} at K in 64s, not K={K}")
    if not 1 <= M <= MAX_GEMV_ROWS:
        raise KernelError(f"gemv takes 1..{MAX_GEMV_ROWS} rows, got {M}; use dequant_blocks + matmul for more")
    defines = {"BLK_FMT": code, **_act(x.dtype, "x")}
    _check(x, "x", x.dtype, [M, K], kc.device, contiguous=False, align16=True)
    # chosen on the plain epilogue's kernel: one choice per shape, whatever epilogue comes first
    prefetch = route == "tile" and tile_prefetch(kc, dict(defines), fmt, N, K)
    epilogue, out_stride, norm_args = gemv_epilogue(kc, x, out, M, N, glu, route, GLU_ROUTES, norm)
    defines.update(epilogue)
    args = [ptr(x), I64(_rows(x, "x", K)), ptr(w), ptr(out), I64(out_stride), I32(M), I32(N), I32(K),
            I32(1 if out.dtype == F32_DT else 0), *norm_args]
    if route == "mma":
        kc.kernel("blocks.cu", "gemv_blocks_mma", defines).launch((math.ceil(N / 16), 1, 1), (MMA_WARPS * 32, 1, 1), args)
        return
    if route == "tile":
        kernel = _tile_kernel(kc, defines, fmt, N, K, prefetch)
        kernel.launch((math.ceil(N / 16), 1, 1), (tile_warps(N) * 32, 1, 1), args)
        return
    shared = 4 * (M * TILE * XPAD + M * 2 * TILE + 16)
    kc.kernel("blocks.cu", "gemv_blocks", defines).launch(
        (math.ceil(N / GEMV_WARPS), 1, 1), (GEMV_WARPS * 32, 1, 1), args, shared_mem=shared)


def dequant_blocks(kc: KernelCompiler, fmt: TensorFormat, w: torch.Tensor, out: torch.Tensor,
                   rows: torch.Tensor | None = None) -> None:
    """out[r] = W[rows[r]] (rows None: W[r] for every row of W) expanded to out's dtype (bf16 or fp32).
    out [R, K], row stride a 16-byte multiple; rows [R] int32 (an id outside [0, N) reads row 0)."""
    R, K = out.shape
    N, code = _weight(kc, fmt, w, K)
    defines = {"BLK_FMT": code, **_act(out.dtype, "out")}
    _check(out, "out", out.dtype, [R, K], kc.device, contiguous=False, align16=True)
    if rows is not None:
        _check(rows, "rows", I32_DT, [R], kc.device)
    elif R != N:
        raise KernelError(f"out has {R} rows for a weight of {N}; pass rows to gather")
    total = R * (K // 32)
    if total:
        kc.kernel("blocks.cu", "dequant_blocks", defines).launch(
            (math.ceil(total / DEQUANT_THREADS), 1, 1), (DEQUANT_THREADS, 1, 1),
            [ptr(w), ptr(rows), ptr(out), I64(_rows(out, "out", K)), I32(R), I32(N), I32(K)])
