"""gemv_mma.cu's bf16 tuning variants (MMA_UNROLL iterations in flight a warp, MMA_L2PF: weight loads
with an L2 256-byte fetch hint) on a GPU at llama-8b decode shapes, and end to end.

  PYTHONPATH=. python scripts/gemv_mma_ab.py sweep [--unroll 2,4,8,16] [--l2pf 0,1]
      each shape at rows 1 and 8: every variant's output bit-equal to the default's (variants change
      speed only) and within 1e-5 of fp64, then its time reading enough weight copies to exceed L2
      (calls in a CUDA graph, best of 7 samples) and GB/s; then the per-token sum over llama-8b's shapes
  PYTHONPATH=. python scripts/gemv_mma_ab.py bench UNROLL L2PF BENCH_ARGS...
      `ninfer bench BENCH_ARGS` with that variant for every bf16 gemv_mma launch (launchers.mma_variant)
"""
from __future__ import annotations

import math
import runpy
import sys
import tempfile
from pathlib import Path

import torch

from ninfer.formats import TensorFormat
from ninfer.kernels import launchers as L

ROTATE = 512 << 20  # bytes a sample reads at least (L2: 50 MiB on an H100, 60 on an H200)
SHAPES = [(6144, 4096, 32), (4096, 4096, 32), (28672, 4096, 32), (4096, 14336, 32), (128256, 4096, 1)]


def sweep(unrolls: list[int], l2pfs: list[int]) -> None:
    from ninfer.kernels.compiler import KernelCompiler
    from ninfer.kernels.timing import sample_seconds

    dev = torch.device("cuda")
    kc = KernelCompiler(Path(tempfile.mkdtemp()) / "kernels", device=0)
    fmt = TensorFormat("bf16")
    variants = [{"MMA_UNROLL": u, "MMA_L2PF": p} for p in l2pfs for u in unrolls]
    per_token: dict[tuple[int, str], float] = {}
    print(f"{torch.cuda.get_device_name()}  (GB/s: weight bytes / time; samples read >= {ROTATE >> 20} MiB)")
    for N, K, count in SHAPES:
        g = torch.Generator(device=dev).manual_seed(N + K)
        w = (torch.randn(N, K, generator=g, device=dev) * 0.02).to(torch.bfloat16)
        nbytes = w.numel() * 2
        copies = [{"": w}] + [{"": w.clone()} for _ in range(max(1, math.ceil(ROTATE / nbytes)) - 1)]
        for M in (1, 8):
            x = torch.randn(M, K, generator=g, device=dev).to(torch.bfloat16)
            ref = x.double() @ w.double().T
            base = torch.empty(M, N, device=dev, dtype=torch.float32)
            L.gemv(kc, x, fmt, copies[0], base, "mma")
            line = []
            for v in variants:
                label = f"u{v['MMA_UNROLL']}p{v['MMA_L2PF']}"
                out = torch.full((M, N), float("nan"), device=dev)
                L.gemv(kc, x, fmt, copies[0], out, "mma", v)
                err = ((out.double() - ref).norm() / ref.norm()).item()
                if not torch.equal(out, base) or not err < 1e-5:
                    print(f"  !! {label} {N}x{K} M={M}: differs from the default (rel error {err:.1e})")
                    continue

                def run() -> None:
                    for parts in copies:
                        L.gemv(kc, x, fmt, parts, out, "mma", v)
                s = min(sample_seconds(run, dev, reps=7, graph=True)) / len(copies)
                per_token[(M, label)] = per_token.get((M, label), 0.0) + count * s
                line.append(f"{label} {s * 1e6:6.1f} us {nbytes / s / 1e9:5.0f}")
            print(f"N={N:6d} K={K:5d} M={M}: " + " | ".join(line))
        del copies
        torch.cuda.empty_cache()
    print("\nper token (llama-8b's shapes x their count), ms:")
    for M in (1, 8):
        row = sorted((v, k[1]) for k, v in per_token.items() if k[0] == M)
        print(f"  M={M}: " + "  ".join(f"{label} {t * 1e3:.3f}" for t, label in row))


def main() -> None:
    mode = sys.argv[1] if len(sys.argv) > 1 else "sweep"
    if mode == "sweep":
        args = dict(zip(sys.argv[2::2], sys.argv[3::2]))
        sweep([int(u) for u in args.get("--unroll", "2,4,8,16").split(",")],
              [int(p) for p in args.get("--l2pf", "0,1").split(",")])
    elif mode == "bench":
        unroll, l2pf = int(sys.argv[2]), int(sys.argv[3])
        L.mma_variant = lambda code, N, K: {"MMA_UNROLL": unroll, "MMA_L2PF": l2pf} if code == 0 else {}
        sys.argv = ["ninfer", "bench", *sys.argv[4:]]
        runpy.run_module("ninfer.cli.main", run_name="__main__")
    else:
        raise SystemExit(__doc__)


if __name__ == "__main__":
    main()
