"""Decode attention alone (llama-8b's 32 query / 8 kv heads x 128, bf16, 64-token pages): time per
layer call and GB/s of K/V read, per variant (route, compile defines, split cap, partition), at 1
and 8 rows and contexts 512..64k; 50 calls captured in one CUDA graph (launch cost excluded). The
cuda backend only. Usage: PYTHONPATH=. python scripts/attention_bench.py"""
import sys, torch
from ninfer.kernels import launchers as L
from ninfer.kernels.compiler import KernelCompiler
from pathlib import Path; kc = KernelCompiler(Path('/tmp/kc_mb'), device=0)
dev = torch.device('cuda')
Hq, Hkv, D, page = 32, 8, 128, 64
orig_checks = L._attention_checks
def run(ctx, rows, route, extra, split, part, threads, reps=50):
    L.ATTN_MAX_SPLIT, L.ATTN_THREADS, L.ATTN_MMA_WARPS = split, threads, extra.get("NW", 4)
    L._attention_checks = lambda *a, **k: {**orig_checks(*a, **k), **extra}
    pages = -(-ctx // page)
    copies = 4
    caches = [(torch.randn(rows * pages, page, Hkv, D, device=dev).to(torch.bfloat16),
               torch.randn(rows * pages, page, Hkv, D, device=dev).to(torch.bfloat16)) for _ in range(copies)]
    q = torch.randn(rows, Hq, D, device=dev).to(torch.bfloat16); out = torch.empty_like(q)
    tables = torch.arange(rows * pages, dtype=torch.int32, device=dev).view(rows, pages)
    lens = torch.full((rows,), ctx, dtype=torch.int32, device=dev)
    parts = L.attention_parts(ctx, part)
    ws = (torch.empty(rows, Hq, parts, D, device=dev), torch.empty(rows, Hq, parts, 2, device=dev))
    for kcache, vcache in caches: L.paged_attention_decode(kc, q, kcache, vcache, tables, lens, ctx, out, D ** -0.5, part, ws, route=route)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(reps):
            kcache, vcache = caches[i % copies]
            L.paged_attention_decode(kc, q, kcache, vcache, tables, lens, ctx, out, D ** -0.5, part, ws, route=route)
    g.replay(); torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record(); g.replay(); e1.record(); torch.cuda.synchronize()
    t = e0.elapsed_time(e1) / reps * 1e-3
    nbytes = 2 * rows * ctx * Hkv * D * 2
    return t, nbytes / t / 1e9
variants = [("warp p64", "warp", {}, 32, 64, 128), ("mma w4 p64", "mma", {"NW": 4}, 32, 64, 128),
            ("mma w8 p64", "mma", {"NW": 8}, 32, 64, 128), ("mma w8 p128", "mma", {"NW": 8}, 32, 128, 128),
            ("mma w8 split16", "mma", {"NW": 8}, 16, 64, 128)]
for ctx, rows in ((512, 1), (4096, 1), (16384, 1), (16384, 8), (65536, 1)):
    for name, route, extra, split, part, threads in variants:
        try:
            t, bw = run(ctx, rows, route, extra, split, part, threads)
            print(f"ctx {ctx:6d} rows {rows} {name:18s} {t*1e6:8.1f} us {bw:7.0f} GB/s", flush=True)
        except Exception as e:
            print(f"ctx {ctx} rows {rows} {name}: {type(e).__name__} {e}"[:200], flush=True)
x = torch.empty(2 * 16384 * Hkv * D * 2 // 2, dtype=torch.bfloat16, device=dev); y = torch.empty_like(x)
y.copy_(x); torch.cuda.synchronize(); e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
e0.record(); [y.copy_(x) for _ in range(50)]; e1.record(); torch.cuda.synchronize()
t = e0.elapsed_time(e1) / 50 * 1e-3; print(f"copy 64 MiB: {t*1e6:.1f} us, {2 * x.numel() * 2 / t / 1e9:.0f} GB/s (read+write)")
