"""A/B of the int4 / int8 decode gemv routes on a GPU at llama-8b shapes: the route tiles replaced
(int4: mma, gemv_mma.cu; int8: warp, gemv.cu) against the tiled route (gemv_tiled.cu) and the tiled
kernel's tuning variants (slabs in flight per warp, activations loaded with the weights or when
computed, warps per block; stages and prefetch change speed only, warps the order of the sum).

Each timing reads enough copies of the weight to exceed the L2 cache (as a decode step reads its
weights), the calls captured in a CUDA graph, best of a few samples; GB/s counts the weight, scale
and min bytes once. Checks each output against fp64 first. One line per case, then the summary a
decode step would see (the shapes weighted as llama-8b runs them per token).

Usage: PYTHONPATH=. python scripts/gpu_int4_ab.py [--quick] [--stages 2,3] [--warps 8,16] [--xpre 1] [--minb 0,2]
       [--rows 1,8] [--xsmem 0,1] [--on-rule]
       [--shapes N:K,...] [--formats asym,sym,int8]
  (--quick: rows 1 and 8 only)
"""
from __future__ import annotations

import argparse
import math
import tempfile
from pathlib import Path

import torch

from ninfer.engine.quant import TensorFormat, dequantize, quantize
from ninfer.kernels import launchers as L
from ninfer.kernels.compiler import KernelCompiler
from ninfer.kernels.timing import sample_seconds

DEV = torch.device("cuda")
ROTATE = 512 << 20  # bytes a sample reads at least (the H200's L2 is 60 MiB)
# llama-8b decode matmuls per token: (N, K, count) with q|k|v and gate|up fused, lm_head at vocab 128256
SHAPES = [(6144, 4096, 32), (4096, 4096, 32), (28672, 4096, 32), (4096, 14336, 32), (128256, 4096, 1)]


def rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",")]


def variant_name(v: dict[str, int]) -> str:
    """A variant's name: s(stages) x(prefetch) w(warps) b(register cap), z where the activations sit in
    shared memory; 'tiled rule' for the rule's own settings (--on-rule)."""
    z = "z" if v.get("T4_XSMEM") else ""
    if "T4_STAGES" not in v:
        return f"tiled rule{'+' + z if z else ''}"
    return f"tiled s{v['T4_STAGES']}x{v['T4_XPRE']}w{v['T4_WARPS']}b{v['T4_MINB']}{z}"


