"""blocks.cu's block decoding (the code both CUDA kernels read weights with) compiled for the host
with a C++ compiler and a stand-in for common.cuh, run on random blocks of every format and
compared with gguf-py's reference dequantize: the kernels' layouts are checked without a GPU.
Skipped when no C++ compiler is found."""
from __future__ import annotations

import shutil
import struct
import subprocess
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from gguf_synth import random_blocks
from ninfer.formats import BLOCK_FORMATS, TensorFormat
from ninfer.kernels.blocks import BLOCK_CODES, TILE_FORMATS, route_ok, tile_blocks

HERE = Path(__file__).resolve().parent
KERNELS = HERE.parent / "ninfer" / "kernels"
CXX = shutil.which("g++") or shutil.which("clang++")


@pytest.fixture(scope="module")
def build_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if CXX is None:
        pytest.skip("no C++ compiler (g++ or clang++)")
    d = tmp_path_factory.mktemp("blocks_host")
    shutil.copy(KERNELS / "blocks.cu", d / "blocks.cu")  # so that its #include "common.cuh" is the stand-in
    shutil.copy(HERE / "kernels_host" / "common.cuh", d / "common.cuh")
    shutil.copy(HERE / "kernels_host" / "decode_blocks.cpp", d / "decode_blocks.cpp")
    return d


@pytest.mark.parametrize("name", list(BLOCK_CODES))
def test_kernel_block_decoding_is_gguf_reference(name: str, build_dir: Path) -> None:
    exe = build_dir / f"decode_{name}"
    subprocess.run([CXX, "-O1", "-std=c++17", "-w", f"-DBLK_FMT={BLOCK_CODES[name]}", "-o", str(exe),
                    str(build_dir / "decode_blocks.cpp")], check=True, cwd=build_dir)
    qtype = Q[name.upper()]
    elements, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    data = random_blocks(np.random.default_rng(BLOCK_CODES[name]), qtype, 6, 1024)
    n = data.size // nbytes
    run = subprocess.run([str(exe)], input=struct.pack("<i", n) + data.tobytes(), capture_output=True, check=True)
    ours = np.frombuffer(run.stdout, dtype=np.float32).reshape(data.shape[0], -1)
    ref = gguf.quants.dequantize(data, qtype)
    # one fused multiply-add where the reference rounds the product first: at most an ulp or so apart
    np.testing.assert_allclose(ours, ref, rtol=1e-6, atol=1e-6 * np.abs(ref).max())


# ---- gemv_blocks_tile on the host: every lane's fragments, the mma emulated ----------------------------

@pytest.fixture(scope="module")
def tile_dir(build_dir: Path) -> Path:
    shutil.copy(HERE / "kernels_host" / "tile_blocks.cpp", build_dir / "tile_blocks.cpp")
    return build_dir


def _bf16(x: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bits (round to nearest even) as uint16."""
    u = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


# (N, K, M): N not a multiple of 16 (a partial last tile), more units than warps and fewer, rows 1..8 of
# x; for the 256-element formats K / 256 odd and even (q6_k blocks 2 mod 4 bytes: the funnel-shift
# loads), for the 32-element ones units of 8, 4, 2 and 1 blocks (blocks.tile_blocks; q5_0's 22-byte
# and iq4_nl's 18-byte blocks 2 mod 4 in every other block).
TILE_SHAPES = {256: [(40, 768, 1), (37, 2560, 3), (16, 512, 8), (24, 1280, 5)],
               32: [(40, 768, 1), (37, 2560, 3), (21, 576, 8), (24, 1152, 5), (19, 96, 2), (16, 800, 4)]}
TILE_CASES = [(name, *shape) for name in TILE_FORMATS for shape in TILE_SHAPES[BLOCK_FORMATS[name][0]]
              if tile_blocks(TensorFormat(name), shape[1])]


@pytest.mark.parametrize("name,N,K,M", TILE_CASES, ids=[f"{n}-{a}x{b}-m{m}" for n, a, b, m in TILE_CASES])
def test_tile_gemv_fragments_match_gguf_reference(name: str, N: int, K: int, M: int, tile_dir: Path) -> None:
    """The tile kernel's per-lane pieces for all 32 lanes of every warp with the mma emulated from
    the fragments (tests/kernels_host/tile_blocks.cpp) against x @ W^T in float64 from gguf-py's
    dequantize."""
    units = tile_blocks(TensorFormat(name), K)
    exe = tile_dir / f"tile_{name}_{units}"
    if not exe.exists():
        subprocess.run([CXX, "-O1", "-std=c++17", "-w", f"-DBLK_FMT={BLOCK_CODES[name]}", f"-DTILE_BLOCKS={units}",
                        "-o", str(exe), str(tile_dir / "tile_blocks.cpp")], check=True, cwd=tile_dir)
    qtype = Q[name.upper()]
    rng = np.random.default_rng(N * K + M)
    w = random_blocks(rng, qtype, N, K, scale=0.05)
    x = rng.standard_normal((M, K)).astype(np.float32)
    xb = _bf16(x)
    run = subprocess.run([str(exe)], input=struct.pack("<iii", N, K, M) + w.tobytes() + xb.tobytes(),
                         capture_output=True, check=True)
    ours = np.frombuffer(run.stdout, dtype=np.float32).reshape(M, N).astype(np.float64)
    xd = (xb.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    ref = xd @ gguf.quants.dequantize(w, qtype).reshape(N, K).astype(np.float64).T
    err = np.linalg.norm(ours - ref) / np.linalg.norm(ref)
    assert err < 1e-6, err


def test_tile_blocks_keep_units_aligned() -> None:
    """blocks.tile_blocks: the most blocks of 8, 4, 2, 1 dividing K / 32 with 4-byte aligned units."""
    q5_0, q5_1, q4_k = TensorFormat("q5_0"), TensorFormat("q5_1"), TensorFormat("q4_k")
    assert [tile_blocks(q5_0, k) for k in (4096, 576, 1152, 800, 96)] == [8, 2, 4, 0, 0]
    assert [tile_blocks(q5_1, k) for k in (4096, 576, 1152, 800, 96)] == [8, 2, 4, 1, 1]
    assert [tile_blocks(TensorFormat("iq4_nl"), k) for k in (4096, 576, 800)] == [8, 2, 0]
    assert tile_blocks(q4_k, 4096) == 1 and tile_blocks(q4_k, 576) == 0
    assert not route_ok("tile", q5_0, torch.bfloat16, 800) and route_ok("mma", q5_0, torch.bfloat16, 800)
    assert route_ok("tile", q5_1, torch.bfloat16, 800) and not route_ok("tile", q5_1, torch.float32, 800)
