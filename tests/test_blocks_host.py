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
from gguf import GGMLQuantizationType as Q

from gguf_synth import random_blocks
from ninfer.kernels.blocks import BLOCK_CODES

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