def time_route(kc, fmt, copies, x, out, route, variant=None) -> float:
    def run() -> None:
        for parts in copies:
            L.gemv(kc, x, fmt, parts, out, route, variant)
    return min(sample_seconds(run, DEV, reps=7, graph=True)) / len(copies)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="rows 1 and 8 only")
    ap.add_argument("--rows", type=ints, default=None, help="activation row counts (default 1,2,4,8)")
    ap.add_argument("--formats", default="asym,sym", help="of asym, sym (int4 g32), int8 (g32)")
    ap.add_argument("--stages", type=ints, default=[2, 3, 4, 6, 8], help="T4_STAGES values to sweep")
    ap.add_argument("--warps", type=ints, default=[8], help="T4_WARPS values to sweep (8, 16)")
    ap.add_argument("--xpre", type=ints, default=[0, 1], help="T4_XPRE values to sweep")
    ap.add_argument("--minb", type=ints, default=[0], help="T4_MINB values to sweep (0: ptxas's registers)")
    ap.add_argument("--xsmem", type=ints, default=[0], help="T4_XSMEM values to sweep (1: the activations staged "
                    "in shared memory, where they fit launchers.TILED_XSMEM_BYTES)")
    ap.add_argument("--shapes", default="", help="N:K,... of SHAPES to run (default all)")
    ap.add_argument("--on-rule", action="store_true", help="variants of --xsmem only, on the rule's own stages, "
                    "prefetch and register cap (launchers.tiled_variant)")
    args = ap.parse_args()
    variants = [{"T4_STAGES": s, "T4_XPRE": p, "T4_WARPS": w, "T4_MINB": b, "T4_XSMEM": z}
                for w in args.warps for b in args.minb for s in args.stages for p in args.xpre for z in args.xsmem]
    if args.on_rule:
        variants = [{"T4_XSMEM": z} for z in args.xsmem]
    keep = {tuple(ints(v.replace(":", ","))) for v in args.shapes.split(",") if v} if args.shapes else None
    shapes = [s for s in SHAPES if keep is None or s[:2] in keep]
    kc = KernelCompiler(Path(tempfile.mkdtemp()) / "kernels", device=0)
    known = {"asym": TensorFormat("int4", 32, False), "sym": TensorFormat("int4", 32, True),
             "int8": TensorFormat("int8", 32)}
    fmts = {name: known[name] for name in args.formats.split(",")}
    rows = args.rows or ((1, 8) if args.quick else (1, 2, 4, 8))
    print(f"{torch.cuda.get_device_name()}  (GB/s: weight + scale bytes / time; samples read >= {ROTATE >> 20} MiB)")
    step: dict[tuple[str, str, int], float] = {}  # (format, candidate, rows) -> seconds per token
    for name, fmt in fmts.items():
        for N, K, count in shapes:
            g = torch.Generator(device=DEV).manual_seed(N + K)
            parts = quantize(torch.randn(N, K, generator=g, device=DEV) * 0.02, fmt)
            nbytes = sum(p.numel() * p.element_size() for p in parts.values())
            ncopies = max(1, math.ceil(ROTATE / nbytes))
            ref_w = dequantize(fmt, parts, torch.float64)
            before = "warp" if fmt.format == "int8" else "mma"
            packed = {r: L.gemv_pack(r, fmt, parts) for r in (before, "tiled")}
            copies = {r: [p] + [{k: v.clone() for k, v in p.items()} for _ in range(ncopies - 1)]
                      for r, p in packed.items()}
            for M in rows:
                x = torch.randn(M, K, generator=g, device=DEV).to(torch.bfloat16)
                out = torch.empty(M, N, device=DEV, dtype=torch.float32)
                ref = x.double() @ ref_w.T
                cands = [(before, before, None), ("tiled", "tiled", None)]
                cands += [(variant_name(v), "tiled", v) for v in variants]
                line = []
                tiled_out = None
                for label, route, variant in cands:
                    out.fill_(float("nan"))
                    L.gemv(kc, x, fmt, packed[route], out, route, variant)
                    err = rel(out, ref)
                    if not err < 1e-5:
                        print(f"  !! {label} {name} {N}x{K} M={M}: rel error {err:.1e}")
                        continue
                    if label == "tiled":
                        tiled_out = out.clone()
                    elif (route == "tiled" and variant.get("T4_WARPS", L.TILED_WARPS) == L.TILED_WARPS
                          and not torch.equal(out, tiled_out)):
                        print(f"  !! {label} {name} {N}x{K} M={M}: other bits than the default tiled launch")
                    s = time_route(kc, fmt, copies[route], x, out, route, variant)
                    step[(name, label, M)] = step.get((name, label, M), 0.0) + count * s
                    line.append(f"{label} {s * 1e6:7.1f} us {nbytes / s / 1e9:5.0f} GB/s")
                print(f"{name} N={N:6d} K={K:5d} M={M}: " + " | ".join(line[:2]))
                best = min(line[2:], key=lambda t: float(t.split(" us")[0].split()[-1]), default="")
                print(f"    variants: {' | '.join(line[2:])}\n    best variant: {best}")
            del copies, packed, ref_w
            torch.cuda.empty_cache()
    print("\nper token (llama-8b shapes x their count per token), ms; default tiled vs the route before it:")
    for name, fmt in fmts.items():
        before = "warp" if fmt.format == "int8" else "mma"
        for M in rows:
            mma, tiled = step.get((name, before, M), math.nan), step.get((name, "tiled", M), math.nan)
            variants = {k[1]: v for k, v in step.items()
                        if k[0] == name and k[2] == M and k[1] not in ("tiled", "mma", "warp")}
            best = min(variants, key=variants.get) if variants else "-"
            print(f"  {name} M={M}: {before} {mma * 1e3:.3f}  tiled {tiled * 1e3:.3f}  ({mma / tiled:.2f}x)  "
                  f"best variant {best} {variants.get(best, float('nan')) * 1e3:.3f}")


if __name__ == "__main__":
    main()
