"""Decode tuning variants on a GPU: gemv_mma.cu's bf16 variants at llama-8b decode shapes, and any
variant end to end. A variant is a label: pN (MMA_PIPE N: N iterations in flight a warp, a rolling
pipeline), sN (launchers.ATTN_MAX_SPLIT N: the most partitions a decode token's keys are cut into;
end to end only), fN (launchers.ATTN_PREFETCH N: decode attention's L2 prefetch N steps ahead; end
to end only), wN (launchers.WEIGHT_PREFETCH N: a gemv block's weights, up to N 128-byte lines a thread,
asked of L2 before the PDL wait; the sweep times gemv_mma's, end to end every mma and tiled gemv's),
k (gemv_mma's MMA_L2PF_K: bf16's prefetched lines in k order across the block's rows), e (gemv_mma's
MMA_EARLY: the pipeline's first weights loaded before the PDL wait), v (launchers.SAMPLE_VEC: the
sampler's four-logits-a-load scan; end to end only), q (launchers.TILED_DQ: asym g32 int4 dequantized
to bf16 in the tiled gemv's registers), h (launchers.TILED_F16: the tiled int8 gemv's mmas in fp16),
tN / xN / bN (launchers.TILED_DEFINES: every int4 tiled gemv's T4_STAGES, T4_XPRE, T4_MINB), z
(launchers.TILED_XSMEM: the tiled gemv's activations staged once a block in shared memory, where its
rule takes them), r
(launchers.SAMPLE_SPLIT: the sampler's scan split over blocks, then merged), a
(launchers.ATTN_EARLY: decode attention's lengths, block table and first K / V rows before the PDL
wait; end to end only), n (CudaOps.PRE_NORM: a decode row's residual norm in its consumer's gemv
prologue; end to end only), mN (CudaOps.PRE_NORM_SMALL N MiB: the largest weight of a tiled consumer
that takes the norm), d (CudaOps.SPLIT_NORM: a residual norm between two tiled gemvs split between
their epilogues; end to end only), y (launchers.RSCALE_PAR_ROWS: a split norm's consumer reduces its
rows' sums a warp a row at every row count, y0 at none; the rule from 2 rows; end to end only), u
(CudaOps.SPLIT_MMA: the split norm on the mma route too; end to end only), l (launchers.HWOUT_EARLY: a
split norm's residual gemv loads its residual and norm weights after the PDL wait; end to end only), c
(gemv_mma.cu MMA_XSMEM: bf16's activations staged in shared memory where they fit),
joined by '+'. e, v, h, a,
z, r, n, d and l are on in the rule; a trailing 0 turns
a switch off (a0, h0). "rule" sets nothing; "p0" is the built-in loop; a label without pN keeps
launchers.mma_variant's rule by shape.

  PYTHONPATH=. python scripts/decode_variants.py sweep [p0,p2,p3,p4,p6,p8]
      each shape at rows 1 and 8: every gemv variant's output bit-equal to the rule's (variants
      change speed only) and within 1e-5 of fp64, then its time reading enough weight copies to exceed
      L2 (calls in a CUDA graph, best of 7 samples) and GB/s; then the per-token sum over llama-8b's shapes
  PYTHONPATH=. python scripts/decode_variants.py bench VARIANT BENCH_ARGS...
      `ninfer bench BENCH_ARGS` with that variant (its gemv_mma defines over launchers.mma_variant's
      for every bf16 launch; launchers.ATTN_MAX_SPLIT, ATTN_PREFETCH, WEIGHT_PREFETCH, SAMPLE_VEC)
  PYTHONPATH=. python scripts/decode_variants.py profile VARIANT BENCH_ARGS...
      scripts/profile_gpu_step.py BENCH_ARGS with that variant (where a decode step's time goes)
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


def defines(label: str) -> dict[str, int]:
    """A variant label (p4, u8+l2, ...) -> gemv_mma's compile defines."""
    out = {}
    for part in label.split("+"):
        flag = part.removesuffix("0")  # h0: that switch off (e, v, h, a, z, r, n, d and l are on in the rule)
        if flag in ("v", "e", "k", "q", "h", "a", "z", "r", "n", "d", "y", "u", "l", "c") or part == "rule":  # rule: the built-in choices
            out.update({k: int(flag == part) for k in {
                "v": ["SAMPLE_VEC"], "e": ["MMA_EARLY"], "k": ["MMA_L2PF_K"], "q": ["T4_DQ"], "h": ["T4_F16"],
                "a": ["ATTN_EARLY"], "z": ["T4_XSMEM"], "r": ["SAMPLE_SPLIT"], "n": ["PRE_NORM"], "d": ["SPLIT_NORM"],
                "y": ["RSCALE_PAR"], "u": ["SPLIT_MMA"], "l": ["HW_EARLY"], "c": ["MMA_XSMEM"],
                "rule": []}[flag]})
            continue
        if part[:1] not in ("p", "s", "f", "w", "t", "x", "b", "m") or not part[1:].isdigit():
            raise SystemExit(f"unknown variant {label!r}: pN, sN, fN, wN, tN, xN, bN, mN, a, c, d, e, k, l, n, q, h, r, u, v, y, z "
                             "(a0: off) joined by '+'")
        out[{"p": "MMA_PIPE", "s": "ATTN_MAX_SPLIT", "f": "ATTN_PREFETCH", "w": "MMA_L2PF", "t": "T4_STAGES",
             "x": "T4_XPRE", "b": "T4_MINB", "m": "PRE_NORM_SMALL"}[part[0]]] = int(part[1:])
    return out


