"""The native CPU decode kernels (ninfer/kernels/cpu_decode.c) against torch on fresh random data:
each launcher against an independent float32 computation of the same formula, and against the torch
route it replaces (`_weight_int4pack_mm_for_cpu`, TorchOps' attention), on the AVX-512 BF16 route
and the plain C one. Skipped with the reason when the library cannot be built here."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from ninfer.kernels import cpu_native
from ninfer.kernels.cpu_native import NativeWeight


@pytest.fixture(scope="module")
def kernels(tmp_path_factory: pytest.TempPathFactory) -> cpu_native.CpuKernels:
    where = tmp_path_factory.mktemp("cpu_kernels")
    try:
        cpu_native.build(where)
    except cpu_native.BuildError as e:
        pytest.skip(f"the cpu decode kernels cannot be built here: {e}")
    k = cpu_native.load(where)
    assert k is not None
    return k


@pytest.fixture(params=["simd", "plain"])
def route(request, kernels: cpu_native.CpuKernels):
    """Both int4 routes: AVX-512 BF16 where the CPU has it, and the plain C one."""
    if request.param == "simd" and kernels.isa < 2:
        pytest.skip("no AVX-512 BF16 on this CPU")
    kernels.lib.nf_allow_avx512bf16(int(request.param == "simd"))
    yield kernels
    kernels.lib.nf_allow_avx512bf16(1)


def random_int4(n: int, k: int, group: int, gen: torch.Generator):
    q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.int32)
    scales = (torch.rand(n, k // group, generator=gen) * 0.02 + 0.001)
    zeros = (torch.randn(n, k // group, generator=gen) * 0.05)
    return q, scales, zeros


def dequant_int4(q, scales, zeros, group):
    # the weight both routes read: (q - 8) * bf16(scale) + bf16(zero), in float32
    s = scales.to(torch.bfloat16).float().repeat_interleave(group, dim=1)
    z = zeros.to(torch.bfloat16).float().repeat_interleave(group, dim=1)
    return (q.float() - 8) * s + z


def close_bf16(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal up to float32 summation order: within one bf16 step of the float32 result."""
    torch.testing.assert_close(actual.float(), expected.float(), rtol=2 ** -7, atol=1e-4)


@pytest.mark.parametrize("rows", [1, 3, 8])
@pytest.mark.parametrize("n,k,group", [(576, 576, 32), (160, 1536, 64), (48, 128, 128)])
def test_int4_linear_matches_float32_and_the_packed_torch_kernel(route, rows, n, k, group):
    gen = torch.Generator().manual_seed(rows * 1000 + n + k)
    q, scales, zeros = random_int4(n, k, group, gen)
    x = torch.randn(rows, k, generator=gen).to(torch.bfloat16)
    w = NativeWeight.int4(q, scales, zeros, group)
    y = route.linear(x, w, torch.bfloat16)
    expected = x.float() @ dequant_int4(q, scales, zeros, group).t()
    close_bf16(y, expected)
    # the torch route (Linear's packed kernel), the one decode took before
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    sz = torch.stack((scales.t(), zeros.t()), dim=-1).to(torch.bfloat16).contiguous()
    torch_y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, group, sz)
    close_bf16(y, torch_y)
    # float32 out: the same bf16-rounded values, widened
    assert torch.equal(route.linear(x, w, torch.float32), y.float())


