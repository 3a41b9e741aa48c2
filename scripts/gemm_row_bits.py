"""Does cuBLAS give a row the same bits whatever the other rows are? The prompt route runs every
matmul in blocks of exactly prompt_rows rows (cuda_ops.block_mm) so that it does; a 2048-token prompt
then costs 16 torch.mm launches per projection, each too few tiles to fill the GPU. This compares, per
weight shape of a model, one torch.mm over n rows (padded to whole blocks) against block_mm's blocks,
bit for bit, for every n in the list, and times both at the largest n (CUDA events, median of a few
runs). With --no-splitk, torch's cuBLASLt backend with split-K kept out of its heuristics
(allow_bf16_reduced_precision_reduction = (False, False)): where every shape then agrees at every n,
one call per projection keeps the prompt route batch-invariant.

Usage: python scripts/gemm_row_bits.py [--shapes llama-8b|smollm2-135m] [--rows 128] [--n 128,256,...]
       [--no-splitk]
"""
from __future__ import annotations

import argparse
import statistics

import torch

from ninfer.engine.ops.cuda_ops import block_mm

SHAPES = {  # (N, K) of one layer's projections and the lm_head
    "llama-8b": [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (49152, 4096)],
    "smollm2-135m": [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576)],
}
DEFAULT_N = ",".join(str(128 * i) for i in range(1, 17)) + ",200,1000,4096"


def time_ms(fn, reps: int = 5) -> float:
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def one_mm(x: torch.Tensor, w_t: torch.Tensor, rows: int) -> torch.Tensor:
    """x @ w_t in one torch.mm over x padded to whole blocks of `rows`."""
    n = x.shape[0]
    padded = torch.zeros(-(-n // rows) * rows, x.shape[1], dtype=x.dtype, device=x.device)
    padded[:n] = x
    return torch.mm(padded, w_t)[:n]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="llama-8b", choices=sorted(SHAPES))
    ap.add_argument("--rows", type=int, default=128, help="block_mm's row block (the profile's prompt_rows)")
    ap.add_argument("--n", default=DEFAULT_N, help="prompt lengths")
    ap.add_argument("--no-splitk", action="store_true", help="cuBLASLt without split-K")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device")
    if args.no_splitk:
        torch.backends.cuda.preferred_blas_library("cublaslt")
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = (False, False)
    ns = [int(v) for v in args.n.split(",")]
    g = torch.Generator(device="cuda").manual_seed(0)
    print(f"{torch.cuda.get_device_name()}, {'cuBLASLt without split-K' if args.no_splitk else 'torch defaults'}")
    print(f"{'N x K':>13} {'n agreeing':>11} {'differ at n':>16} {'n':>5} {'blocks ms':>10} {'one mm ms':>10}")
    for N, K in SHAPES[args.shapes]:
        w_t = (torch.randn(N, K, device="cuda", generator=g) * 0.02).to(torch.bfloat16).t()
        x = torch.randn(max(ns), K, device="cuda", generator=g).to(torch.bfloat16)
        ref = block_mm(x, w_t, args.rows)
        differ = [n for n in ns if not torch.equal(one_mm(x[:n], w_t, args.rows), ref[:n])]
        n = max(ns)
        t_blocks = time_ms(lambda: block_mm(x, w_t, args.rows))
        t_one = time_ms(lambda: one_mm(x, w_t, args.rows))
        shown = ",".join(map(str, differ[:3])) + ("..." if len(differ) > 3 else "") or "-"
        print(f"{N:>6} x {K:<5} {len(ns) - len(differ):>5} of {len(ns):<3} {shown:>16} {n:>5} {t_blocks:>10.3f} "
              f"{t_one:>10.3f}")


if __name__ == "__main__":
    main()
