"""Measure the cuda kernels on a GPU: relative error against torch and time / bandwidth at
llama-8b decode shapes. Prints one line per case. Usage: python scripts/gpu_kernels.py"""
from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from ninfer.engine.quant import TensorFormat, dequantize, quantize
from ninfer.kernels import launchers as L
from ninfer.kernels.compiler import KernelCompiler

DEV = "cuda"


def bench(fn, reps: int = 20, calls: int = 20) -> float:
    """Median milliseconds of one fn() call: `calls` calls captured in a CUDA graph (so host launch
    time does not count, as in decode), the graph replayed `reps` times, timed with CUDA events."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / calls)
    return sorted(times)[len(times) // 2]


def rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def main() -> None:
    kc = KernelCompiler(Path(tempfile.mkdtemp()) / "kernels", device=0)
    print(f"{torch.cuda.get_device_name()}  (GB/s counts weight/KV bytes read once)")
    for N, K in ((6144, 4096), (28672, 4096), (4096, 14336)):
        for name, fmt in (("bf16", TensorFormat("bf16")), ("int8", TensorFormat("int8", 32)),
                          ("int4sym", TensorFormat("int4", 32, True)), ("int4asym", TensorFormat("int4", 32, False))):
            parts = quantize(torch.randn(N, K, device=DEV) * 0.02, fmt)
            nbytes = sum(p.numel() * p.element_size() for p in parts.values())
            for M in (1, 2, 4, 8):
                x = torch.randn(M, K, device=DEV).bfloat16()
                out = torch.empty(M, N, device=DEV, dtype=torch.bfloat16)
                ref = x.double() @ dequantize(fmt, parts, torch.float64).T
                for route in L.GEMV_ROUTES:
                    if not L.gemv_route_ok(route, fmt, K, x.dtype):
                        continue
                    packed = L.gemv_pack(route, fmt, parts)
                    ms = bench(lambda: L.gemv(kc, x, fmt, packed, out, route))
                    err = rel(out, ref)
                    line = (f"gemv {route:4s} {name:9s} M={M} N={N:6d} K={K:6d}: {ms * 1e3:7.1f} us "
                            f"{nbytes / ms / 1e6:6.0f} GB/s rel {err:.1e}")
                    if name == "bf16" and route == "warp":
                        w = parts[""]
                        line += f" | torch.matmul {bench(lambda: x @ w.T) * 1e3:7.1f} us"
                    print(line)
    from ninfer.kernels import blocks as BK

    for N, K in ((6144, 4096), (28672, 4096), (4096, 14336)):  # llama.cpp blocks, both routes, and the prefill expand
        for name in ("q4_k", "q6_k", "q5_0"):
            fmt = TensorFormat(name)
            w = quantize(torch.randn(N, K, device=DEV) * 0.02, fmt)[""] if name != "q5_0" else \
                torch.randint(0, 256, (N, K // 32 * 22), dtype=torch.uint8, device=DEV)
            if name == "q5_0":
                w.view(N, K // 32, 22)[..., :2] = torch.tensor([0x00, 0x1c], dtype=torch.uint8, device=DEV)  # d = 2^-8
            ref_w = dequantize(fmt, {"": w}, torch.float64)
            for M in (1, 2, 4, 8):
                x = torch.randn(M, K, device=DEV).bfloat16()
                out = torch.empty(M, N, device=DEV, dtype=torch.bfloat16)
                for route in BK.ROUTES:
                    if not BK.route_ok(route, fmt, x.dtype, K):
                        continue
                    ms = bench(lambda: BK.gemv_blocks(kc, x, fmt, w, out, route))
                    print(f"gemv_blocks {route:4s} {name:6s} M={M} N={N:6d} K={K:6d}: {ms * 1e3:7.1f} us "
                          f"{w.numel() / ms / 1e6:6.0f} GB/s rel {rel(out, x.double() @ ref_w.T):.1e}")
            dense = torch.empty(N, K, device=DEV, dtype=torch.bfloat16)
            ms = bench(lambda: BK.dequant_blocks(kc, fmt, w, dense))
            print(f"dequant_blocks {name:6s} N={N:6d} K={K:6d}: {ms * 1e3:7.1f} us ({(w.numel() + dense.numel() * 2) / ms / 1e6:6.0f} GB/s)")
    B, Hq, Hkv, D, ps = 8, 32, 8, 128, 16
    for ctx_len in (512, 4096, 32768):
        pages = B * ctx_len // ps
        kcache = torch.randn(pages, ps, Hkv, D, device=DEV).bfloat16()
        vcache = torch.randn(pages, ps, Hkv, D, device=DEV).bfloat16()
        tables = torch.randperm(pages, device=DEV).to(torch.int32).view(B, -1)
        lens = torch.full((B,), ctx_len, dtype=torch.int32, device=DEV)
        q = torch.randn(B, Hq, D, device=DEV).bfloat16()
        out = torch.empty_like(q)
        ms = bench(lambda: L.paged_attention_decode(kc, q, kcache, vcache, tables, lens, ctx_len, out, D ** -0.5))
        nbytes = 2 * B * ctx_len * Hkv * D * 2
        print(f"decode attention B={B} ctx={ctx_len:6d} Hq={Hq} Hkv={Hkv} D={D}: {ms * 1e3:8.1f} us {nbytes / ms / 1e6:6.0f} GB/s")
    T, H, I = 8, 4096, 14336
    x, w = torch.randn(T, H, device=DEV).bfloat16(), torch.randn(H, device=DEV).bfloat16()
    res, out = torch.randn(T, H, device=DEV).bfloat16(), torch.empty(T, H, device=DEV).bfloat16()
    print(f"rmsnorm_residual T={T} H={H}: {bench(lambda: L.rmsnorm_residual(kc, x, w, out, 1e-5, res)) * 1e3:.1f} us")
    gu, o2 = torch.randn(T, 2 * I, device=DEV).bfloat16(), torch.empty(T, I, device=DEV).bfloat16()
    print(f"swiglu T={T} I={I}: {bench(lambda: L.swiglu(kc, gu, o2)) * 1e3:.1f} us")
    V = 128256
    logits = torch.randn(T, V, device=DEV)
    f = lambda v: torch.full((T,), v, device=DEV)  # noqa: E731
    i = lambda v, dt: torch.full((T,), v, device=DEV, dtype=dt)  # noqa: E731
    toks = torch.empty(T, dtype=torch.int32, device=DEV)
    masks = torch.full((T, (V + 31) // 32), -1, dtype=torch.int32, device=DEV)  # no grammar: every id allowed
    for temp in (0.0, 0.7):
        args = (f(temp), i(20, torch.int32), f(0.9), f(0.05), i(1, torch.int64), i(0, torch.int64), toks)
        ms = bench(lambda: L.sample_tokens(kc, logits, masks, *args))
        print(f"sample_tokens B={T} V={V} temperature={temp}: {ms * 1e3:.1f} us")
    print(f"NVRTC compiles: {kc.compiled}")


if __name__ == "__main__":
    main()
