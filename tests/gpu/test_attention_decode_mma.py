"""Decode attention on tensor cores (route "mma", attention_decode_mma.cu) on fresh random data:
against fp64 for head dims 64 / 128, groups of 1..8 query heads, one and many split-K partitions,
page sizes, a sliding window and soft-capping; close to the warp route; batch invariant; what it
refuses. (Its RoPE + K/V write fusion: test_rope_attention.py, both routes.)"""
from __future__ import annotations

import pytest
import torch

from ninfer.kernels import launchers as L
from ninfer.kernels.compiler import KernelError
from test_architectures_cuda import ref_window_attention
from test_kernels import BF, DEV, TOL, gen, make_cache, poisoned, randn, rel

LENS = [1, 15, 16, 17, 600, 1500, 513, 64, 256, 257, 4100]  # inside one 16-key step, at its bounds, split-K (from 257)


def run(kc, q, k_cache, v_cache, tables, ctx, lens, scale, route, partition=64, window=0, softcap=0.0):
    out = poisoned(tuple(q.shape))
    L.paged_attention_decode(kc, q, k_cache, v_cache, tables, ctx, max(lens), out, scale, partition,
                             window=window, softcap=softcap, route=route)
    return out


@pytest.mark.parametrize("partition", [64, 512])
@pytest.mark.parametrize("page_size", [16, 64])
@pytest.mark.parametrize("D,Hq,Hkv", [(64, 9, 3), (128, 32, 8), (128, 16, 2), (64, 4, 4), (128, 64, 8)])
def test_matches_fp64_and_the_warp_route(kc, D: int, Hq: int, Hkv: int, page_size: int, partition: int) -> None:
    g = gen(D + Hq + page_size + partition)
    k_cache, v_cache, tables = make_cache(g, LENS, Hkv, D, page_size)
    q = randn((len(LENS), Hq, D), g)
    ctx = torch.tensor(LENS, dtype=torch.int32, device=DEV)
    scale = D ** -0.5
    mma = run(kc, q, k_cache, v_cache, tables, ctx, LENS, scale, "mma", partition)
    warp = run(kc, q, k_cache, v_cache, tables, ctx, LENS, scale, "warp", partition)
    for b, n in enumerate(LENS):
        ref = ref_window_attention(q[b], k_cache, v_cache, tables[b], n, scale, 0, 0.0)
        err, err_warp = rel(mma[b], ref), rel(warp[b], ref)
        # bf16 rounding of the output and of the probabilities the mma takes; the warp route keeps fp32 ones
        assert err < TOL[BF] and err < 3 * err_warp + 2e-3, f"sequence {b} ({n} keys): {err:.2e} vs warp {err_warp:.2e}"


@pytest.mark.parametrize("window,softcap", [(700, 0.0), (5, 0.0), (0, 2.0), (300, 1.5)])
@pytest.mark.parametrize("D,Hq,Hkv", [(64, 8, 2), (128, 32, 8)])
def test_window_and_softcap(kc, D: int, Hq: int, Hkv: int, window: int, softcap: float) -> None:
    g = gen(20 + D + window)
    lens = [1, 17, 600, 1500, 513, 1100]  # windows that start inside, at and before partition bounds
    k_cache, v_cache, tables = make_cache(g, lens, Hkv, D, 16)
    q = randn((len(lens), Hq, D), g, scale=3.0)  # large scores, so capping matters
    ctx = torch.tensor(lens, dtype=torch.int32, device=DEV)
    out = run(kc, q, k_cache, v_cache, tables, ctx, lens, 0.1, "mma", window=window, softcap=softcap)
    for b, n in enumerate(lens):
        ref = ref_window_attention(q[b], k_cache, v_cache, tables[b], n, 0.1, window, softcap)
        assert rel(out[b], ref) < TOL[BF], f"sequence {b}"


@pytest.mark.parametrize("setting", [("ATTN_PREFETCH", 1), ("ATTN_PREFETCH", 2), ("ATTN_PREFETCH", 4),
                                     ("ATTN_EARLY", True)], ids=["pf1", "pf2", "pf4", "early"])