def sweep(labels: list[str]) -> None:
    from ninfer.kernels.compiler import KernelCompiler
    from ninfer.kernels.timing import sample_seconds

    variants = {label: defines(label) for label in labels}
    if any(set(v) - {"MMA_PIPE", "MMA_EARLY", "MMA_L2PF", "MMA_L2PF_K", "MMA_XSMEM"} for v in variants.values()):
        raise SystemExit("sN, fN, a, n, q, h and v: bench them end to end (the sweep times gemv_mma's bf16)")
    dev = torch.device("cuda")
    kc = KernelCompiler(Path(tempfile.mkdtemp()) / "kernels", device=0)
    fmt = TensorFormat("bf16")
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
            for label, v in variants.items():
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


def apply(label: str) -> None:
    """Sets a variant's switches on the launchers and CudaOps, and its gemv_mma defines over
    launchers.mma_variant's for every bf16 launch."""
    from ninfer.engine.ops.cuda_ops import CudaOps

    chosen = defines(label)
    L.ATTN_MAX_SPLIT = chosen.pop("ATTN_MAX_SPLIT", L.ATTN_MAX_SPLIT)
    L.SAMPLE_VEC = bool(chosen.pop("SAMPLE_VEC", L.SAMPLE_VEC))
    L.TILED_DQ = bool(chosen.pop("T4_DQ", L.TILED_DQ))
    L.TILED_F16 = bool(chosen.pop("T4_F16", L.TILED_F16))
    L.ATTN_EARLY = bool(chosen.pop("ATTN_EARLY", L.ATTN_EARLY))
    L.TILED_XSMEM = bool(chosen.pop("T4_XSMEM", L.TILED_XSMEM))
    L.SAMPLE_SPLIT = bool(chosen.pop("SAMPLE_SPLIT", L.SAMPLE_SPLIT))
    CudaOps.PRE_NORM = bool(chosen.pop("PRE_NORM", CudaOps.PRE_NORM))
    CudaOps.PRE_NORM_SMALL = chosen.pop("PRE_NORM_SMALL", CudaOps.PRE_NORM_SMALL >> 20) << 20
    CudaOps.SPLIT_NORM = bool(chosen.pop("SPLIT_NORM", CudaOps.SPLIT_NORM))
    if "RSCALE_PAR" in chosen:
        L.RSCALE_PAR_ROWS = 1 if chosen.pop("RSCALE_PAR") else L.MAX_GEMV_ROWS + 1
    CudaOps.SPLIT_MMA = bool(chosen.pop("SPLIT_MMA", CudaOps.SPLIT_MMA))
    L.HWOUT_EARLY = bool(chosen.pop("HW_EARLY", L.HWOUT_EARLY))
    L.TILED_DEFINES = {k: chosen.pop(k) for k in ("T4_STAGES", "T4_XPRE", "T4_MINB") if k in chosen}
    L.ATTN_PREFETCH = chosen.pop("ATTN_PREFETCH", L.ATTN_PREFETCH)
    L.WEIGHT_PREFETCH = chosen.pop("MMA_L2PF", L.WEIGHT_PREFETCH)  # every mma and tiled gemv
    if chosen:
        rule = L.mma_variant
        L.mma_variant = lambda code, N, K: {**rule(code, N, K), **chosen} if code == 0 else rule(code, N, K)


def main() -> None:
    mode = sys.argv[1] if len(sys.argv) > 1 else "sweep"
    if mode == "sweep":
        sweep((sys.argv[2] if len(sys.argv) > 2 else "p0,p2,p3,p4,p6,p8").split(","))
    elif mode == "bench":
        apply(sys.argv[2])
        sys.argv = ["ninfer", "bench", *sys.argv[3:]]
        runpy.run_module("ninfer.cli.main", run_name="__main__")
    elif mode == "profile":
        apply(sys.argv[2])
        sys.argv = ["profile_gpu_step", *sys.argv[3:]]
        runpy.run_path(str(Path(__file__).with_name("profile_gpu_step.py")), run_name="__main__")
    else:
        raise SystemExit(__doc__)


if __name__ == "__main__":
    main()
