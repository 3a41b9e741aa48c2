"""The block-format decode gemv on a GPU, old routes against new, at the shapes a llama-8b Q4_K_M
decode step runs: per format, shape and row count, the error against float64 over gguf-py's
dequantization and the time per call (CUDA graph of 20 calls, each on its own copy of the weight so
that the small ones do not sit in L2; median of 20 replays) and weight GB/s
of each route (mma; tile; tile with the next block prefetched, blocks.TILE_PREFETCH; tile with its
registers bounded, blocks.TILE_BOUNDED; tile as blocks.tile_prefetch and tile_bounded choose per
shape); then one decode step's gemv time per route summed over the model (32 layers of q/k (q4_k)
+ v, o (q4_k), gate/up (q4_k), down, with v and down q6_k in the 16 `use_more_bits` layers, and the
q6_k lm_head) and the tok/s that time alone would allow. --mix q5_k_m: the same step
of a Q5_K_M file (q5_k where Q4_K_M has q4_k); --also q5_0,q5_1,iq4_nl,iq4_xs: those formats timed at
a few llama-8b and SmolLM2 shapes too (where the tile route takes them; not part of the step).

    python scripts/gpu_blocks.py [--quick] [--mix q4_k_m|q5_k_m] [--also q5_0,q5_1,...]   (about a minute on an H200)
"""
from __future__ import annotations

import argparse
import itertools
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
# routes; the tile route plain, prefetching (blocks.TILE_PREFETCH), with bounded registers (blocks.TILE_BOUNDED)
# and as blocks.tile_prefetch / tile_bounded choose per shape
VARIANTS = ("mma", "tile", "tile+pf", "tile+bounded", "tile+auto")
L2_BYTES = 128 << 20  # weights cycled through per timed call: more than the H200's 50 MB L2
LAYERS, MORE_BITS = 32, 16
# llama-8b: (name, N, K, format, calls per step); q/k/v fused where v is q4_k, else q/k and v apart
STEP = [("qkv", 6144, 4096, "q4_k", LAYERS - MORE_BITS), ("qk", 5120, 4096, "q4_k", MORE_BITS),
        ("v", 1024, 4096, "q6_k", MORE_BITS), ("o", 4096, 4096, "q4_k", LAYERS),
        ("gate_up", 28672, 4096, "q4_k", LAYERS), ("down", 4096, 14336, "q4_k", LAYERS - MORE_BITS),
        ("down", 4096, 14336, "q6_k", MORE_BITS), ("lm_head", 128256, 4096, "q6_k", 1)]
MIXES = {"q4_k_m": STEP,
         "q5_k_m": [(label, N, K, "q5_k" if f == "q4_k" else f, calls) for label, N, K, f, calls in STEP]}
# --also: llama-8b o and down, SmolLM2-135M q/o and gate/up (K = 576: not a multiple of 256, where
# llama.cpp's quantize falls back to q5_0)
ALSO = [("o", 4096, 4096), ("down", 4096, 14336), ("smol_o", 576, 576), ("smol_gate_up", 3072, 576)]


def weights(name: str, N: int, K: int, seed: int) -> torch.Tensor:
    from gguf import GGMLQuantizationType as Q
    from gguf_synth import random_blocks

    data = random_blocks(np.random.default_rng(seed), Q[name.upper()], N, K, scale=0.05)
    return torch.from_numpy(data).to(DEV)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="rows 1 and 8 only")
    ap.add_argument("--mix", choices=list(MIXES), default="q4_k_m", help="the file whose decode step is modelled")
    ap.add_argument("--also", default="", help="comma-separated formats also timed at the ALSO shapes")
    args = ap.parse_args()
    also = [(label, N, K, name, 0) for name in filter(None, args.also.split(",")) for label, N, K in ALSO
            if BK.route_ok("tile", TensorFormat(name), torch.bfloat16, K)]
    kc = KernelCompiler(Path(tempfile.mkdtemp()) / "kernels", device=0)
    print(f"{torch.cuda.get_device_name()}: gemv_blocks, time per call and weight bytes / time")
    rows = (1, 8) if args.quick else (1, 2, 4, 8)
    step: dict[tuple[str, int], float] = {}
    seen: dict[tuple[int, int, str], dict[tuple[str, int], float]] = {}
    for label, N, K, name, calls in MIXES[args.mix] + also:
        key = (N, K, name)
        if key not in seen:
            fmt = TensorFormat(name)
            w = weights(name, N, K, seed=N + K)
            ref_w = dequantize(fmt, {"": w}, torch.float64) if N * K <= 4096 * 14336 else None
            # distinct copies, each call the next: every call reads its weight from memory, as a decode
            # step does (one copy timed again and again stays in L2 when it fits)
            copies = [w] + [w.clone() for _ in range(min(19, L2_BYTES // w.numel()))]
            seen[key] = {}
            for M in rows:
                x = torch.randn(M, K, device=DEV).bfloat16()
                ref = x.double() @ ref_w.T if ref_w is not None else None
                line = f"{name:5s} {N:6d}x{K:5d} M={M}:"
                for variant in VARIANTS:
                    route = variant.split("+")[0]
                    BK.TILE_PREFETCH = {"tile": False, "tile+pf": True, "tile+bounded": False}.get(variant)
                    BK.TILE_BOUNDED = {"tile": False, "tile+bounded": True}.get(variant)
                    out = torch.full((M, N), float("nan"), device=DEV, dtype=torch.float32)
                    it = itertools.cycle(copies)
                    ms = bench(lambda: BK.gemv_blocks(kc, x, fmt, next(it), out, route))
                    BK.TILE_PREFETCH = BK.TILE_BOUNDED = None
                    seen[key][(variant, M)] = ms
                    err = f" rel {rel(out, ref):.1e}" if ref is not None else ""
                    line += f"  {variant} {ms * 1e3:6.1f} us {w.numel() / ms / 1e6:5.0f} GB/s{err}"
                print(line, flush=True)
            del ref_w, copies
        for (route, M), ms in seen[key].items():
            step[(route, M)] = step.get((route, M), 0.0) + calls * ms
    print(f"one llama-8b {args.mix.upper()} decode step, gemv only (32 layers + lm_head):")
    for M in rows:
        print(f"  M={M}: " + "   ".join(f"{v} {step[(v, M)]:5.2f} ms ({M * 1e3 / step[(v, M)]:6.1f} tok/s bound)"
                                       for v in VARIANTS))
    print(f"NVRTC compiles: {kc.compiled}")


if __name__ == "__main__":
    main()