@pytest.mark.parametrize("page_size", [16, 64])
@pytest.mark.parametrize("D,Hq,Hkv", [(64, 9, 3), (128, 32, 8)])
def test_speed_settings_give_the_same_bits(kc, monkeypatch, D: int, Hq: int, Hkv: int, page_size: int,
                                           setting: tuple[str, int]) -> None:
    """ATTN_PF (a warp's K / V rows asked into L2 steps ahead) and ATTN_EARLY (lengths and block table read,
    the first K / V rows asked of L2, before the PDL wait) change speed only: the outputs equal the kernel's
    without them, bit for bit, for contexts inside one step, across partitions and pages; a padding row (no
    keys) still gets zeros."""
    g = gen(30 + D + page_size)
    lens = [0] + LENS + [16384]
    k_cache, v_cache, tables = make_cache(g, [max(n, 1) for n in lens], Hkv, D, page_size)
    q = randn((len(lens), Hq, D), g)
    ctx = torch.tensor(lens, dtype=torch.int32, device=DEV)
    name, value = setting
    for partition in (64, 512):
        base = run(kc, q, k_cache, v_cache, tables, ctx, lens, D ** -0.5, "mma", partition)
        with monkeypatch.context() as m:
            m.setattr(L, name, value)
            got = run(kc, q, k_cache, v_cache, tables, ctx, lens, D ** -0.5, "mma", partition)
        assert torch.equal(got, base), partition
        assert torch.equal(got[0], torch.zeros_like(got[0]))


@pytest.mark.parametrize("D,Hq,Hkv", [(64, 9, 3), (128, 32, 8)])
def test_batch_invariant(kc, D: int, Hq: int, Hkv: int) -> None:
    g = gen(7)
    lens = [1300, 40, 7, 900, 2048, 1, 515, 77]
    k_cache, v_cache, tables = make_cache(g, lens, Hkv, D, 16)
    q = randn((8, Hq, D), g)
    ctx = torch.tensor(lens, dtype=torch.int32, device=DEV)
    out8 = run(kc, q, k_cache, v_cache, tables, ctx, lens, D ** -0.5, "mma")
    for b in (0, 4, 7):
        one = run(kc, q[b:b + 1], k_cache, v_cache, tables[b:b + 1], ctx[b:b + 1], lens[b:b + 1], D ** -0.5, "mma")
        assert torch.equal(one[0], out8[b]), f"row {b}"


def test_a_padding_row_writes_zeros(kc) -> None:
    g = gen(9)
    lens = [0, 300]
    k_cache, v_cache, tables = make_cache(g, [1, 300], 2, 128, 16)
    q = randn((2, 8, 128), g)
    out = run(kc, q, k_cache, v_cache, tables, torch.tensor(lens, dtype=torch.int32, device=DEV), lens, 0.1, "mma")
    assert torch.equal(out[0], torch.zeros_like(out[0]))


def test_refuses_what_it_does_not_take(kc) -> None:
    g = gen(10)
    lens = [40]
    ctx = torch.tensor(lens, dtype=torch.int32, device=DEV)
    cases = [((64, 8, 2), 16, torch.float32), ((256, 8, 2), 16, BF), ((64, 32, 2), 16, BF), ((64, 8, 2), 24, BF)]
    for (D, Hq, Hkv), page_size, act in cases:
        assert not L.attention_decode_route_ok("mma", act, D, Hq // Hkv, page_size)
        k_cache, v_cache, tables = make_cache(g, lens, Hkv, D, page_size, act)
        q = randn((1, Hq, D), g, act)
        with pytest.raises(KernelError, match="mma decode attention"):
            L.paged_attention_decode(kc, q, k_cache, v_cache, tables, ctx, 40, poisoned((1, Hq, D), act), 0.1,
                                     route="mma")
    with pytest.raises(KernelError, match="route must be one of"):
        L.paged_attention_decode(kc, q, k_cache, v_cache, tables, ctx, 40, poisoned((1, Hq, D), act), 0.1,
                                 route="tensor")
    assert not L.attention_decode_route_ok("mma", BF, 64, 4, 16, compressed=True)
    assert L.attention_decode_route_ok("mma", BF, 128, 8, 64) and L.attention_decode_route_ok("warp", BF, 256, 16, 24)
