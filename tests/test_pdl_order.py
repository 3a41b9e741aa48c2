"""Programmatic dependent launch (common.cuh): nothing a kernel reads from the kernel before it may
load before `griddepcontrol.wait` (SASS ACQBULK). ptxas moves ld.global.nc loads (__ldg) across that
wait, so the only loads allowed before it are the constant bank's (kernel arguments) and, where a
kernel splits PDL_ENTRY to read its weights early (gemv_tiled, gemv_mma's MMA_EARLY, rmsnorm_residual), coherent weight loads (LDG without
.CONSTANT); the decode attention's ATTN_EARLY reads its lengths, positions and block table there (32-bit coherent loads). Compiles the kernels with NVRTC for sm_90 and reads their SASS with cuobjdump: no GPU
needed; skipped where NVRTC or cuobjdump is missing."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from ninfer.kernels.compiler import HEADERS, KERNEL_DIR, cuobjdump_path, nvrtc_compile

CASES = [
    ("gemv_tiled.cu", {"T4_FMT": 3, "T4_STAGES": 3, "T4_XPRE": 1}),
    ("gemv_tiled.cu", {"T4_FMT": 3, "T4_STAGES": 2, "T4_XPRE": 0}),
    ("gemv_tiled.cu", {"T4_FMT": 2, "T4_STAGES": 2, "T4_XPRE": 1}),
    ("gemv_tiled.cu", {"T4_FMT": 3, "T4_STAGES": 2, "T4_XPRE": 1, "T4_WARPS": 16, "T4_MINB": 2}),
    ("gemv_tiled.cu", {"T4_FMT": 3, "T4_G32": 0, "T4_STAGES": 3, "T4_XPRE": 1}),
    ("gemv_tiled.cu", {"T4_FMT": 1, "T4_G32": 0, "T4_STAGES": 3, "T4_XPRE": 1}),
    ("gemv_tiled.cu", {"T4_FMT": 1, "T4_G32": 0, "T4_STAGES": 2, "T4_XPRE": 0, "T4_MINB": 2}),
    ("gemv_tiled.cu", {"T4_FMT": 3, "T4_STAGES": 3, "T4_XPRE": 0, "T4_MINB": 4, "T4_DQ": 1}),
    ("gemv_tiled.cu", {"T4_FMT": 1, "T4_G32": 0, "T4_STAGES": 4, "T4_XPRE": 1, "T4_F16": 1}),
    ("gemv_tiled.cu", {"T4_FMT": 3, "T4_STAGES": 3, "T4_XPRE": 0, "T4_XSMEM": 1}),
    ("gemv_tiled.cu", {"T4_FMT": 1, "T4_G32": 0, "T4_STAGES": 4, "T4_XPRE": 1, "T4_F16": 1, "T4_XSMEM": 1}),
    ("gemv_tiled.cu", {"T4_FMT": 3, "T4_STAGES": 2, "T4_XPRE": 1, "T4_XSMEM": 1, "GEMV_PNORM": 1}),
    ("gemv_tiled.cu", {"T4_FMT": 3, "T4_STAGES": 2, "T4_XPRE": 0, "T4_XSMEM": 1, "GEMV_PNORM": 1, "GEMV_GLU": 1}),
    ("gemv_tiled.cu", {"T4_FMT": 1, "T4_G32": 0, "T4_STAGES": 4, "T4_XPRE": 1, "T4_F16": 1, "T4_XSMEM": 1,
                       "GEMV_PNORM": 1}),
    ("gemv_tiled.cu", {"T4_FMT": 3, "T4_STAGES": 2, "T4_XPRE": 1, "T4_MINB": 2, "GEMV_CATCHUP": 1}),
    ("gemv_tiled.cu", {"T4_FMT": 1, "T4_G32": 0, "T4_STAGES": 4, "T4_XPRE": 0, "T4_MINB": 2, "T4_F16": 1,
                       "GEMV_CATCHUP": 1}),
    ("gemv_tiled.cu", {"T4_FMT": 3, "T4_STAGES": 3, "T4_XPRE": 1, "T4_MINB": 2, "GEMV_HWOUT": 1}),
    ("gemv_tiled.cu", {"T4_FMT": 1, "T4_G32": 0, "T4_STAGES": 4, "T4_XPRE": 0, "T4_MINB": 2, "T4_F16": 1,
                       "GEMV_HWOUT": 1}),
    ("gemv_tiled.cu", {"T4_FMT": 3, "T4_STAGES": 2, "T4_XPRE": 1, "GEMV_RSCALE": 1, "RS_P": 256}),
    ("gemv_tiled.cu", {"T4_FMT": 3, "T4_STAGES": 2, "T4_XPRE": 0, "T4_XSMEM": 1, "GEMV_GLU": 1, "GEMV_RSCALE": 1,
                       "RS_P": 256}),
    ("gemv_tiled.cu", {"T4_FMT": 1, "T4_G32": 0, "T4_STAGES": 4, "T4_XPRE": 1, "T4_F16": 1, "GEMV_RSCALE": 1,
                       "RS_P": 36}),
    ("gemv_tiled.cu", {"T4_FMT": 3, "T4_STAGES": 2, "T4_XPRE": 0, "T4_XSMEM": 1, "GEMV_GLU": 1, "GEMV_RSCALE": 1,
                       "RS_P": 256, "RS_PAR": 1}),
    ("gemv_mma.cu", {"MMA_FMT": 0}),
    ("gemv_mma.cu", {"MMA_FMT": 0, "MMA_PIPE": 2}),
    ("gemv_mma.cu", {"MMA_FMT": 0, "MMA_PIPE": 4}),
    ("gemv_mma.cu", {"MMA_FMT": 0, "MMA_PIPE": 2, "MMA_EARLY": 1}),
    ("gemv_mma.cu", {"MMA_FMT": 3, "MMA_WIDE": 1}),
    ("gemv_mma.cu", {"MMA_FMT": 0, "MMA_PIPE": 2, "MMA_L2PF": 4}),
    ("gemv_mma.cu", {"MMA_FMT": 0, "MMA_PIPE": 2, "MMA_L2PF": 2, "MMA_L2PF_K": 1}),
    ("gemv_mma.cu", {"MMA_FMT": 3, "MMA_WIDE": 1, "MMA_L2PF": 2}),
    ("gemv_mma.cu", {"MMA_FMT": 0, "MMA_PIPE": 2, "MMA_L2PF": 1, "MMA_EARLY": 1, "GEMV_PNORM": 1}),
    ("gemv_mma.cu", {"MMA_FMT": 0, "MMA_PIPE": 2, "GEMV_PNORM": 1, "GEMV_GLU": 1}),
    ("gemv_mma.cu", {"MMA_FMT": 0, "MMA_PIPE": 2, "MMA_L2PF": 1, "MMA_EARLY": 1, "GEMV_CATCHUP": 1}),
    ("gemv_mma.cu", {"MMA_FMT": 3, "MMA_WIDE": 1, "GEMV_CATCHUP": 1}),
    ("gemv_mma.cu", {"MMA_FMT": 0, "MMA_PIPE": 2, "MMA_L2PF": 1, "MMA_EARLY": 1, "GEMV_HWOUT": 1}),
    ("gemv_mma.cu", {"MMA_FMT": 0, "MMA_PIPE": 2, "MMA_L2PF": 1, "MMA_EARLY": 1, "GEMV_GLU": 1, "GEMV_RSCALE": 1,
                     "RS_P": 256}),
    ("gemv_mma.cu", {"MMA_FMT": 0, "MMA_PIPE": 8, "MMA_L2PF": 1, "MMA_EARLY": 1, "GEMV_RSCALE": 1, "RS_P": 256,
                     "RS_PAR": 1}),
    ("gemv_mma.cu", {"MMA_FMT": 1, "GEMV_RSCALE": 1, "RS_P": 36}),
    ("gemv_mma.cu", {"MMA_FMT": 0, "MMA_PIPE": 2, "MMA_L2PF": 1, "MMA_EARLY": 1, "GEMV_HWOUT": 1, "HW_EARLY": 1}),
    ("gemv_mma.cu", {"MMA_FMT": 0, "MMA_PIPE": 2, "MMA_L2PF": 1, "MMA_EARLY": 1, "MMA_XSMEM": 1}),
    ("gemv_mma.cu", {"MMA_FMT": 0, "MMA_PIPE": 2, "MMA_L2PF": 1, "MMA_EARLY": 1, "MMA_XSMEM": 1, "GEMV_GLU": 1,
                     "GEMV_RSCALE": 1, "RS_P": 256}),
    ("gemv_tiled.cu", {"T4_FMT": 3, "T4_STAGES": 3, "T4_XPRE": 1, "T4_MINB": 2, "GEMV_HWOUT": 1, "HW_EARLY": 1}),
    ("gemv_tiled.cu", {"T4_FMT": 1, "T4_G32": 0, "T4_STAGES": 4, "T4_XPRE": 0, "T4_MINB": 2, "T4_F16": 1,
                       "GEMV_HWOUT": 1, "HW_EARLY": 1}),
    ("gemv_tiled.cu", {"T4_FMT": 3, "T4_STAGES": 2, "T4_XPRE": 0, "T4_L2PF": 1}),
    ("gemv.cu", {"GEMV_FMT": 1}),
    ("attention.cu", {"HEAD_DIM": 64, "GQA": 3, "MAX_SPLIT": 32, "SPLIT_MIN": 256, "ROPE_KV": 1}),
    ("attention_decode_mma.cu", {"HEAD_DIM": 128, "GQA": 4, "MAX_SPLIT": 32, "SPLIT_MIN": 256, "NW": 4}),
    ("attention_decode_mma.cu", {"HEAD_DIM": 128, "GQA": 4, "MAX_SPLIT": 32, "SPLIT_MIN": 256, "NW": 4, "ATTN_PF": 2}),
    ("attention_decode_mma.cu", {"HEAD_DIM": 128, "GQA": 4, "MAX_SPLIT": 32, "SPLIT_MIN": 256, "NW": 4, "ATTN_EARLY": 1}),
    ("attention_decode_mma.cu", {"HEAD_DIM": 64, "GQA": 3, "MAX_SPLIT": 32, "SPLIT_MIN": 256, "NW": 4, "ATTN_EARLY": 1,
                                 "ROPE_KV": 1}),
    ("attention_mma.cu", {"HEAD_DIM": 128, "GQA": 4}),
    ("blocks.cu", {"BLK_FMT": 6}),
    ("elementwise.cu", {}),
    ("sampling.cu", {}),
    ("sampling.cu", {"SAMPLE_VEC": 1}),
    ("sampling.cu", {"SAMPLE_VEC": 1, "SAMPLE_PHASE": 1}),
    ("sampling.cu", {"SAMPLE_VEC": 1, "SAMPLE_PHASE": 2}),
]
def early_weights(source: str, defines: dict[str, int], name: str) -> bool:
    """Whether a kernel loads its weights before the wait: every gemv_tiled, gemv_mma's bf16 pipeline
    with MMA_EARLY, elementwise.cu's rmsnorm_residual, a gemv with GEMV_PNORM (its norm weight)."""
    return (source == "gemv_tiled.cu" or (source, name) == ("elementwise.cu", "rmsnorm_residual")
            or bool(defines.get("GEMV_PNORM"))
            or (source == "gemv_mma.cu" and defines.get("MMA_FMT") == 0 and bool(defines.get("MMA_PIPE"))
                and bool(defines.get("MMA_EARLY"))))


