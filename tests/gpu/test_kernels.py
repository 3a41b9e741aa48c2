"""Each cuda kernel against a torch reference on fresh random inputs (outputs NaN-poisoned first),
batch invariance of GEMV and attention, the launchers' argument checks, and the cubin cache."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from ninfer.engine.batch import SequenceWork
from ninfer.engine.quant import TensorFormat, dequantize, quantize
from ninfer.engine.request import SamplingParams
from ninfer.engine.sampler import fill_mask_row, sample
from ninfer.kernels import launchers as L
from ninfer.kernels.compiler import KernelCompiler, KernelError

DEV = "cuda"
BF, F32 = torch.bfloat16, torch.float32
# The activation dtypes every activation kernel is compiled for, and their error bounds. The fp32
# bound is far below bf16 rounding (~2e-3), so an fp32 path that rounds to bf16 anywhere fails.
ACTS = pytest.mark.parametrize("act", [BF, F32], ids=["bf16", "f32"])
TOL = {BF: 1e-2, F32: 1e-5}


def rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    assert not torch.isnan(out).any(), "output has NaN (unwritten or broken)"
    return ((out - ref).norm() / ref.norm()).item()


def poisoned(shape: tuple[int, ...], dtype: torch.dtype = BF) -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=dtype, device=DEV)


def gen(seed: int) -> torch.Generator:
    return torch.Generator(device=DEV).manual_seed(seed)


def randn(shape: tuple[int, ...], g: torch.Generator, dtype: torch.dtype = BF, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(shape, generator=g, device=DEV) * scale).to(dtype)


# ---------------------------------------------------------------- embedding, norm, swiglu

@ACTS
@pytest.mark.parametrize("H", [576, 4096])
def test_embedding(kc: KernelCompiler, H: int, act: torch.dtype) -> None:
    g = gen(1)
    table = randn((1000, H), g, act)
    ids = torch.randint(0, 1000, (9,), generator=g, device=DEV, dtype=torch.int32)
    ids[3] = ids[5]
    out = poisoned((9, H), act)
    L.embedding(kc, ids, table, out)
    assert torch.equal(out, table[ids.long()])


@pytest.mark.parametrize("fmt", [TensorFormat("int8", 32), TensorFormat("int4", 32, True),
                                 TensorFormat("int4", 32, False)], ids=["int8", "int4sym", "int4asym"])
@ACTS
def test_embedding_quant(kc: KernelCompiler, fmt: TensorFormat, act: torch.dtype) -> None:
    g = gen(2)
    parts = quantize(randn((500, 576), g, torch.float32), fmt)
    ids = torch.randint(0, 500, (7,), generator=g, device=DEV, dtype=torch.int32)
    out = poisoned((7, 576), act)
    L.embedding_quant(kc, ids, fmt, parts, out)
    ref = dequantize(fmt, parts, torch.float32)[ids.long()]
    assert rel(out, ref) < TOL[act]


@pytest.mark.parametrize("H", [576, 4096])
@pytest.mark.parametrize("with_residual", [False, True])
@ACTS
def test_rmsnorm_residual(kc: KernelCompiler, H: int, with_residual: bool, act: torch.dtype) -> None:
    g = gen(3)
    x, w = randn((5, H), g, act), randn((H,), g, act)
    residual = randn((5, H), g, act) if with_residual else None
    before = residual.clone() if residual is not None else None
    out = poisoned((5, H), act)
    L.rmsnorm_residual(kc, x, w, out, 1e-5, residual)
    r = (before + x) if before is not None else x  # an add in the activation dtype: fp32 sum rounded once
    if residual is not None:
        assert torch.equal(residual, r)
    rf = r.double()
    ref = rf * torch.rsqrt(rf.pow(2).mean(-1, keepdim=True) + 1e-5) * w.double()
    assert rel(out, ref) < TOL[act]


@ACTS
def test_swiglu(kc: KernelCompiler, act: torch.dtype) -> None:
    g = gen(4)
    gate_up = randn((7, 2 * 1536), g, act, scale=3.0)
    out = poisoned((7, 1536), act)
    L.swiglu(kc, gate_up, out)
    gf, uf = gate_up[:, :1536].double(), gate_up[:, 1536:].double()
    assert rel(out, torch.nn.functional.silu(gf) * uf) < TOL[act]


# ---------------------------------------------------------------- rope + kv write

def rotate_half(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


@pytest.mark.parametrize("D,Hq,Hkv,qk_norm,R", [(64, 9, 3, False, None), (128, 8, 2, True, None),
                                                 (256, 8, 2, True, 64), (128, 4, 4, False, 32)],
                         ids=["d64", "d128-norm", "d256-norm-partial64", "d128-partial32"])
@ACTS
def test_rope_kv_write(kc: KernelCompiler, D: int, Hq: int, Hkv: int, qk_norm: bool, R: int | None,
                       act: torch.dtype) -> None:
    """R: rotary_dim (qwen3.5's partial rotary: only the first R dims of a head rotate); None: all D."""
    g = gen(5)
    T, page_size, num_pages = 6, 16, 8
    qkv = randn((T, (Hq + 2 * Hkv) * D), g, act)  # q, k, v are views of one fused buffer
    q = qkv[:, : Hq * D].view(T, Hq, D)
    k = qkv[:, Hq * D: (Hq + Hkv) * D].view(T, Hkv, D)
    v = qkv[:, (Hq + Hkv) * D:].view(T, Hkv, D)
    q0, k0, v0 = q.clone(), k.clone(), v.clone()
    rot = D if R is None else R
    cos, sin = L.rope_cos_sin(rot, 4096, 10000.0, DEV)
    positions = torch.tensor([0, 1, 17, 100, 2047, 4095], dtype=torch.int32, device=DEV)
    slots = torch.randperm(num_pages * page_size, generator=g, device=DEV)[:T].to(torch.int32)
    slots[2] = -1  # padding: no cache write
    k_cache, v_cache = poisoned((num_pages, page_size, Hkv, D), act), poisoned((num_pages, page_size, Hkv, D), act)
    qn = randn((D,), g, act) if qk_norm else None
    kn = randn((D,), g, act) if qk_norm else None
    if R is None:
        L.rope_kv_write(kc, q, k, v, cos, sin, positions, slots, k_cache, v_cache, qn, kn, 1e-6)
    else:
        L.rope_kv_write(kc, q, k, v, cos, sin, positions, slots, k_cache, v_cache, qn, kn, 1e-6, rotary_dim=R)

    def ref_rope(x: torch.Tensor, w: torch.Tensor | None) -> torch.Tensor:
        xf = x.double()
        if w is not None:
            xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) * w.double()
        c = torch.cat((cos, cos), -1)[positions.long()][:, None, :].double()
        s = torch.cat((sin, sin), -1)[positions.long()][:, None, :].double()
        xr = xf[..., :rot]
        return torch.cat((xr * c + rotate_half(xr) * s, xf[..., rot:]), -1)

    assert rel(q, ref_rope(q0, qn)) < TOL[act]
    kref = ref_rope(k0, kn)
    flat_k, flat_v = k_cache.view(-1, Hkv, D), v_cache.view(-1, Hkv, D)
    written = slots >= 0
    idx = slots[written].long()
    assert rel(flat_k[idx], kref[written]) < TOL[act]
    assert torch.equal(flat_v[idx], v0[written])
    untouched = torch.ones(flat_k.shape[0], dtype=torch.bool, device=DEV)
    untouched[idx] = False
    assert torch.isnan(flat_k[untouched]).all() and torch.isnan(flat_v[untouched]).all()


