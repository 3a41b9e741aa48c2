"""The tiled gemv route's int4 and int8 layouts (launchers.gemv_pack("tiled")): pure torch, no GPU.

`kernel_reads` replays what gemv_tiled.cu computes, with the kernel's own address formulas (not the
packer's permutes): each lane's words and scales per slab, its nibble pairs as mma A fragments and
the activations it pairs them with as B fragments, the scale per chunk or slab, the ones-mma for
sum(x). The result must equal x @ dequantize(W)^T, so a packer or addressing slip fails here
before it reaches a GPU."""
import pytest
import torch

from ninfer.engine.quant import TensorFormat, dequantize, quantize
from ninfer.kernels import launchers as L


def flat(packed: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The packed parts as the kernel addresses them: 32-bit words, and scales / mins as float64."""
    words = packed[""].contiguous().view(-1).view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    sc = packed[".scales"].contiguous().view(-1).to(torch.float64)
    mn = packed[".mins"].contiguous().view(-1).to(torch.float64) if ".mins" in packed else None
    return words, sc, mn


def kernel_reads(fmt: TensorFormat, packed: dict[str, torch.Tensor], x: torch.Tensor, N: int, K: int) -> torch.Tensor:
    """y [M, N] as gemv_tiled.cu computes it (in float64), from the packed parts."""
    words, sc, mn = flat(packed)
    gs, S, M = fmt.group_size, K // 64, x.shape[0]
    xd = x.to(torch.float64)
    y = torch.zeros(M, N, dtype=torch.float64)
    for tile in range(N // 16):
        for j in range(S):
            for lane in range(32):
                g, t = lane // 4, lane % 4
                for c in range(2):
                    k0 = 64 * j + 32 * c + 8 * t  # the lane's activations: xv = x[:, k0 .. k0 + 7]
                    for h in range(2):  # word wa (h = 0: row g) and wb (h = 1: row g + 8)
                        row = 16 * tile + 8 * h + g
                        w = int(words[((tile * S + j) * 512 + 16 * lane + 4 * (2 * c + h)) // 4])
                        if gs == 32:  # scale word (row g, row g + 8) of chunk c
                            si = ((tile * S + j) * 8 + g) * 4 + 2 * c + h
                        else:
                            si = ((tile * (K // gs) + (64 * j) // gs) * 8 + g) * 2 + h
                        for i in range(4):  # pair(w, i) meets xv pair i: (x[k0 + 2i], x[k0 + 2i + 1])
                            for half in range(2):
                                q = (w >> (4 * i + 16 * half)) & 0xF
                                k = k0 + 2 * i + half
                                wv = (q - 8) * sc[si] if fmt.symmetric else q * sc[si] + mn[si]
                                y[:, row] += wv * xd[:, k]
    return y


def dequant_reads(fmt: TensorFormat, packed: dict[str, torch.Tensor], N: int, K: int) -> torch.Tensor:
    """W [N, K] as dequant.cu's dequantize_tiles expands it, with its address formulas: a warp per
    512-byte slab, lane 4 r + t its 16 bytes, word 2 c + h of them to row 16 T + 8 h + r at
    k = 64 j + 32 c + 8 t. Every element is written exactly once (NaN left anywhere fails)."""
    words, sc, mn = flat(packed)
    gs, S, E = fmt.group_size, K // 64, (2 if fmt.group_size == 32 else 1)
    out = torch.full((N, K), float("nan"), dtype=torch.float64)
    for slab in range(N // 16 * S):
        T, j = slab // S, slab % S
        for lane in range(32):
            r, t = lane >> 2, lane & 3
            for c in range(2):
                grp = (64 * j + 32 * c) // gs
                for h in range(2):
                    si = ((T * (K // gs // E) + grp // E) * 8 + r) * 2 * E + 2 * (grp % E) + h
                    w = int(words[(slab * 512 + 16 * lane) // 4 + 2 * c + h])
                    row, k0 = 16 * T + 8 * h + r, 64 * j + 32 * c + 8 * t
                    for e in range(8):
                        assert out[row, k0 + e].isnan()
                        q = (w >> (4 * ((e >> 1) + 4 * (e & 1)))) & 0xF
                        out[row, k0 + e] = (q - 8) * sc[si] if fmt.symmetric else q * sc[si] + mn[si]
    return out


def kernel_reads_int8(packed: dict[str, torch.Tensor], x: torch.Tensor, N: int, K: int, gs: int) -> torch.Tensor:
    """int8 (T4_FMT 1): each lane's word 2 c + h of a slab, its nibble pairs as pair8 makes them (the low
    nibbles, and the signed high ones times 16) met by the activation pairs (k0, k1) and (k2, k3) of
    its k = 32 j + 8 t + 4 c .. + 3, one scale per slab (the group's)."""
    words, sc, _ = flat(packed)
    S, M = K // 32, x.shape[0]
    xd = x.to(torch.float64)
    y = torch.zeros(M, N, dtype=torch.float64)
    for tile in range(N // 16):
        for j in range(S):
            for lane in range(32):
                g, t = lane // 4, lane % 4
                for h in range(2):
                    row = 16 * tile + 8 * h + g
                    si = ((tile * (K // gs) + (32 * j) // gs) * 8 + g) * 2 + h
                    slab = torch.zeros(M, dtype=torch.float64)
                    for c in range(2):
                        w = int(words[((tile * S + j) * 512 + 16 * lane + 4 * (2 * c + h)) // 4])
                        for i in range(4):  # pair8(w, i): (x[k0 + 2 (i >> 1)], x[k0 + 2 (i >> 1) + 1])
                            for half in range(2):
                                nib = (w >> (4 * i + 16 * half)) & 0xF
                                v = 16 * (nib - 16 if nib >= 8 else nib) if i & 1 else nib
                                slab += v * xd[:, 32 * j + 8 * t + 4 * c + 2 * (i >> 1) + half]
                    y[:, row] += slab * sc[si]
    return y


def dequant_reads_int8(packed: dict[str, torch.Tensor], N: int, K: int, gs: int) -> torch.Tensor:
    """W [N, K] as dequantize_tiles expands int8 tiles: lane 4 r + t, word 2 c + h, byte
    e / 2 + 2 (e % 2) to row 16 T + 8 h + r, k = 32 j + 8 t + 4 c + e; every element once."""
    data = packed[""].contiguous().view(-1).to(torch.float64)
    _, sc, _ = flat(packed)
    S = K // 32
    out = torch.full((N, K), float("nan"), dtype=torch.float64)
    for slab in range(N // 16 * S):
        T, j = slab // S, slab % S
        for lane in range(32):
            r, t = lane >> 2, lane & 3
            for h in range(2):
                s = sc[((T * (K // gs) + 32 * j // gs) * 8 + r) * 2 + h]
                row = 16 * T + 8 * h + r
                for e in range(8):
                    c, e4 = e >> 2, e & 3
                    k = 32 * j + 8 * t + e
                    assert out[row, k].isnan()
                    out[row, k] = data[slab * 512 + 16 * lane + 4 * (2 * c + h) + (e4 >> 1) + 2 * (e4 & 1)] * s
    return out


INT8_CASES = [(TensorFormat("int8", 32), 32, 96), (TensorFormat("int8", 64), 16, 128),
              (TensorFormat("int8", 128), 16, 256)]


@pytest.mark.parametrize("fmt,N,K", INT8_CASES, ids=["g32", "g64", "g128"])
def test_int8_kernel_and_dequant_addressing_read_the_packed_weight(fmt: TensorFormat, N: int, K: int) -> None:
    g = torch.Generator().manual_seed(6)
    w = torch.randn(N, K, generator=g)
    w[0, :32] = torch.linspace(-1, 1, 32)  # codes from -127 to 127 (both high-nibble signs, 0 and 15 lows)
    parts = quantize(w, fmt)
    assert parts[""].min() < -120 and parts[""].max() > 120
    packed = L.gemv_pack("tiled", fmt, parts)
    x = torch.randn(3, K, generator=g)
    ref = x.double() @ dequantize(fmt, parts, torch.float64).T
    assert torch.allclose(kernel_reads_int8(packed, x, N, K, fmt.group_size), ref, rtol=1e-12, atol=1e-9)
    assert torch.equal(dequant_reads_int8(packed, N, K, fmt.group_size), dequantize(fmt, parts, torch.float64))


CASES = [(TensorFormat("int4", 32, True), 32, 128), (TensorFormat("int4", 32, False), 16, 192),
         (TensorFormat("int4", 64, False), 32, 128), (TensorFormat("int4", 128, True), 16, 256)]


@pytest.mark.parametrize("fmt,N,K", CASES, ids=["sym-g32", "asym-g32", "asym-g64", "sym-g128"])
def test_kernel_addressing_reads_the_packed_weight(fmt: TensorFormat, N: int, K: int) -> None:
    g = torch.Generator().manual_seed(3)
    parts = quantize(torch.randn(N, K, generator=g), fmt)
    x = torch.randn(3, K, generator=g)
    ref = x.double() @ dequantize(fmt, parts, torch.float64).T
    got = kernel_reads(fmt, L.gemv_pack("tiled", fmt, parts), x, N, K)
    assert torch.allclose(got, ref, rtol=1e-12, atol=1e-9)


@pytest.mark.parametrize("fmt,N,K", CASES, ids=["sym-g32", "asym-g32", "asym-g64", "sym-g128"])
def test_dequant_addressing_reads_the_packed_weight(fmt: TensorFormat, N: int, K: int) -> None:
    parts = quantize(torch.randn(N, K, generator=torch.Generator().manual_seed(5)), fmt)
    got = dequant_reads(fmt, L.gemv_pack("tiled", fmt, parts), N, K)
    assert torch.equal(got, dequantize(fmt, parts, torch.float64))


def test_pack_roundtrip_and_what_is_kept() -> None:
    g = torch.Generator().manual_seed(4)
    wide = [(TensorFormat("int4", 32, False), 48, 576), (TensorFormat("int8", 32), 48, 576)]
    for fmt, N, K in [*CASES, *INT8_CASES, *wide]:
        parts = quantize(torch.randn(N, K, generator=g), fmt)
        packed = L.gemv_pack("tiled", fmt, parts)
        assert set(packed) == set(parts) and all(packed[k].shape == parts[k].shape for k in parts)
        assert not torch.equal(packed[""], parts[""])
        back = L.gemv_unpack("tiled", fmt, packed)
        assert all(torch.equal(back[k], parts[k]) for k in parts)
    # what the route does not take keeps quant.py's layout: N not in 16s, K not in 64s, other formats
    for fmt, N, K in ((TensorFormat("int4", 32, True), 100, 128), (TensorFormat("int4", 32, True), 16, 96),
                      (TensorFormat("int8", 32), 40, 128), (TensorFormat("int8", 16), 16, 128),
                      (TensorFormat("bf16"), 16, 128)):
        parts = quantize(torch.randn(N, K, generator=g), fmt)
        assert L.gemv_pack("tiled", fmt, parts)[""] is parts[""]
        assert L.gemv_unpack("tiled", fmt, parts)[""] is parts[""]


def test_route_takes() -> None:
    bf16, f32 = torch.bfloat16, torch.float32
    asym = TensorFormat("int4", 32, False)
    assert L.gemv_route_ok("tiled", asym, 576, bf16) and L.gemv_route_ok("tiled", asym, 4096, bf16, N=14336)
    assert not L.gemv_route_ok("tiled", asym, 576, f32)  # fp32 activations
    assert not L.gemv_route_ok("tiled", asym, 576 + 32, bf16)  # K in 64s
    assert not L.gemv_route_ok("tiled", asym, 4096, bf16, N=50257)  # N in 16s
    assert not L.gemv_route_ok("tiled", TensorFormat("int4", 16, True), 4096, bf16)  # groups from 32
    assert not L.gemv_route_ok("tiled", TensorFormat("int4", 96, True), 4032, bf16)  # powers of two
    int8 = TensorFormat("int8", 32)
    assert L.gemv_route_ok("tiled", int8, 4096, bf16, N=14336) and L.gemv_route_ok("tiled", int8, 576 + 32, bf16)
    assert not L.gemv_route_ok("tiled", int8, 576 + 16, bf16)  # K in 32s
    assert not L.gemv_route_ok("tiled", TensorFormat("int8", 16), 4096, bf16)  # groups from 32
    assert not L.gemv_route_ok("tiled", int8, 4096, f32)
    assert not L.gemv_route_ok("tiled", TensorFormat("bf16"), 4096, bf16)
