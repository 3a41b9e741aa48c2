"""RoPE + the K/V write + decode attention in one launch (launchers.rope_attention_decode, attention.cu
and attention_decode_mma.cu ROPE_KV) on fresh random data, on both decode routes: bit-equal to
rope_kv_write followed by paged_attention_decode on the same route (output and both caches), against fp64 (rotated k in the cache, the attention output), for head dims 64 /
128 / 256, GQA groups, one and several split-K partitions, a sliding window, soft-capping, padding
rows; batch invariant; what it refuses."""
from __future__ import annotations

import pytest
import torch

from ninfer.kernels import launchers as L
from ninfer.kernels.compiler import KernelError
from test_kernels import ACTS, DEV, TOL, gen, make_cache, randn, rel, rotate_half

PAGE = 16
LENS = [1, 17, 600, 1500, 513, 0, 1100]  # 0: a padding row (no context, slot -1)


def setup(g: torch.Generator, Hq: int, Hkv: int, D: int, act: torch.dtype):
    T = len(LENS)
    k_cache, v_cache, tables = make_cache(g, [max(n, 1) for n in LENS], Hkv, D, PAGE, act)
    W = (Hq + 2 * Hkv) * D
    qkv = randn((T, W + 64), g, act)[:, :W]  # q, k, v: views of a row-strided fused projection
    q = qkv[:, :Hq * D].view(T, Hq, D)
    k = qkv[:, Hq * D:(Hq + Hkv) * D].view(T, Hkv, D)
    v = qkv[:, (Hq + Hkv) * D:].view(T, Hkv, D)
    cos, sin = L.rope_cos_sin(D, 4096, 10000.0, DEV)
    positions = torch.tensor([max(n - 1, 0) for n in LENS], dtype=torch.int32, device=DEV)
    slots = torch.tensor([int(tables[b, (n - 1) // PAGE]) * PAGE + (n - 1) % PAGE if n else -1
                          for b, n in enumerate(LENS)], dtype=torch.int32, device=DEV)
    lens = torch.tensor(LENS, dtype=torch.int32, device=DEV)
    return qkv, q, k, v, cos, sin, positions, slots, k_cache, v_cache, tables, lens


def route_or_skip(route: str, act: torch.dtype, D: int, Hq: int, Hkv: int) -> None:
    if not L.attention_decode_route_ok(route, act, D, Hq // Hkv, PAGE):
        pytest.skip(f"the {route} decode route does not take {act}, head_dim {D}, {Hq // Hkv} heads per kv head")


@pytest.mark.parametrize("route", L.ATTN_DECODE_ROUTES)
@pytest.mark.parametrize("window,softcap", [(0, 0.0), (300, 0.0), (0, 2.0)])
@pytest.mark.parametrize("D,Hq,Hkv", [(64, 9, 3), (128, 32, 8), (256, 8, 4), (64, 4, 4)])
@ACTS
def test_rope_attention_decode_equals_two_kernels(kc, D: int, Hq: int, Hkv: int, window: int, softcap: float,
                                                  act: torch.dtype, route: str) -> None:
    route_or_skip(route, act, D, Hq, Hkv)
    g = gen(D + Hq + window)
    qkv, q, k, v, cos, sin, positions, slots, k_cache, v_cache, tables, lens = setup(g, Hq, Hkv, D, act)
    T, scale, max_ctx = len(LENS), D ** -0.5, max(LENS)
    qkv0 = qkv.clone()
    kc2, vc2 = k_cache.clone(), v_cache.clone()
    fused = torch.full((T, Hq, D), float("nan"), dtype=act, device=DEV)
    L.rope_attention_decode(kc, q, k, v, cos, sin, positions, slots, k_cache, v_cache, tables, lens, max_ctx, fused,
                            scale, 512, window=window, softcap=softcap, route=route)
    assert torch.equal(qkv, qkv0), "the fused kernel must not write q, k or v"
    # the two kernels it replaces, on copies
    q2, k2, v2 = (t.clone() for t in (q, k, v))
    L.rope_kv_write(kc, q2, k2, v2, cos, sin, positions, slots, kc2, vc2)
    two = torch.full((T, Hq, D), float("nan"), dtype=act, device=DEV)
    L.paged_attention_decode(kc, q2, kc2, vc2, tables, lens, max_ctx, two, scale, 512, window=window, softcap=softcap,
                             route=route)
    assert torch.equal(k_cache, kc2) and torch.equal(v_cache, vc2), "caches differ from rope_kv_write's"
    assert torch.equal(fused.nan_to_num(7.0), two.nan_to_num(7.0)), "output differs from the two kernels'"
    assert torch.equal(fused[LENS.index(0)], torch.zeros_like(fused[0])), "a padding row writes zeros"
    # fp64: the new k in the cache, and the attention output of each token
    c = torch.cat((cos, cos), -1)[positions.long()][:, None, :].double()
    s = torch.cat((sin, sin), -1)[positions.long()][:, None, :].double()
    qr = q.double() * c + rotate_half(q.double()) * s
    kr = k.double() * c + rotate_half(k.double()) * s
    written = slots >= 0
    flat_k, flat_v = k_cache.view(-1, Hkv, D), v_cache.view(-1, Hkv, D)
    assert rel(flat_k[slots[written].long()], kr[written]) < TOL[act]
    assert torch.equal(flat_v[slots[written].long()], v[written])
    from test_architectures_cuda import ref_window_attention

    for b, n in enumerate(LENS):
        if n:
            ref = ref_window_attention(qr[b], k_cache, v_cache, tables[b], n, scale, window, softcap)
            assert rel(fused[b], ref) < TOL[act], f"token {b} ({n} keys)"


@pytest.mark.parametrize("window", [0, 300])
@pytest.mark.parametrize("D,Hq,Hkv", [(64, 9, 3), (128, 32, 8)])
def test_rope_attention_decode_early_loads_give_the_same_bits(kc, monkeypatch, D: int, Hq: int, Hkv: int,
                                                              window: int) -> None:
    """The mma route's ATTN_EARLY (lengths, positions, block table and the first K / V and RoPE rows before
    the PDL wait): the same output and caches, bit for bit, as without it."""
    act = torch.bfloat16
    route_or_skip("mma", act, D, Hq, Hkv)
    g = gen(D + Hq + window + 1)
    _, q, k, v, cos, sin, positions, slots, k_cache, v_cache, tables, lens = setup(g, Hq, Hkv, D, act)
    outs = []
    for early in (False, True):
        monkeypatch.setattr(L, "ATTN_EARLY", early)
        kc_, vc_ = k_cache.clone(), v_cache.clone()
        out = torch.full((len(LENS), Hq, D), float("nan"), dtype=act, device=DEV)
        L.rope_attention_decode(kc, q, k, v, cos, sin, positions, slots, kc_, vc_, tables, lens, max(LENS), out,
                                D ** -0.5, 512, window=window, route="mma")
        outs.append((out.nan_to_num(7.0), kc_, vc_))
    for a, b in zip(*outs):
        assert torch.equal(a, b)


@pytest.mark.parametrize("route", L.ATTN_DECODE_ROUTES)
def test_rope_attention_decode_batch_invariant(kc, route: str) -> None:
    """A token's output and cache rows do not depend on the other tokens of the batch."""
    g = gen(3)
    Hq, Hkv, D = 8, 2, 128
    qkv, q, k, v, cos, sin, positions, slots, k_cache, v_cache, tables, lens = setup(g, Hq, Hkv, D, torch.bfloat16)
    T = len(LENS)
    base_k, base_v = k_cache.clone(), v_cache.clone()
    batch = torch.empty((T, Hq, D), dtype=torch.bfloat16, device=DEV)
    L.rope_attention_decode(kc, q, k, v, cos, sin, positions, slots, k_cache, v_cache, tables, lens, max(LENS), batch,
                            D ** -0.5, route=route)
    for b in range(T):
        kb, vb = base_k.clone(), base_v.clone()
        one = torch.empty((1, Hq, D), dtype=torch.bfloat16, device=DEV)
        L.rope_attention_decode(kc, q[b:b + 1], k[b:b + 1], v[b:b + 1], cos, sin, positions[b:b + 1], slots[b:b + 1],
                                kb, vb, tables[b:b + 1], lens[b:b + 1], max(LENS), one, D ** -0.5, route=route)
        assert torch.equal(one[0], batch[b])


def test_rope_attention_decode_refuses(kc) -> None:
    g = gen(4)
    qkv, q, k, v, cos, sin, positions, slots, k_cache, v_cache, tables, lens = setup(g, 4, 2, 64, torch.bfloat16)
    out = torch.empty((len(LENS), 4, 64), dtype=torch.bfloat16, device=DEV)
    with pytest.raises(KernelError, match="writes"):
        L.rope_attention_decode(kc, q, k, v, cos, sin, positions, slots, k_cache.to(torch.int8), v_cache.to(torch.int8),
                                tables, lens, max(LENS), out, 0.125)
    with pytest.raises(KernelError, match="cos"):
        L.rope_attention_decode(kc, q, k, v, cos[:, :16], sin[:, :16], positions, slots, k_cache, v_cache, tables,
                                lens, max(LENS), out, 0.125)
    assert not L.rope_attention_decode_ok(q, k_cache, 32, False)  # partial rotary
    assert not L.rope_attention_decode_ok(q, k_cache, 64, True)  # q/k norms
    assert L.rope_attention_decode_ok(q, k_cache, 64, False)
