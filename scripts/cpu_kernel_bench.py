"""Time the native CPU decode kernel (ninfer/kernels/cpu_decode.c) per weight kind at one row, on
random codes: int4, 5-bit, 6-bit, int8 per 32 and per 16 inputs, at a few matrix shapes.

Usage: python scripts/cpu_kernel_bench.py [THREADS]   (default 2)
"""
import sys
import time

import torch

from ninfer.kernels.compiler import default_cache_dir
from ninfer.kernels.cpu_native import NativeWeight, load

SHAPES = ((128256, 2048), (8192, 2048), (2048, 8192), (576, 576))  # Llama-1B lm_head, up, down; SmolLM2


def seconds(fn, n: int = 20) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n


def main() -> None:
    torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 2)
    kernels = load(default_cache_dir())
    if kernels is None:
        sys.exit("the cpu decode kernels could not be built here")
    gen = torch.Generator().manual_seed(0)
    for n, k in SHAPES:
        x = torch.randn(1, k, generator=gen).bfloat16()
        s16, s32 = torch.rand(n, k // 16, generator=gen) * 0.01, torch.rand(n, k // 32, generator=gen) * 0.01
        q = torch.randint(0, 64, (n, k), generator=gen, dtype=torch.int32)
        weights = (("int4", NativeWeight.int4(q & 15, s32, s32, 32), 0.625),
                   ("5-bit", NativeWeight.wide(q & 31, s32, s32, 5), 0.6875),
                   ("6-bit", NativeWeight.wide(q, s16, s16, 6), 0.875),
                   ("int8/32", NativeWeight.int8((q - 32).to(torch.int8), s32, 32), 1.0625),
                   ("int8/16", NativeWeight.int8((q - 32).to(torch.int8), s16, 16), 1.125))
        cells = []
        for name, w, bytes_per_weight in weights:
            dt = seconds(lambda: kernels.linear(x, w, torch.bfloat16))
            cells.append(f"{name} {dt * 1e6:8.1f} us {n * k * bytes_per_weight / dt / 1e9:5.1f} GB/s")
        print(f"{n:6d} x {k:5d} | " + " | ".join(cells))


if __name__ == "__main__":
    main()