@pytest.mark.parametrize("rows", [1, 2, 5])
@pytest.mark.parametrize("group,with_zeros", [(32, False), (64, False), (16, False), (32, True), (16, True)])
def test_int8_linear(route, rows, group, with_zeros):
    """int8 codes with a scale per 32 inputs (or a multiple), or per 16 (llama.cpp's q6_k / q3_k /
    q2_k as codes), and a zero per group where given (q5_k, q5_1, q2_k)."""
    gen = torch.Generator().manual_seed(rows + group)
    n, k = 320, 576
    q = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
    scales = torch.rand(n, k // group, generator=gen) * 0.01
    zeros = torch.randn(n, k // group, generator=gen) * 0.05 if with_zeros else None
    x = torch.randn(rows, k, generator=gen).to(torch.bfloat16)
    y = route.linear(x, NativeWeight.int8(q, scales, group, zeros), torch.float32)
    w = q.float() * scales.to(torch.bfloat16).float().repeat_interleave(group, dim=1)
    if with_zeros:
        w += zeros.to(torch.bfloat16).float().repeat_interleave(group, dim=1)
    close_bf16(y, x.float() @ w.t())
    assert torch.equal(y, y.to(torch.bfloat16).float())  # bf16-rounded, as the torch route's logits


@pytest.mark.parametrize("rows", [1, 2, 5])
@pytest.mark.parametrize("kind", [5, 6])
def test_5_and_6_bit_linear(route, rows, kind):
    """5-bit codes with a scale and zero per 32 inputs (q5_0, q5_1, q5_k), 6-bit ones per 16 (q6_k)."""
    gen = torch.Generator().manual_seed(rows + 10 * kind)
    n, k, group = 320, 576, 16 if kind == 6 else 32
    q = torch.randint(0, 1 << kind, (n, k), generator=gen, dtype=torch.int32)
    scales = torch.rand(n, k // group, generator=gen) * 0.01
    zeros = torch.randn(n, k // group, generator=gen) * 0.05
    x = torch.randn(rows, k, generator=gen).to(torch.bfloat16)
    y = route.linear(x, NativeWeight.wide(q, scales, zeros, kind), torch.float32)
    w = (q.float() * scales.to(torch.bfloat16).float().repeat_interleave(group, dim=1)
         + zeros.to(torch.bfloat16).float().repeat_interleave(group, dim=1))
    close_bf16(y, x.float() @ w.t())


def random_weight(kind: int, n: int, k: int, gen: torch.Generator) -> tuple[NativeWeight, torch.Tensor]:
    """A weight of each kernel kind (int4; 5- / 6-bit; int8 per 16, no zeros) and the float32 weight
    the kernels compute with (bf16 scales and zeros)."""
    if kind == 4:
        q, scales, zeros = random_int4(n, k, 32, gen)
        return NativeWeight.int4(q, scales, zeros, 32), dequant_int4(q, scales, zeros, 32)
    group = 32 if kind == 5 else 16
    scales = torch.rand(n, k // group, generator=gen) * 0.01
    s = scales.to(torch.bfloat16).float().repeat_interleave(group, dim=1)
    if kind == 8:
        q = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
        return NativeWeight.int8(q, scales, group), q.float() * s
    q = torch.randint(0, 1 << kind, (n, k), generator=gen, dtype=torch.int32)
    zeros = torch.randn(n, k // group, generator=gen) * 0.05
    return (NativeWeight.wide(q, scales, zeros, kind),
            q.float() * s + zeros.to(torch.bfloat16).float().repeat_interleave(group, dim=1))


@pytest.mark.parametrize("rows", [1, 4])
@pytest.mark.parametrize("kind", [4, 5, 6, 8])
def test_gated_silu(route, rows, kind):
    gen = torch.Generator().manual_seed(7 + rows + kind)
    n, k = 2 * 320, 576
    w, dense = random_weight(kind, n, k, gen)
    x = torch.randn(rows, k, generator=gen).to(torch.bfloat16)
    out = route.gated_silu(x, w)
    gate_up = (x.float() @ dense.t()).to(torch.bfloat16)
    gate, up = gate_up.chunk(2, dim=-1)
    close_bf16(out, F.silu(gate) * up)  # TorchOps.gated_linear on the bf16 matmul output


@pytest.mark.parametrize("rows", [1, 2])
@pytest.mark.parametrize("kind", [4, 5, 6, 8])
def test_linear_add_rms_norm(route, rows, kind):
    gen = torch.Generator().manual_seed(11 + rows + kind)
    n, k, eps = 576, 1536, 1e-5
    w, dense = random_weight(kind, n, k, gen)
    x = torch.randn(rows, k, generator=gen).to(torch.bfloat16)
    residual = torch.randn(rows, n, generator=gen)
    norm = torch.rand(n, generator=gen) + 0.5
    y = x.float() @ dense.t()
    before = residual.clone()
    out = route.linear_add_rms_norm(x, w, residual, norm, eps)
    # the product rounded to bf16 before the add: within one bf16 step of it (summation order)
    assert ((residual - before - y).abs() <= 2 ** -7 * y.abs() + 1e-4).all()
    close_bf16(out, F.rms_norm(residual, (n,), norm, eps).to(torch.bfloat16))  # of the residual it left


@pytest.mark.parametrize("pos", [0, 5, 130])
def test_attention_decode_matches_torch_ops(kernels, pos):
    from ninfer.engine.ops.torch_ops import AttentionMetadata, RotaryEmbedding, apply_rotary, paged_attention
    from ninfer.engine.rope import Rope

    gen = torch.Generator().manual_seed(pos)
    heads, kv_heads, d, page_size = 9, 3, 64, 16
    pages = 12
    table = [7, 2, 9, 0, 11, 4, 1, 3, 5, 6]  # not consecutive: the paged reads
    k_cache = torch.randn(pages, page_size, kv_heads, d, generator=gen)
    v_cache = torch.randn(pages, page_size, kv_heads, d, generator=gen)
    qkv = torch.randn(1, (heads + 2 * kv_heads) * d, generator=gen).to(torch.bfloat16)
    tables = RotaryEmbedding(Rope.of(d, 10000.0, None), 256, torch.float32, torch.device("cpu"))
    cos, sin = tables.cos[pos].contiguous(), tables.sin[pos].contiguous()
    # the torch ops: RoPE, store, attend
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    meta, _ = AttentionMetadata.build([(pos, 1, table)], page_size, torch.device("cpu"))
    x = qkv.float()
    qk = apply_rotary(x[:, :(heads + kv_heads) * d].view(1, heads + kv_heads, d), cos.view(1, 1, d), sin.view(1, 1, d))
    v = x[:, (heads + kv_heads) * d:].view(1, kv_heads, d)
    expected = paged_attention(qk[:, :heads], qk[:, heads:], v, ref_k, ref_v, meta).to(torch.bfloat16)
    out = torch.empty(heads * d, dtype=torch.bfloat16)
    kernels.attention_decode(qkv[0], heads, kv_heads, cos, sin, k_cache, v_cache, meta.seqs[0].block_table, pos, out)
    close_bf16(out, expected[0])
    torch.testing.assert_close(k_cache, ref_k, rtol=1e-6, atol=1e-6)
    assert torch.equal(v_cache, ref_v)


def test_launchers_refuse_bad_arguments(kernels):
    q, scales, zeros = random_int4(64, 128, 32, torch.Generator().manual_seed(0))
    w = NativeWeight.int4(q, scales, zeros, 32)
    with pytest.raises(ValueError):
        kernels.linear(torch.zeros(9, 128, dtype=torch.bfloat16), w, torch.bfloat16)  # more rows than decode
    with pytest.raises(ValueError):
        kernels.linear(torch.zeros(1, 64, dtype=torch.bfloat16), w, torch.bfloat16)  # wrong width
    with pytest.raises(ValueError):
        kernels.linear(torch.zeros(1, 128), w, torch.bfloat16)  # float32 input
    with pytest.raises(ValueError):
        kernels.linear_add_rms_norm(torch.zeros(1, 128, dtype=torch.bfloat16), w, torch.zeros(1, 32),
                                    torch.ones(64), 1e-5)  # residual of the wrong width


def test_one_openmp_runtime(kernels):
    """The library links the libgomp torch loaded, not a second OpenMP runtime (docs/PERF.md)."""
    maps = Path("/proc/self/maps")
    if not maps.is_file():
        pytest.skip("no /proc/self/maps")
    libs = {line.split()[-1] for line in maps.read_text().splitlines() if "libgomp" in line or "libomp" in line}
    assert len(libs) == 1, libs


def test_no_compiler_falls_back(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(cpu_native, "compiler", lambda: None)
    with caplog.at_level("WARNING", logger="ninfer.engine"):
        assert cpu_native.load(tmp_path / "none") is None
    assert "no C compiler" in caplog.text and "torch ops" in caplog.text