# ---------------------------------------------------------------- paged attention

def make_cache(g: torch.Generator, lens: list[int], Hkv: int, D: int, page_size: int, act: torch.dtype = BF
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random K/V caches and block tables [B, max_pages] over a shuffled page pool."""
    pages_per = [math.ceil(n / page_size) for n in lens]
    num_pages = sum(pages_per) + 3
    perm = torch.randperm(num_pages, generator=g, device=DEV).to(torch.int32)
    max_pages = max(pages_per)
    tables = torch.full((len(lens), max_pages), -1, dtype=torch.int32, device=DEV)
    at = 0
    for b, n in enumerate(pages_per):
        tables[b, :n] = perm[at: at + n]
        at += n
    k_cache = randn((num_pages, page_size, Hkv, D), g, act)
    v_cache = randn((num_pages, page_size, Hkv, D), g, act)
    return k_cache, v_cache, tables


def ref_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, table: torch.Tensor,
                  n_keys: int, scale: float) -> torch.Tensor:
    """q [Hq, D] of one token attending keys 0..n_keys-1 of one sequence; fp64."""
    page_size, Hkv, D = k_cache.shape[1:]
    pos = torch.arange(n_keys, device=DEV)
    slot = table.long()[pos // page_size] * page_size + pos % page_size
    k = k_cache.view(-1, Hkv, D)[slot].double()  # [n, Hkv, D]
    v = v_cache.view(-1, Hkv, D)[slot].double()
    G = q.shape[0] // Hkv
    qf = q.double().view(Hkv, G, D)
    s = torch.einsum("hgd,nhd->hgn", qf, k) * scale
    return torch.einsum("hgn,nhd->hgd", s.softmax(-1), v).reshape(-1, D)


@pytest.mark.parametrize("D,Hq,Hkv", [(64, 9, 3), (128, 32, 8), (128, 16, 2), (256, 8, 1)])
@ACTS
def test_paged_attention_decode(kc: KernelCompiler, D: int, Hq: int, Hkv: int, act: torch.dtype) -> None:
    g = gen(6)
    lens = [1, 17, 600, 1500, 513]  # over 512 keys: split-K and the ordered combine
    page_size, scale = 16, D ** -0.5
    k_cache, v_cache, tables = make_cache(g, lens, Hkv, D, page_size, act)
    q = randn((len(lens), Hq, D), g, act)
    ctx = torch.tensor(lens, dtype=torch.int32, device=DEV)
    out = poisoned((len(lens), Hq, D), act)
    L.paged_attention_decode(kc, q, k_cache, v_cache, tables, ctx, max(lens), out, scale)
    for b, n in enumerate(lens):
        ref = ref_attention(q[b], k_cache, v_cache, tables[b], n, scale)
        assert rel(out[b], ref) < TOL[act], f"sequence {b}"


@pytest.mark.parametrize("D,Hq,Hkv", [(64, 9, 3), (128, 32, 8)])
def test_paged_attention_decode_batch_invariant(kc: KernelCompiler, D: int, Hq: int, Hkv: int) -> None:
    g = gen(7)
    lens = [1300, 40, 7, 900, 2048, 1, 515, 77]
    k_cache, v_cache, tables = make_cache(g, lens, Hkv, D, 16)
    q = randn((8, Hq, D), g)
    ctx = torch.tensor(lens, dtype=torch.int32, device=DEV)
    out8, out1 = poisoned((8, Hq, D)), poisoned((1, Hq, D))
    L.paged_attention_decode(kc, q, k_cache, v_cache, tables, ctx, max(lens), out8, D ** -0.5)
    L.paged_attention_decode(kc, q[:1], k_cache, v_cache, tables[:1], ctx[:1], lens[0], out1, D ** -0.5)
    assert torch.equal(out1[0], out8[0])


@pytest.mark.parametrize("D,Hq,Hkv", [(64, 9, 3), (128, 16, 4)])
@ACTS
def test_paged_attention_prefill(kc: KernelCompiler, D: int, Hq: int, Hkv: int, act: torch.dtype) -> None:
    g = gen(8)
    start = [0, 100, 5]  # the second sequence has a 100-token prefix hit
    new = [37, 20, 1]
    lens = [s + n for s, n in zip(start, new)]
    k_cache, v_cache, tables = make_cache(g, lens, Hkv, D, 16, act)
    T = sum(new)
    q = randn((T, Hq, D), g, act)
    cu = torch.tensor([0, 37, 57, 58], dtype=torch.int32, device=DEV)
    sp = torch.tensor(start, dtype=torch.int32, device=DEV)
    out = poisoned((T, Hq, D), act)
    L.paged_attention_prefill(kc, q, k_cache, v_cache, tables, cu, sp, max(lens), out, D ** -0.5)
    t = 0
    for b in range(3):
        for i in range(new[b]):
            ref = ref_attention(q[t], k_cache, v_cache, tables[b], start[b] + i + 1, D ** -0.5)
            assert rel(out[t], ref) < TOL[act], f"sequence {b} token {i}"
            t += 1


# ---------------------------------------------------------------- gemv

GEMV_FORMATS = [TensorFormat("bf16"), TensorFormat("int8", 32), TensorFormat("int4", 32, True),
                TensorFormat("int4", 32, False), TensorFormat("f32")]
GEMV_IDS = ["bf16", "int8", "int4sym", "int4asym", "f32"]


@pytest.mark.parametrize("fmt", GEMV_FORMATS, ids=GEMV_IDS)
@pytest.mark.parametrize("M", [1, 3, 8])
@pytest.mark.parametrize("act,out_dtype", [(BF, BF), (BF, F32), (F32, F32)], ids=["bf16", "bf16-f32out", "f32"])
def test_gemv(kc: KernelCompiler, fmt: TensorFormat, M: int, act: torch.dtype, out_dtype: torch.dtype) -> None:
    g = gen(9)
    N, K = 1000, 2048
    parts = quantize(randn((N, K), g, torch.float32, 0.05), fmt)
    x = randn((M, K), g, act)
    out = poisoned((M, N), out_dtype)
    L.gemv(kc, x, fmt, parts, out)
    ref = x.double() @ dequantize(fmt, parts, torch.float64).T
    assert rel(out, ref) < TOL[out_dtype]


MMA_FORMATS = [TensorFormat("bf16"), TensorFormat("int4", 32, True), TensorFormat("int4", 32, False),
               TensorFormat("int4", 64, True), TensorFormat("int4", 128, False), TensorFormat("int8", 32),
               TensorFormat("int8", 16)]
MMA_IDS = ["bf16", "int4sym", "int4asym", "int4sym-g64", "int4asym-g128", "int8", "int8-g16"]


@pytest.mark.parametrize("fmt", MMA_FORMATS, ids=MMA_IDS)
@pytest.mark.parametrize("M", list(range(1, 9)))
@pytest.mark.parametrize("N,K", [(1000, 2048), (960, 576), (16, 14336)])
def test_gemv_mma(kc: KernelCompiler, fmt: TensorFormat, M: int, N: int, K: int) -> None:
    """The tensor-core route against fp64 on fresh random data, every row count, SmolLM2/8B widths;
    fp32 out is held to the fp32 bound: the products are exact and only the summation order differs."""
    if fmt.quantized and K % fmt.group_size:
        pytest.skip("group size does not divide K")
    g = gen(11 + M)
    parts = quantize(randn((N, K), g, torch.float32, 0.05), fmt)
    x = randn((M, K), g)
    ref = x.double() @ dequantize(fmt, parts, torch.float64).T
    packed = L.gemv_pack("mma", fmt, parts)
    out = poisoned((M, N), F32)
    L.gemv(kc, x, fmt, packed, out, route="mma")
    assert rel(out, ref) < 1e-5
    out_bf = poisoned((M, N), BF)
    L.gemv(kc, x, fmt, packed, out_bf, route="mma")
    assert rel(out_bf, ref) < TOL[BF]


@pytest.mark.parametrize("pipe", [2, 3, 4, 8])
@pytest.mark.parametrize("N,K", [(1000, 2048), (960, 576), (16, 14336), (64, 4128), (32, 96), (48, 1376)])
def test_gemv_mma_pipes_give_the_built_in_loops_bits(kc: KernelCompiler, pipe: int, N: int, K: int) -> None:
    """bf16 MMA_PIPE (iterations in flight a warp, chosen by shape or by the device profile) changes
    speed only: the output equals the built-in loop's (MMA_PIPE 0) bit for bit, at iteration counts
    a warp holds fewer of than the pipe, not a multiple of it, and many of; and so do the pipe with
    its first weights loaded before the PDL wait (MMA_EARLY) and the rule's."""
    g = gen(N + K)
    fmt = TensorFormat("bf16")
    parts = L.gemv_pack("mma", fmt, {"": randn((N, K), g, torch.float32, 0.05).to(BF)})
    for M in (1, 3, 8):
        x = randn((M, K), g)
        for out_dtype in (F32, BF):
            base, out, early, rule = (poisoned((M, N), out_dtype) for _ in range(4))
            L.gemv(kc, x, fmt, parts, base, route="mma", variant={"MMA_PIPE": 0})
            L.gemv(kc, x, fmt, parts, out, route="mma", variant={"MMA_PIPE": pipe})
            L.gemv(kc, x, fmt, parts, early, route="mma", variant={"MMA_PIPE": pipe, "MMA_EARLY": 1})
            L.gemv(kc, x, fmt, parts, rule, route="mma")
            assert torch.equal(out, base) and torch.equal(early, base) and torch.equal(rule, base), (M, out_dtype)


@pytest.mark.parametrize("N,K", [(1000, 2048), (16, 14336), (48, 1376), (4096, 4096)])
def test_gemv_mma_staged_activations_give_the_same_bits(kc: KernelCompiler, N: int, K: int) -> None:
    """MMA_XSMEM (bf16's activations copied into shared memory after the PDL wait, the pipeline reading
    them there) changes speed only: the rule's bits, with fp32 and bf16 output, rows whose stride exceeds
    K, a gated MLP's epilogue, and row counts whose M (K + 8) * 2 bytes do not fit (read from global)."""
    g = gen(N + K + 2)
    fmt = TensorFormat("bf16")
    parts = L.gemv_pack("mma", fmt, {"": randn((N, K), g, torch.float32, 0.05).to(BF)})
    for M in (1, 2, 3, 8):
        x = randn((M, K + 64), g)[:, :K]
        for out_dtype in (F32, BF):
            base, out = poisoned((M, N), out_dtype), poisoned((M, N), out_dtype)
            L.gemv(kc, x, fmt, parts, base, route="mma")
            L.gemv(kc, x, fmt, parts, out, route="mma", variant={"MMA_XSMEM": 1})
            assert torch.equal(out, base), (M, out_dtype)
        if N % 16:
            continue  # a gated MLP's rows come in 8s of gate and up
        base, out = poisoned((M, N // 2), BF), poisoned((M, N // 2), BF)
        L.gemv(kc, x, fmt, parts, base, route="mma", glu="silu")
        L.gemv(kc, x, fmt, parts, out, route="mma", glu="silu", variant={"MMA_XSMEM": 1})
        assert torch.equal(out, base), (M, "glu")


@pytest.mark.parametrize("fmt", GEMV_FORMATS[:4], ids=GEMV_IDS[:4])
@pytest.mark.parametrize("N,K", [(1000, 2048), (16, 14336), (48, 1536)])
def test_gemv_mma_weight_prefetch_gives_the_same_bits(kc: KernelCompiler, fmt: TensorFormat, N: int, K: int) -> None:
    """MMA_L2PF (launchers.WEIGHT_PREFETCH: the block's weight rows asked of L2 before the PDL wait; bf16's
    rule asks one line a thread), in the region's order or in k order across the rows (MMA_L2PF_K), is a
    hint: the output equals the rule's bit for bit, without it, with fewer lines a thread than a block's
    rows take, as many and more, and a last block of fewer than 16 rows."""
    g = gen(N + K + 1)
    parts = L.gemv_pack("mma", fmt, quantize(randn((N, K), g, torch.float32, 0.05), fmt))
    for M in (1, 8):
        x = randn((M, K), g)
        base = poisoned((M, N), F32)
        L.gemv(kc, x, fmt, parts, base, route="mma")
        for lines, k_order in ((0, 0), (1, 0), (4, 0), (32, 0), (1, 1), (4, 1), (32, 1)):
            out = poisoned((M, N), F32)
            L.gemv(kc, x, fmt, parts, out, route="mma", variant={"MMA_L2PF": lines, "MMA_L2PF_K": k_order})
            assert torch.equal(out, base), (M, lines, k_order)


@pytest.mark.parametrize("fmt", GEMV_FORMATS, ids=GEMV_IDS)
@pytest.mark.parametrize("route", L.GEMV_ROUTES)
def test_gemv_batch_invariant(kc: KernelCompiler, fmt: TensorFormat, route: str) -> None:
    g = gen(10)
    N, K = 576, 1536
    if not L.gemv_route_ok(route, fmt, K, BF):  # f32 weights on the mma route
        pytest.skip(f"the {route} route does not take {fmt.format}")
    parts = L.gemv_pack(route, fmt, quantize(randn((N, K), g, torch.float32, 0.05), fmt))
    x = randn((8, K), g)
    out1 = poisoned((1, N), torch.float32)
    L.gemv(kc, x[:1], fmt, parts, out1, route=route)
    for M in range(2, 9):
        outM = poisoned((M, N), torch.float32)
        L.gemv(kc, x[:M], fmt, parts, outM, route=route)
        assert torch.equal(out1[0], outM[0]), M


def test_gemv_mma_refuses_what_it_does_not_take(kc: KernelCompiler) -> None:
    g = gen(12)
    for fmt, K in ((TensorFormat("int8", 32), 288), (TensorFormat("f32"), 256)):  # int8 takes K in 64s
        parts = quantize(randn((64, K), g, torch.float32, 0.05), fmt)
        with pytest.raises(KernelError, match="mma gemv does not take"):
            L.gemv(kc, randn((1, K), g), fmt, parts, poisoned((1, 64), F32), route="mma")
    w = randn((64, 256), g)
    with pytest.raises(KernelError, match="mma gemv does not take"):  # fp32 activations: the warp route
        L.gemv(kc, randn((1, 256), g, F32), TensorFormat("bf16"), {"": w}, poisoned((1, 64), F32), route="mma")
    with pytest.raises(KernelError, match="route must be one of"):
        L.gemv(kc, randn((1, 256), g), TensorFormat("bf16"), {"": w}, poisoned((1, 64), F32), route="fast")


@pytest.mark.parametrize("D,Hq,Hkv", [(64, 9, 3), (128, 16, 4), (128, 8, 8)])
def test_attention_prefill_mma(kc: KernelCompiler, D: int, Hq: int, Hkv: int) -> None:
    """The tensor-core prefill against fp64: several query tiles, prefix hits that do not start on a
    tile, one-token chunks, GQA groups of 3, 4 and 1."""
    g = gen(14)
    start, new = [0, 100, 5, 130], [150, 20, 1, 70]
    lens = [s + n for s, n in zip(start, new)]
    k_cache, v_cache, tables = make_cache(g, lens, Hkv, D, 16)
    T = sum(new)
    q = randn((T, Hq, D), g)
    cu = torch.tensor([0] + np.cumsum(new).tolist(), dtype=torch.int32, device=DEV)
    sp = torch.tensor(start, dtype=torch.int32, device=DEV)
    out = poisoned((T, Hq, D))
    L.paged_attention_prefill(kc, q, k_cache, v_cache, tables, cu, sp, max(lens), out, D ** -0.5, route="mma")
    t = 0
    for b in range(len(new)):
        for i in range(new[b]):
            ref = ref_attention(q[t], k_cache, v_cache, tables[b], start[b] + i + 1, D ** -0.5)
            assert rel(out[t], ref) < TOL[BF], f"sequence {b} token {i}"
            t += 1


def test_attention_prefill_mma_chunks_and_batches_are_invariant(kc: KernelCompiler) -> None:
    """A 200-token prompt in one step, in chunks 64 + 86 + 50, and inside a batch of others: bit-equal rows."""
    g = gen(15)
    D, Hq, Hkv = 128, 8, 2
    k_cache, v_cache, tables = make_cache(g, [200, 90, 33], Hkv, D, 16)
    q = randn((200, Hq, D), g)
    one = poisoned((200, Hq, D))
    i32 = lambda v: torch.tensor(v, dtype=torch.int32, device=DEV)  # noqa: E731
    L.paged_attention_prefill(kc, q, k_cache, v_cache, tables[:1], i32([0, 200]), i32([0]), 200, one, D ** -0.5,
                              route="mma")
    for a, b in ((0, 64), (64, 150), (150, 200)):
        part = poisoned((b - a, Hq, D))
        L.paged_attention_prefill(kc, q[a:b], k_cache, v_cache, tables[:1], i32([0, b - a]), i32([a]), b, part,
                                  D ** -0.5, route="mma")
        assert torch.equal(part, one[a:b]), (a, b)
    others = randn((40, Hq, D), g)
    qb = torch.cat([others[:30], q[100:150], others[30:]])
    mixed = poisoned((90, Hq, D))
    L.paged_attention_prefill(kc, qb, k_cache, v_cache, tables[[1, 0, 2]], i32([0, 30, 80, 90]), i32([60, 100, 23]),
                              200, mixed, D ** -0.5, route="mma")
    assert torch.equal(mixed[30:80], one[100:150])


def test_attention_prefill_mma_refuses(kc: KernelCompiler) -> None:
    g = gen(16)
    k_cache, v_cache, tables = make_cache(g, [8], 1, 256, 16)
    q = randn((8, 1, 256), g)
    i32 = lambda v: torch.tensor(v, dtype=torch.int32, device=DEV)  # noqa: E731
    with pytest.raises(KernelError, match="head_dim 64 or 128"):
        L.paged_attention_prefill(kc, q, k_cache, v_cache, tables, i32([0, 8]), i32([0]), 8, poisoned((8, 1, 256)),
                                  0.0625, route="mma")
    with pytest.raises(KernelError, match="route must be one of"):
        L.paged_attention_prefill(kc, q, k_cache, v_cache, tables, i32([0, 8]), i32([0]), 8, poisoned((8, 1, 256)),
                                  0.0625, route="flash")


@pytest.mark.parametrize("fmt", [TensorFormat("int8", 32), TensorFormat("int4", 32, True), TensorFormat("int4", 32, False),
                                 TensorFormat("int4", 64, False), TensorFormat("int8", 128)],
                         ids=["int8", "int4sym", "int4asym", "int4asym-g64", "int8-g128"])
@pytest.mark.parametrize("route", L.GEMV_ROUTES)
@pytest.mark.parametrize("K", [576, 2048])
@pytest.mark.parametrize("dtype", [BF, F32], ids=["bf16", "f32"])
def test_dequantize_weight_equals_quant_dequantize(kc: KernelCompiler, fmt: TensorFormat, route: str, K: int,
                                                   dtype: torch.dtype) -> None:
    """The prompt route's expansion is bit-equal to quant.dequantize, from either route's layout."""
    if K % fmt.group_size:
        pytest.skip("group size does not divide K")
    g = gen(13)
    parts = quantize(randn((100, K), g, torch.float32, 0.05), fmt)
    out = poisoned((100, K), dtype)
    L.dequantize_weight(kc, fmt, L.gemv_pack(route, fmt, parts), out, route)
    assert torch.equal(out, dequantize(fmt, parts, dtype))


# ---------------------------------------------------------------- sampling

MASK = 0xFFFFFFFF


def philox4x32_10(ctr: list[int], k0: int, k1: int) -> list[int]:
    """Random123's Philox4x32-10, independently of the kernel (checked against its known answer)."""
    c = list(ctr)
    for r in range(10):
        if r:
            k0, k1 = (k0 + 0x9E3779B9) & MASK, (k1 + 0xBB67AE85) & MASK
        p0, p1 = 0xD2511F53 * c[0], 0xCD9E8D57 * c[2]
        c = [((p1 >> 32) ^ c[1] ^ k0) & MASK, p1 & MASK, ((p0 >> 32) ^ c[3] ^ k1) & MASK, p0 & MASK]
    return c


def test_philox_reference_known_answer() -> None:
    assert philox4x32_10([0, 0, 0, 0], 0, 0) == [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]


def ref_candidates(v: torch.Tensor, temp: float, k: int, tp: float, mp: float) -> tuple[list[int], list[float]]:
    """Kept candidate ids and their unnormalized probabilities (float64), as sampling.cu defines them."""
    vals, ids = torch.sort(v, descending=True, stable=True)
    vals, ids = vals[:k].double().tolist(), ids[:k].tolist()
    p = [math.exp((x - vals[0]) / temp) if x != -math.inf else 0.0 for x in vals]
    total, keep, mass = sum(p), 1, p[0]
    while keep < len(p) and mass < tp * total and p[keep] >= mp * p[0]:
        mass += p[keep]
        keep += 1
    return ids[:keep], p[:keep]


def ref_sample(v: torch.Tensor, temp: float, k: int, tp: float, mp: float, seed: int, step: int) -> int:
    if temp <= 0:
        return int(torch.sort(v, descending=True, stable=True)[1][0])
    ids, p = ref_candidates(v, temp, k, tp, mp)
    c = philox4x32_10([step & MASK, step >> 32, 0, 0], seed & MASK, seed >> 32)
    target = (c[0] >> 8) / 2.0 ** 24 * sum(p)
    run = 0.0
    for i, pi in zip(ids, p):
        run += pi
        if run > target:
            return i
    return ids[-1]


def sampler_inputs(B: int, temp: list[float], k: list[int], tp: list[float], mp: list[float], seed: list[int],
                   step: list[int], V: int) -> dict[str, torch.Tensor]:
    return {"masks": torch.full((B, (V + 31) // 32), -1, dtype=torch.int32, device=DEV),  # nothing masked
            "temperature": torch.tensor(temp, dtype=torch.float32, device=DEV),
            "top_k": torch.tensor(k, dtype=torch.int32, device=DEV),
            "top_p": torch.tensor(tp, dtype=torch.float32, device=DEV),
            "min_p": torch.tensor(mp, dtype=torch.float32, device=DEV),
            "seeds": torch.tensor(seed, dtype=torch.int64, device=DEV),
            "steps": torch.tensor(step, dtype=torch.int64, device=DEV)}


@pytest.fixture(params=[(False, False), (True, False), (True, True)], ids=["scan", "vec", "vec-split"])
def sample_vec(request, monkeypatch) -> bool:
    """sample_tokens with its one-logit scan, with the SAMPLE_VEC scan (where the rows allow it), and with
    that scan split over blocks (SAMPLE_SPLIT, rows past SAMPLE_PART logits)."""
    vec, split = request.param
    monkeypatch.setattr(L, "SAMPLE_VEC", vec)
    monkeypatch.setattr(L, "SAMPLE_SPLIT", split)
    return vec


def test_sample_greedy_ties_and_penalties(kc: KernelCompiler, sample_vec: bool) -> None:
    g = gen(11)
    B, V = 4, 50000
    logits = torch.randn((B, V), generator=g, device=DEV)
    logits[0, 777] = logits[0, 31337] = 50.0  # a tie: the lower id wins
    logits[1, 123] = float("nan")
    counts = torch.zeros((B, V), dtype=torch.int32, device=DEV)
    logits[2, 4242], logits[2, 99] = 40.0, 39.0
    counts[2, 4242] = 3  # 40 - 0.5 - 3 * 0.4 = 38.3 < 39: the penalty moves the argmax
    params = sampler_inputs(B, [0.0] * B, [20] * B, [1.0] * B, [0.0] * B, [1] * B, [0] * B, V)
    tokens = torch.full((B,), -7, dtype=torch.int32, device=DEV)
    pres = torch.full((B,), 0.5, device=DEV)
    freq = torch.full((B,), 0.4, device=DEV)
    L.sample_tokens(kc, logits, tokens=tokens, counts=counts, presence=pres, frequency=freq, **params)
    penalized = logits - (counts > 0).float() * 0.5 - counts.float() * 0.4
    penalized = torch.nan_to_num(penalized, nan=-math.inf)
    assert tokens.tolist()[:3] == [777, int(penalized[1].argmax()), 99]
    assert tokens[3].item() == int(penalized[3].argmax())


def test_sample_matches_reference(kc: KernelCompiler, sample_vec: bool) -> None:
    g = gen(12)
    B, V = 64, 32000
    logits = torch.randn((B, V), generator=g, device=DEV) * 3
    counts = torch.randint(0, 3, (B, V), generator=g, device=DEV, dtype=torch.int32)
    temp = [0.0 if b % 8 == 0 else 0.3 + 0.05 * b for b in range(B)]
    k = [1 + b % 20 for b in range(B)]
    tp = [1.0 if b % 3 == 0 else 0.5 + 0.007 * b for b in range(B)]
    mp = [0.0 if b % 4 else 0.05 for b in range(B)]
    seed = [2 ** 40 + 17 * b for b in range(B)]
    step = [b * 3 + 1 for b in range(B)]
    params = sampler_inputs(B, temp, k, tp, mp, seed, step, V)
    pres, freq = torch.full((B,), 0.2, device=DEV), torch.full((B,), 0.1, device=DEV)
    tokens = torch.full((B,), -7, dtype=torch.int32, device=DEV)
    L.sample_tokens(kc, logits, tokens=tokens, counts=counts, presence=pres, frequency=freq, **params)
    again = torch.full((B,), -7, dtype=torch.int32, device=DEV)
    L.sample_tokens(kc, logits, tokens=again, counts=counts, presence=pres, frequency=freq, **params)
    assert torch.equal(tokens, again)  # same (seed, step): same draw
    pen = (logits - ((counts > 0).float() * 0.2 + counts.float() * 0.1)).cpu()
    ref = [ref_sample(pen[b], temp[b], k[b], tp[b], mp[b], seed[b], step[b]) for b in range(B)]
    got = tokens.tolist()
    greedy = [b for b in range(B) if temp[b] <= 0]
    assert all(got[b] == ref[b] for b in greedy)
    # a draw within float rounding of a bucket edge may differ between fp32 and fp64
    assert sum(a == r for a, r in zip(got, ref)) >= B - 2, (got, ref)


def test_sample_distribution(kc: KernelCompiler, sample_vec: bool) -> None:
    g = gen(13)
    B, V = 16384, 64
    row = torch.randn((V,), generator=g, device=DEV) * 2
    logits = row.expand(B, V)  # row stride 0: one distribution, B independent draws
    params = sampler_inputs(B, [0.8] * B, [20] * B, [0.9] * B, [0.01] * B, [12345] * B, list(range(B)), V)
    tokens = torch.full((B,), -7, dtype=torch.int32, device=DEV)
    L.sample_tokens(kc, logits, tokens=tokens, **params)
    ids, p = ref_candidates(row.cpu(), 0.8, 20, 0.9, 0.01)
    freq = torch.bincount(tokens.long(), minlength=V).double().cpu() / B
    expect = torch.zeros(V, dtype=torch.float64)
    expect[ids] = torch.tensor(p, dtype=torch.float64) / sum(p)
    assert freq[[i for i in range(V) if i not in ids]].sum() == 0
    assert (freq - expect).abs().max() < 0.015


def _sampler_rows(B: int, V: int, rng: np.random.Generator, masked: set[int]) -> list[SequenceWork]:
    """Random sampler settings, penalties, seeds and grammar masks, one SequenceWork per row."""
    seqs = []
    for b in range(B):
        out = rng.integers(0, min(64, V), int(rng.integers(0, 40))).tolist()  # repeats: counts above 1
        sp = SamplingParams(temperature=0.0 if b % 9 == 0 else float(rng.uniform(0.1, 2.0)),
                            top_k=int(rng.integers(0, 25)), top_p=float(rng.choice([1.0, rng.uniform(0.05, 1.0)])),
                            min_p=float(rng.choice([0.0, rng.uniform(0.0, 0.4)])),
                            presence_penalty=float(rng.choice([0.0, rng.uniform(-1.0, 2.0)])),
                            frequency_penalty=float(rng.choice([0.0, rng.uniform(-0.5, 1.0)])))
        seq = SequenceWork(seq_id=b, token_ids=[1], start_pos=0, block_table=[0], sample=True, sampling=sp,
                           output_token_ids=out, seed=int(rng.integers(0, 2 ** 64, dtype=np.uint64)))
        if b in masked:  # a sparse grammar mask, allowing about one id in 16
            bits = rng.random((1, ((V + 31) // 32) * 32)) < 1 / 16
            words = (bits.reshape(1, -1, 32).astype(np.uint64) << np.arange(32, dtype=np.uint64)).sum(-1)
            seq.token_mask = torch.from_numpy(words.astype(np.uint32).view(np.int32))
        seqs.append(seq)
    return seqs


def _kernel_sample(kc: KernelCompiler, logits: torch.Tensor, seqs: list[SequenceWork],
                   vec: bool | None = None, split: bool | None = None) -> torch.Tensor:
    """tokens [B] int32 from sample_tokens, its inputs built from the rows as a runner builds them."""
    B, V = logits.shape
    masks = torch.empty((B, (V + 31) // 32), dtype=torch.int32, device=DEV)
    counts = torch.zeros((B, V), dtype=torch.int32, device=DEV)
    for b, s in enumerate(seqs):
        fill_mask_row(masks[b], s.token_mask)
        if s.output_token_ids:
            counts[b] = torch.bincount(torch.tensor(s.output_token_ids, device=DEV), minlength=V).int()
    f32 = lambda xs: torch.tensor(xs, dtype=torch.float32, device=DEV)  # noqa: E731
    sps = [s.sampling for s in seqs]
    seeds = [s.seed - 2 ** 64 if s.seed >= 2 ** 63 else s.seed for s in seqs]
    tokens = torch.full((B,), -7, dtype=torch.int32, device=DEV)
    L.sample_tokens(kc, logits, masks, f32([0.0 if p.greedy else p.temperature for p in sps]),
                    torch.tensor([min(max(p.top_k, 1), 20) for p in sps], dtype=torch.int32, device=DEV),
                    f32([p.top_p for p in sps]), f32([p.min_p for p in sps]),
                    torch.tensor(seeds, dtype=torch.int64, device=DEV),
                    torch.tensor([len(s.output_token_ids) for s in seqs], dtype=torch.int64, device=DEV), tokens,
                    counts, f32([p.presence_penalty for p in sps]), f32([p.frequency_penalty for p in sps]), vec=vec,
                    split=split)
    return tokens


def _allowed(mask: torch.Tensor, token: int) -> bool:
    return bool((int(mask.reshape(-1)[token // 32]) >> (token % 32)) & 1)


@pytest.mark.parametrize("V", [50257, 50256, 1000])
def test_sample_matches_torch_sampler(kc: KernelCompiler, V: int, sample_vec: bool) -> None:
    """One sampler definition: the kernel and ninfer.engine.sampler draw the same token, row for row."""
    rng = np.random.default_rng(V)
    B = 128
    logits = torch.from_numpy(rng.standard_normal((B, V)).astype(np.float32) * 3).to(DEV)
    logits[1, 5] = float("nan")
    logits[2, :] = 0.5  # all tied: the lowest ids are the candidates
    logits[3:5, 100:400] = 9.0  # ties across the top-k cut; row 4 masked too
    masked = (set(rng.choice(B, B // 4, replace=False).tolist()) - {2, 3}) | {4}
    seqs = _sampler_rows(B, V, rng, masked)
    ours = _kernel_sample(kc, logits, seqs).tolist()
    theirs, _ = sample(logits, seqs)
    assert ours == theirs
    assert len(set(ours)) > B // 2  # it really samples
    for b in masked:
        assert _allowed(seqs[b].token_mask, ours[b])


def _scan_case(B: int, V: int, seed: int) -> tuple[torch.Tensor, list[SequenceWork]]:
    """Logits [B, V] with a NaN, a row of ties and ties across the top-k cut, and random sampler rows
    (a quarter of them masked, row 4 among them): the cases where two scans could differ."""
    rng = np.random.default_rng(seed)
    logits = torch.from_numpy(rng.standard_normal((B, V)).astype(np.float32) * 3).to(DEV)
    logits[1, 5] = float("nan")
    logits[2, :] = 0.5
    logits[3:5, 10:50] = 9.0
    return logits, _sampler_rows(B, V, rng, set(rng.choice(B, B // 4, replace=False).tolist()) | {4})


@pytest.mark.parametrize("V", [50256, 1000, 64])
def test_sample_vec_scan_draws_the_scans_tokens(kc: KernelCompiler, V: int) -> None:
    """The SAMPLE_VEC scan (four logits a load) takes rows of V in 4s and gives the one-logit scan's
    tokens row for row: grammar masks, penalties, ties across the top-k cut, NaN, every sampler setting."""
    B = 96
    logits, seqs = _scan_case(B, V, seed=V + 1)
    assert L.sample_vec_ok(logits, torch.zeros((B, V), dtype=torch.int32, device=DEV))
    assert not L.sample_vec_ok(logits[:, 1:], None) and not L.sample_vec_ok(logits[:, :V - 2], None)
    assert torch.equal(_kernel_sample(kc, logits, seqs, vec=False), _kernel_sample(kc, logits, seqs, vec=True))


SPLITS = [(V, part) for V in (50257, 50256, 1000, 64) for part in (4096, 100, 8)] + [(20, 5)]


@pytest.mark.parametrize("V,part", SPLITS, ids=[f"V{v}-part{p}" for v, p in SPLITS])
def test_sample_split_scan_draws_the_scans_tokens(kc: KernelCompiler, monkeypatch, V: int, part: int) -> None:
    """The scan split over blocks (each part's top k, then one block's merge) gives the one-block scan's
    tokens row for row, both scans, parts of 5 logits to 4,096 (up to SAMPLE_MAX_PARTS; parts with fewer
    logits than top_k among them, and at V 20 an empty one): masks, penalties, ties across the top-k cut,
    NaN."""
    B = 64
    logits, seqs = _scan_case(B, V, seed=V + part)
    monkeypatch.setattr(L, "SAMPLE_PART", part)
    for vec in (False, True):
        one = _kernel_sample(kc, logits, seqs, vec=vec, split=False)
        assert torch.equal(_kernel_sample(kc, logits, seqs, vec=vec, split=True), one), vec
    assert len(set(one.tolist())) > min(B // 4, V // 2)  # it really samples


def test_sample_masked_rows_draw_only_allowed_ids(kc: KernelCompiler, sample_vec: bool) -> None:
    g = gen(15)
    B, V = 4096, 32003  # a partial last mask word
    row = torch.randn((V,), generator=g, device=DEV)
    allowed = [0, 31, 32, 777, 5000, V - 1]  # bit 0, bit 31 (the sign bit), word edges, the last id
    words = np.zeros((1, (V + 31) // 32), dtype=np.uint32)
    for t in allowed:
        words[0, t // 32] |= np.uint32(1 << (t % 32))
    mask = torch.from_numpy(words.view(np.int32))
    masks = torch.empty((B, mask.shape[1]), dtype=torch.int32, device=DEV)
    for b in range(B):
        fill_mask_row(masks[b], mask if b % 2 else None)  # even rows unmasked
    params = sampler_inputs(B, [3.0] * B, [20] * B, [1.0] * B, [0.0] * B, [99] * B, list(range(B)), V)
    params["masks"] = masks
    params["temperature"][:2] = 0.0  # greedy: the masked row's argmax is the best allowed id
    tokens = torch.full((B,), -7, dtype=torch.int32, device=DEV)
    L.sample_tokens(kc, row.expand(B, V), tokens=tokens, **params)
    got = tokens.tolist()
    assert got[0] == int(row.argmax())
    assert got[1] == allowed[int(row[allowed].argmax())]
    assert set(got[1::2]) == set(allowed)  # every allowed id drawn at T = 3, none other
    assert not set(got[0::2]) <= set(allowed)
    with pytest.raises(KernelError, match="masks must have shape"):
        L.sample_tokens(kc, row.expand(B, V), tokens=tokens, **{**params, "masks": masks[:, 1:]})


# ---------------------------------------------------------------- launcher checks, cache

def test_launcher_checks(kc: KernelCompiler) -> None:
    g = gen(14)
    x, w = randn((2, 256), g), randn((128, 256), g)
    out = poisoned((2, 128))
    bf = TensorFormat("bf16")
    with pytest.raises(KernelError, match="x must be bfloat16 or float32"):
        L.gemv(kc, x.half(), bf, {"": w}, out)
    with pytest.raises(KernelError, match="out must be torch.float32, got torch.bfloat16"):
        L.gemv(kc, x.float(), bf, {"": w}, out)  # fp32 activations, bf16 out
    with pytest.raises(KernelError, match="shape"):
        L.gemv(kc, x, bf, {"": w[:, :128]}, out)
    with pytest.raises(KernelError, match="contiguous"):
        L.gemv(kc, x, bf, {"": randn((256, 128), g).T}, out)
    with pytest.raises(KernelError, match="cuda:0"):
        L.gemv(kc, x.cpu(), bf, {"": w}, out)
    with pytest.raises(KernelError, match="1..8 rows"):
        L.gemv(kc, randn((9, 256), g), bf, {"": w}, poisoned((9, 128)))
    with pytest.raises(KernelError, match="must be torch.int32"):
        L.embedding(kc, torch.zeros(3, dtype=torch.int64, device=DEV), w, poisoned((3, 256)))
    with pytest.raises(KernelError, match="multiple of 8"):
        L.rmsnorm_residual(kc, randn((2, 100), g), randn((100,), g), poisoned((2, 100)), 1e-5)
    q = randn((2, 8, 100), g)
    cache = randn((4, 16, 2, 100), g)
    tables = torch.zeros((2, 1), dtype=torch.int32, device=DEV)
    ctx = torch.ones(2, dtype=torch.int32, device=DEV)
    with pytest.raises(KernelError, match="head_dim 100"):
        L.paged_attention_decode(kc, q, cache, cache, tables, ctx, 1, poisoned((2, 8, 100)), 0.1)
    assert torch.isnan(out).all()  # nothing launched


def test_cubin_cache(kc: KernelCompiler, kernel_cache) -> None:
    kc.kernel("elementwise.cu", "swiglu")
    assert list(kernel_cache.glob("*.cubin"))
    fresh = KernelCompiler(kernel_cache, device=0)
    fresh.kernel("elementwise.cu", "swiglu")
    assert fresh.compiled == 0 and fresh.cache_hits == 1
