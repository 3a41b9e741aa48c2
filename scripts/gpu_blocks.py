"""The block-format decode gemv on a GPU, old routes against new, at the shapes a llama-8b Q4_K_M
decode step runs: per format, shape and row count, the error against float64 over gguf-py's
dequantization and the time per call (CUDA graph of 20 calls, median of 20 replays) and weight GB/s
of each route; then one decode step's gemv time per route summed over the model (32 layers of
q/k (q4_k) + v, o (q4_k), gate/up (q4_k), down, with v and down q6_k in the 16 `use_more_bits`
layers, and the q6_k lm_head) and the tok/s that time alone would allow.

    python scripts/gpu_blocks.py [--quick]     (about a minute on an H200)
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "scripts"), str(ROOT / "tests")]
from gpu_kernels import bench, rel  # noqa: E402

from ninfer.engine.quant import dequantize  # noqa: E402
from ninfer.formats import TensorFormat  # noqa: E402
from ninfer.kernels import blocks as BK  # noqa: E402
from ninfer.kernels.compiler import KernelCompiler  # noqa: E402

DEV = "cuda"
# llama-8b: (name, N, K, format, calls per step); q/k fused (5120 rows), v alone in its format
LAYERS, MORE_BITS = 32, 16
STEP = [("qk", 5120, 4096, "q4_k", LAYERS), ("v", 1024, 4096, "q4_k", LAYERS - MORE_BITS),
        ("v", 1024, 4096, "q6_k", MORE_BITS), ("o", 4096, 4096, "q4_k", LAYERS),
        ("gate_up", 28672, 4096, "q4_k", LAYERS), ("down", 4096, 14336, "q4_k", LAYERS - MORE_BITS),
        ("down", 4096, 14336, "q6_k", MORE_BITS), ("lm_head", 128256, 4096, "q6_k", 1)]


def weights(name: str, N: int, K: int, seed: int) -> torch.Tensor:
    from gguf import GGMLQuantizationType as Q
    from gguf_synth import random_blocks

    data = random_blocks(np.random.default_rng(seed), Q[name.upper()], N, K, scale=0.05)
    return torch.from_numpy(data).to(DEV)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="rows 1 and 8 only")
    args = ap.parse_args()
    kc = KernelCompiler(Path(tempfile.mkdtemp()) / "kernels", device=0)
    print(f"{torch.cuda.get_device_name()}: gemv_blocks, time per call and weight bytes / time")
    rows = (1, 8) if args.quick else (1, 2, 4, 8)
    step: dict[tuple[str, int], float] = {}
    seen: dict[tuple[int, int, str], dict[tuple[str, int], float]] = {}
    for label, N, K, name, calls in STEP:
        key = (N, K, name)
        if key not in seen:
            fmt = TensorFormat(name)
            w = weights(name, N, K, seed=N + K)
            ref_w = dequantize(fmt, {"": w}, torch.float64) if N * K <= 4096 * 14336 else None
            seen[key] = {}
            for M in rows:
                x = torch.randn(M, K, device=DEV).bfloat16()
                ref = x.double() @ ref_w.T if ref_w is not None else None
                line = f"{name:5s} {N:6d}x{K:5d} M={M}:"
                for route in ("mma", "tile"):
                    out = torch.full((M, N), float("nan"), device=DEV, dtype=torch.float32)
                    ms = bench(lambda: BK.gemv_blocks(kc, x, fmt, w, out, route))
                    seen[key][(route, M)] = ms
                    err = f" rel {rel(out, ref):.1e}" if ref is not None else ""
                    line += f"  {route} {ms * 1e3:7.1f} us {w.numel() / ms / 1e6:5.0f} GB/s{err}"
                print(line, flush=True)
            del ref_w
        for (route, M), ms in seen[key].items():
            step[(route, M)] = step.get((route, M), 0.0) + calls * ms
    print("one llama-8b Q4_K_M decode step, gemv only (32 layers + lm_head):")
    for M in rows:
        old, new = step[("mma", M)], step[("tile", M)]
        print(f"  M={M}: mma {old:6.2f} ms ({M * 1e3 / old:6.1f} tok/s bound)   tile {new:6.2f} ms "
              f"({M * 1e3 / new:6.1f} tok/s bound)   {old / new:4.2f}x")
    print(f"NVRTC compiles: {kc.compiled}")


if __name__ == "__main__":
    main()
