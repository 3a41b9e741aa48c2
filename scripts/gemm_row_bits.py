"""Does cuBLAS give a row the same bits whatever the other rows are? The prompt route runs every
matmul in blocks of exactly prompt_rows rows (cuda_ops.block_mm) so that it does; a 2048-token prompt
then costs 16 torch.mm launches per projection. This compares, per weight shape of a model, one
torch.mm over n rows against block_mm's blocks (and blocks of other sizes), bit for bit, and times
both (CUDA events, median of a few runs), so that the next change to the prompt route is decided by
data: one call per projection where the bits agree for every n, else the blocks. Also one batched
call over the same blocks (torch.bmm, the weight broadcast): the blocks' shape in one launch, which
fills the GPU where a 128-row block's tiles do not.

Usage: python scripts/gemm_row_bits.py [--shapes llama-8b|smollm2-135m] [--rows 128] [--n 2048,512,200]
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


def batched_mm(x: torch.Tensor, w_t: torch.Tensor, rows: int) -> torch.Tensor:
    """block_mm's blocks in one torch.bmm call (the weight broadcast over the blocks)."""
    n, K = x.shape
    blocks = -(-n // rows)
    padded = torch.zeros(blocks * rows, K, dtype=x.dtype, device=x.device)
    padded[:n] = x
    y = torch.bmm(padded.view(blocks, rows, K), w_t.unsqueeze(0).expand(blocks, *w_t.shape))
    return y.view(blocks * rows, -1)[:n]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="llama-8b", choices=sorted(SHAPES))
    ap.add_argument("--rows", type=int, default=128, help="block_mm's row block (the profile's prompt_rows)")
    ap.add_argument("--n", default="2048,512,200", help="prompt lengths")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device")
    g = torch.Generator(device="cuda").manual_seed(0)
    print(f"{'N x K':>13} {'n':>5} {'one mm = blocks':>16} {'bmm = blocks':>13} {'blocks ms':>10} {'one mm ms':>10} "
          f"{'bmm ms':>8}")
    for N, K in SHAPES[args.shapes]:
        w_t = (torch.randn(N, K, device="cuda", generator=g) * 0.02).to(torch.bfloat16).t()
        for n in (int(v) for v in args.n.split(",")):
            x = torch.randn(n, K, device="cuda", generator=g).to(torch.bfloat16)
            blocks = block_mm(x, w_t, args.rows)
            one = torch.mm(x, w_t)
            same = torch.equal(blocks, one)
            t_blocks = time_ms(lambda: block_mm(x, w_t, args.rows))
            t_one = time_ms(lambda: torch.mm(x, w_t))
            same_b = torch.equal(blocks, batched_mm(x, w_t, args.rows))
            t_bmm = time_ms(lambda: batched_mm(x, w_t, args.rows))
            print(f"{N:>6} x {K:<5} {n:>5} {str(same):>16} {str(same_b):>13} {t_blocks:>10.3f} {t_one:>10.3f} "
                  f"{t_bmm:>8.3f}")


if __name__ == "__main__":
    main()