def sass(source: str, defines: dict[str, int], tmp: Path) -> str:
    tool = cuobjdump_path()
    if tool is None:
        pytest.skip("cuobjdump not found")
    options = ["--gpu-architecture=sm_90", "--std=c++17", "-default-device", *(f"-D{k}={v}" for k, v in defines.items())]
    try:
        cubin = nvrtc_compile((KERNEL_DIR / source).read_text(), source, options,
                              {h: (KERNEL_DIR / h).read_text() for h in HEADERS})
    except Exception as e:  # no NVRTC library (cuda-bindings without the runtime compiler)
        if "could not compile" in str(e):
            raise
        pytest.skip(f"NVRTC unavailable: {e}")
    path = tmp / "k.cubin"
    path.write_bytes(cubin)
    return subprocess.run([tool, "-sass", str(path)], capture_output=True, text=True, check=True).stdout


@pytest.mark.parametrize(("source", "defines"), CASES, ids=[f"{s}-{d}" for s, d in CASES])
def test_no_input_load_before_the_pdl_wait(source: str, defines: dict[str, int], tmp_path: Path) -> None:
    functions = sass(source, defines, tmp_path).split("Function : ")[1:]
    assert functions
    for fn in functions:
        name = fn.split()[0]
        ops = [re.sub(r"^@!?U?P\w+\s+", "", m.group(1).strip()) for m in re.finditer(r"/\*[0-9a-f]{4,}\*/\s+([^;]*);", fn)]
        assert "ACQBULK" in ops, f"{name}: no griddepcontrol.wait"
        early = [op.split()[0] for op in ops[:ops.index("ACQBULK")] if op.startswith("LD")]
        loads = [op for op in early if not op.startswith("LDC")]
        if defines.get("ATTN_EARLY"):  # the lengths, positions and block table only: 32-bit coherent loads
            assert loads and all(op == "LDG.E" for op in loads), (name, early)
        elif early_weights(source, defines, name):
            assert not [op for op in loads if "CONSTANT" in op or not op.startswith("LDG")], (name, early)
            assert loads, f"{name}: no weight load before the wait"
        else:
            assert not loads, (name, early)
        # MMA_L2PF / T4_L2PF: the weights' L2 prefetch (CCTL.E.PF2) is asked before the wait, where it overlaps
        prefetch = [op for op in ops[:ops.index("ACQBULK")] if op.startswith("CCTL.E.PF2")]
        assert bool(prefetch) == bool(defines.get("MMA_L2PF") or defines.get("T4_L2PF") or defines.get("ATTN_EARLY")), \
            (name, prefetch)
