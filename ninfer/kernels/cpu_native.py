"""The CPU decode kernels (cpu_decode.c): build with the system C compiler, load with ctypes, launch.

The library is compiled on first use (and by scripts/install.sh) into
`<kernel cache>/cpu_decode-<sha>.so`, the key covering the source, the flags and the compiler's
version, so an edited source or a new compiler rebuilds. No compiler, a failed build or a failed
load is not an error: `load` returns None and logs one line, and the torch backend keeps its torch
ops. Every launcher checks shapes, dtypes and contiguity before it passes pointers.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger("ninfer.engine")

SOURCE = Path(__file__).resolve().parent / "cpu_decode.c"
ABI = 5  # nf_abi() of a library this module can call
FLAGS = ("-O2", "-shared", "-fPIC", "-fopenmp", "-fvisibility=hidden", "-Wno-psabi")
BLOCK = 32  # inputs per scale in the kernels' weight layouts (16 also for int8)
TILE = 16  # output rows the kernels take together
MAX_ROWS = 8  # rows one launch takes (decode rows; prefill takes torch's dense matmul)
INT4, INT5, INT6, INT8 = 4, 5, 6, 8  # NativeWeight.kind: cpu_decode.c's weight kinds (bits a code)

_P, _I, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
_SIGNATURES = {
    "nf_abi": ((), _I),
    "nf_isa": ((), _I),
    "nf_allow_avx512bf16": ((_I,), None),
    "nf_linear": ((_I, _P, _I, _I, _P, _P, _P, _I, _I, _P, _P), None),
    "nf_gated_silu": ((_I, _P, _I, _I, _P, _P, _P, _I, _I, _P), None),
    "nf_linear_add_rms_norm": ((_I, _P, _I, _I, _P, _P, _P, _I, _I, _P, _P, _F, _P), None),
    "nf_attention_decode": ((_P, _I, _I, _I, _P, _P, _P, _P, _P, _I, _I, _P), None),
}
ISA_NAMES = {2: "avx512-bf16", 1: "avx2", 0: "baseline"}


class BuildError(RuntimeError):
    pass


def compiler() -> str | None:
    """The C compiler to build with: cc, else gcc, on PATH (None: none)."""
    for name in ("cc", "gcc"):
        if shutil.which(name):
            return name
    return None


def library_path(cache_dir: Path, cc: str) -> Path:
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    h = hashlib.sha256(SOURCE.read_bytes())
    for part in (*FLAGS, version):
        h.update(b"\0" + part.encode())
    return cache_dir / f"cpu_decode-{h.hexdigest()[:16]}.so"


def build(cache_dir: Path) -> Path:
    """The compiled library under cache_dir (built now unless already there). Raises BuildError."""
    cc = compiler()
    if cc is None:
        raise BuildError("no C compiler (cc or gcc) on PATH")
    path = library_path(cache_dir, cc)
    if path.is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".so.tmp")
    os.close(fd)
    try:
        r = subprocess.run([cc, *FLAGS, "-o", tmp, str(SOURCE), "-lm"], capture_output=True, text=True, timeout=300)
        if r.returncode != 0:
            raise BuildError(f"{cc} failed: {r.stderr.strip()[-2000:]}")
        os.replace(tmp, path)  # a concurrent loader never sees half a library
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


@functools.cache
def load(cache_dir: Path) -> CpuKernels | None:
    """The kernels, built into cache_dir if needed; None (one log line says why) when they cannot be."""
    try:
        lib = ctypes.CDLL(str(build(cache_dir)))
        if lib.nf_abi() != ABI:
            raise BuildError(f"library ABI {lib.nf_abi()}, expected {ABI}")
    except (BuildError, OSError, subprocess.SubprocessError, AttributeError) as e:
        log.warning("cpu decode kernels unavailable (%s); decode uses the torch ops", e)
        return None
    kernels = CpuKernels(lib)
    log.info("cpu decode kernels: %s", ISA_NAMES.get(kernels.isa, "?"))
    return kernels


def decode_kernels(cache_dir: Path) -> CpuKernels | None:
    """The kernels for the torch backend's decode rows: `load`'s, where they beat the torch ops. Their
    int4 matmul needs AVX-512 BF16 for that (the plain C route, for other CPUs, is ~3x slower than
    torch's packed kernel at one row), so elsewhere None and one log line."""
    kernels = load(cache_dir)
    if kernels is not None and kernels.isa < 2:
        log.info("cpu decode kernels: no AVX-512 BF16 on this CPU; decode uses the torch ops")
        return None
    return kernels


@dataclass(slots=True)
class NativeWeight:
    """A weight in the kernels' layout (cpu_decode.c: tiles of 16 output rows): kind 4, int4 codes
    with bf16 scales and zeros per 32 inputs (w = (q - 8) * scale + zero); kind 8, int8 codes with a
    bf16 scale, and optionally a zero, per 32 or per 16 inputs (w = q * scale [+ zero]); kinds 5 and
    6, 5- and 6-bit codes 0 <= q < 2^kind with a bf16 scale and zero per 32 (kind 5) or 16 (kind 6)
    inputs (w = q * scale + zero): int4's nibbles, then the high bits."""

    kind: int
    q: torch.Tensor  # uint8 (int4: two codes a byte; 5- / 6-bit: those nibbles, then the high bits) or int8
    scales: torch.Tensor  # bf16 [n/16, k/group, 16]
    zeros: torch.Tensor | None  # bf16 [n/16, k/group, 16] (int4, 5- / 6-bit; int8 where it has them)
    n: int
    k: int
    group: int = BLOCK  # inputs per scale in this layout: 32, or 16 (6-bit; int8)

    @classmethod
    def int4(cls, q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int) -> NativeWeight:
        """q [n, k] 0..15, scales / zeros [n, k/group_size] (`fits` says which shapes)."""
        n, k = q.shape
        assert cls.fits(n, k, group_size), (n, k, group_size)
        return cls(INT4, _nibble_words(q), _tiled(scales, group_size),
                   _tiled(zeros, group_size), n, k)

    @classmethod
    def wide(cls, q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, kind: int) -> NativeWeight:
        """q [n, k] codes 0..2^kind - 1 (kind 5 or 6), scales and zeros [n, k/group] (group 32 for kind
        5, 16 for kind 6): w = q * scale + zero."""
        n, k = q.shape
        group = 16 if kind == INT6 else BLOCK
        assert kind in (INT5, INT6) and cls.fits(n, k, group, INT8), (n, k, kind)
        high = _vectors(q.to(torch.int32) >> 4)  # [tile, block, n, i, word]
        tb = high.shape[:2]
        if kind == INT5:  # one vector a block: bit 4i + n of each word (field f = 4n + i)
            hi = _words(high.reshape(*tb, 16, 2 * TILE), [4 * (f % 4) + f // 4 for f in range(16)])
        else:  # two vectors a block: vector i // 2, 2 bits at 8 (i % 2) + 2n (field f = 2n + i % 2)
            fields = high.reshape(*tb, 4, 2, 2, 2 * TILE).permute(0, 1, 3, 2, 4, 5).reshape(*tb, 2, 8, 2 * TILE)
            hi = _words(fields, [8 * (f % 2) + 2 * (f // 2) for f in range(8)])
        lo = _nibble_words(q.to(torch.int32) & 15)
        return cls(kind, torch.cat((lo.flatten(), hi.flatten())), _tiled(scales, group, group),
                   _tiled(zeros, group, group), n, k, group)

    @classmethod
    def int8(cls, q: torch.Tensor, scales: torch.Tensor, group_size: int,
             zeros: torch.Tensor | None = None) -> NativeWeight:
        """q [n, k] int8, scales (and zeros) [n, k/group_size]: w = q * scale (+ zero)."""
        n, k = q.shape
        assert cls.fits(n, k, group_size, INT8), (n, k, group_size)
        unit = 16 if group_size == 16 else BLOCK
        tiled = q.to(torch.int8).view(n // TILE, TILE, k).transpose(1, 2).contiguous()  # [tile, k, lane]
        return cls(INT8, tiled, _tiled(scales, group_size, unit),
                   _tiled(zeros, group_size, unit) if zeros is not None else None, n, k, unit)

    @staticmethod
    def fits(n: int, k: int, group_size: int, kind: int = INT4) -> bool:
        """Whether a weight [n, k] with a scale per group_size inputs has a layout (int8 also takes 16)."""
        unit = 16 if kind == INT8 and group_size == 16 else BLOCK
        return n % TILE == 0 and k % BLOCK == 0 and group_size % unit == 0 and k % group_size == 0


def _vectors(q: torch.Tensor) -> torch.Tensor:
    """Codes [n, k] -> [tile, block, nibble, i, 2 * TILE]: vector v = 4 nibble + i of a block is its
    inputs 2v, 2v + 1 of the tile's 16 rows (row-major pairs); the kernels read iteration i's
    vectors (nibbles 0..3) from the same 16-bit words."""
    n, k = q.shape
    codes = q.to(torch.int32).view(n // TILE, TILE, k // BLOCK, 16, 2).permute(0, 2, 3, 1, 4)
    return codes.reshape(n // TILE, k // BLOCK, 4, 4, 2 * TILE)


def _words(fields: torch.Tensor, shifts: list[int]) -> torch.Tensor:
    """[..., F, words] -> the uint8 bytes of little-endian 16-bit words [..., words]: the sum of field
    j << shifts[j]."""
    words = sum(fields[..., j, :] << s for j, s in enumerate(shifts))
    return words.to(torch.int16).contiguous().view(torch.uint8)


def _nibble_words(q: torch.Tensor) -> torch.Tensor:
    """Codes [n, k] 0..15 -> int4's words: [tile, block, i, word], nibble j holding vector 4j + i."""
    return _words(_vectors(q).transpose(2, 3), [4 * j for j in range(4)])


def _tiled(t: torch.Tensor, group_size: int, unit: int = BLOCK) -> torch.Tensor:
    # [n, k/group_size] -> bf16 [n/16, k/unit, 16]: one per `unit` inputs, the 16 rows of a tile side by side
    per_unit = t.to(torch.bfloat16).repeat_interleave(group_size // unit, dim=1)
    return per_unit.view(t.shape[0] // TILE, TILE, -1).transpose(1, 2).contiguous()


def _ptr(t: torch.Tensor | None) -> int | None:
    return t.data_ptr() if t is not None else None


def _check_rows(x: torch.Tensor, w: NativeWeight) -> None:
    if x.dtype != torch.bfloat16 or x.dim() != 2 or not x.is_contiguous() or x.device.type != "cpu":
        raise ValueError(f"x must be a contiguous 2-d bf16 CPU tensor, got {x.dtype} {tuple(x.shape)}")
    if not 1 <= x.shape[0] <= MAX_ROWS or x.shape[1] != w.k:
        raise ValueError(f"x {tuple(x.shape)} does not fit a weight [{w.n}, {w.k}] (1..{MAX_ROWS} rows)")


def _check_f32(t: torch.Tensor, shape: tuple[int, ...], what: str) -> None:
    if t.dtype != torch.float32 or tuple(t.shape) != shape or not t.is_contiguous():
        raise ValueError(f"{what} must be contiguous float32 {shape}, got {t.dtype} {tuple(t.shape)}")


class CpuKernels:
    """Launchers of cpu_decode.c's entry points (typed, checked)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        for name, (args, res) in _SIGNATURES.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = args, res
        self.lib = lib
        self.isa = lib.nf_isa()

    def linear(self, x: torch.Tensor, w: NativeWeight, out_dtype: torch.dtype) -> torch.Tensor:
        """x [rows, k] bf16 -> [rows, n] in out_dtype (bf16, or float32 holding the bf16-rounded values)."""
        _check_rows(x, w)
        if out_dtype not in (torch.bfloat16, torch.float32):
            raise ValueError(f"out_dtype {out_dtype} is neither bf16 nor float32")
        y = torch.empty(x.shape[0], w.n, dtype=out_dtype)
        bf16, f32 = (y.data_ptr(), None) if out_dtype == torch.bfloat16 else (None, y.data_ptr())
        self.lib.nf_linear(w.kind, x.data_ptr(), x.shape[0], w.k, w.q.data_ptr(), w.scales.data_ptr(),
                           _ptr(w.zeros), w.n, w.group, bf16, f32)
        return y

    def gated_silu(self, x: torch.Tensor, w: NativeWeight) -> torch.Tensor:
        """x [rows, k] bf16 times a [gate; up] weight -> silu(gate) * up [rows, n/2] bf16."""
        _check_rows(x, w)
        if w.n % (2 * TILE):
            raise ValueError("gated_silu wants a weight of [gate; up] rows, 16 rows a tile in each half")
        out = torch.empty(x.shape[0], w.n // 2, dtype=torch.bfloat16)
        self.lib.nf_gated_silu(w.kind, x.data_ptr(), x.shape[0], w.k, w.q.data_ptr(), w.scales.data_ptr(),
                               _ptr(w.zeros), w.n, w.group, out.data_ptr())
        return out

    def linear_add_rms_norm(self, x: torch.Tensor, w: NativeWeight, residual: torch.Tensor, norm: torch.Tensor,
                            eps: float) -> torch.Tensor:
        """residual [rows, n] float32 += x @ w^T (bf16-rounded); -> bf16 RMSNorm(residual) * norm."""
        _check_rows(x, w)
        _check_f32(residual, (x.shape[0], w.n), "residual")
        _check_f32(norm, (w.n,), "norm")
        out = torch.empty(x.shape[0], w.n, dtype=torch.bfloat16)
        self.lib.nf_linear_add_rms_norm(w.kind, x.data_ptr(), x.shape[0], w.k, w.q.data_ptr(), w.scales.data_ptr(),
                                        _ptr(w.zeros), w.n, w.group, residual.data_ptr(), norm.data_ptr(), eps,
                                        out.data_ptr())
        return out

    def attention_decode(self, qkv: torch.Tensor, heads: int, kv_heads: int, cos: torch.Tensor, sin: torch.Tensor,
                         k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor, pos: int,
                         out: torch.Tensor) -> None:
        """One query at position pos (d % 16 == 0): qkv [(heads + 2 kv_heads) * d] bf16; cos, sin [d] float32 (its RoPE
        row, sin signed); caches [pages, page_size, kv_heads, d] float32; block_table int64 pages ->
        out [heads * d] bf16 (K and V written at pos)."""
        pages, page_size, kvh, d = k_cache.shape
        if kvh != kv_heads or heads % kv_heads or d % 16 or qkv.shape != ((heads + 2 * kv_heads) * d,):
            raise ValueError(f"qkv {tuple(qkv.shape)} does not fit {heads} heads, {kv_heads} kv heads of {d}")
        if qkv.dtype != torch.bfloat16 or not qkv.is_contiguous():
            raise ValueError("qkv must be contiguous bf16")
        for t, what in ((k_cache, "k_cache"), (v_cache, "v_cache")):
            _check_f32(t, (pages, page_size, kv_heads, d), what)
        _check_f32(cos, (d,), "cos")
        _check_f32(sin, (d,), "sin")
        if block_table.dtype != torch.int64 or not block_table.is_contiguous() or \
                block_table.numel() * page_size <= pos:
            raise ValueError(f"block table does not cover position {pos}")
        if out.dtype != torch.bfloat16 or out.shape != (heads * d,) or not out.is_contiguous():
            raise ValueError("out must be contiguous bf16 [heads * d]")
        self.lib.nf_attention_decode(qkv.data_ptr(), heads, kv_heads, d, cos.data_ptr(), sin.data_ptr(),
                                     k_cache.data_ptr(), v_cache.data_ptr(), block_table.data_ptr(), page_size,
                                     pos, out.data_ptr())
