"""The tiled int4 / int8 gemv route (kernels/gemv_tiled.cu) on the GPU: against fp64 on fresh random data at
the llama-8b and SmolLM2 decode shapes, rows 1..8; batch invariance; every tuning variant (stages in
flight, activations prefetched or not, or staged in shared memory) bit-equal at 8 and at 16 warps a block; and a model on the route: prompt
logits bit-equal to the mma route's (the prompt expands the weights from either layout to the same
bits), decode logits close to them, batch-invariant decode."""
from __future__ import annotations

import pytest
import torch

from ninfer.engine.quant import TensorFormat, dequantize, quantize, unpack_int4
from ninfer.kernels import launchers as L
from ninfer.kernels.compiler import KernelCompiler

DEV = "cuda"
BF, F32 = torch.bfloat16, torch.float32
FORMATS = [TensorFormat("int4", 32, False), TensorFormat("int4", 32, True), TensorFormat("int4", 64, False),
           TensorFormat("int4", 128, True), TensorFormat("int8", 32), TensorFormat("int8", 128)]
FORMAT_IDS = ["asym-g32", "sym-g32", "asym-g64", "sym-g128", "int8-g32", "int8-g128"]
# (N, K): llama-8b q/o, gate or up, down, fused gate_up, lm_head; SmolLM2-135M q/o, fused qkv, gate/up, down
SHAPES = [(4096, 4096), (14336, 4096), (4096, 14336), (28672, 4096), (128256, 4096), (576, 576), (960, 576),
          (1536, 576), (576, 1536)]


def rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    assert not torch.isnan(out).any(), "output has NaN (unwritten or broken)"
    return ((out - ref).norm() / ref.norm()).item()


def poisoned(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=dtype, device=DEV)


def weight(fmt: TensorFormat, N: int, K: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator(device=DEV).manual_seed(seed)
    return quantize(torch.randn(N, K, generator=g, device=DEV) * 0.05, fmt)


@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
@pytest.mark.parametrize("N,K", SHAPES, ids=[f"{n}x{k}" for n, k in SHAPES])
def test_gemv_tiled_matches_fp64(kc: KernelCompiler, fmt: TensorFormat, N: int, K: int) -> None:
    """Every row count 1..8: fp32 out to the fp32 bound (products exact, only the summation order
    differs), bf16 out to bf16 rounding; batch rows and lone rows bit-equal."""
    if K % fmt.group_size:
        pytest.skip("group size does not divide K")
    parts = weight(fmt, N, K, seed=N + K)
    w64 = dequantize(fmt, parts, torch.float64)
    packed = L.gemv_pack("tiled", fmt, parts)
    assert not torch.equal(packed[""], parts[""])
    x = torch.randn(8, K, generator=torch.Generator(device=DEV).manual_seed(K), device=DEV).to(BF)
    ref = x.double() @ w64.T
    alone = []
    for m in range(8):
        out = poisoned((1, N), F32)
        L.gemv(kc, x[m:m + 1], fmt, packed, out, route="tiled")
        alone.append(out[0])
    for M in range(1, 9):
        out = poisoned((M, N), F32)
        L.gemv(kc, x[:M], fmt, packed, out, route="tiled")
        assert rel(out, ref[:M]) < 1e-5, M
        for m in range(M):
            assert torch.equal(out[m], alone[m]), (M, m)
        out_bf = poisoned((M, N), BF)
        L.gemv(kc, x[:M], fmt, packed, out_bf, route="tiled")
        assert rel(out_bf, ref[:M]) < 1e-2, M
        assert torch.equal(out_bf, out.to(BF)), M  # the same fp32 sums, rounded once


VARIANTS = ([{"T4_STAGES": s, "T4_XPRE": 0, "T4_MINB": 0} for s in (1, 2, 3, 4, 8)]
            + [{"T4_STAGES": s, "T4_XPRE": 1, "T4_MINB": 0} for s in (2, 3, 6)]
            + [{"T4_STAGES": s, "T4_XPRE": 1, "T4_MINB": 2} for s in (2, 3)]
            + [{"T4_STAGES": 2, "T4_XPRE": 0, "T4_MINB": 0, "T4_L2PF": p} for p in (1, 4)]
            # the activations staged in shared memory (where M (K + 8) * 2 bytes fit launchers.TILED_XSMEM_BYTES)
            + [{"T4_STAGES": s, "T4_XPRE": p, "T4_MINB": 0, "T4_XSMEM": 1} for s, p in ((2, 0), (3, 1), (4, 0))])


@pytest.mark.parametrize("warps", [8, 16])
@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
@pytest.mark.parametrize("K", [64, 576, 1536, 4096, 14336])  # int8: 2 .. 448 slabs
def test_gemv_tiled_variants_are_bit_equal(kc: KernelCompiler, fmt: TensorFormat, K: int, warps: int) -> None:
    """Stages in flight, where the activations load (and whether a block stages them in shared memory),
    register caps and the tile's L2 prefetch change speed only: at a block's
    warp count every variant gives the same bits, at widths where the warps' slab counts (K / 64 over
    the warps) leave every kind of tail, including warps with no slab; rows batched or alone bit-equal."""
    if K % fmt.group_size:
        pytest.skip("group size does not divide K")
    N = 256
    packed = L.gemv_pack("tiled", fmt, weight(fmt, N, K, seed=K))
    x = torch.randn(8, K, generator=torch.Generator(device=DEV).manual_seed(7), device=DEV).to(BF)
    lone = poisoned((1, N), F32)
    L.gemv(kc, x[4:5], fmt, packed, lone, route="tiled", variant={"T4_WARPS": warps})
    for M in (1, 5, 8):
        base = poisoned((M, N), F32)
        L.gemv(kc, x[:M], fmt, packed, base, route="tiled", variant={"T4_WARPS": warps})
        ref = x[:M].double() @ dequantize(fmt, L.gemv_unpack("tiled", fmt, packed), torch.float64).T
        assert rel(base, ref) < 1e-5
        if M > 4:
            assert torch.equal(base[4], lone[0])
        for v in VARIANTS:
            out = poisoned((M, N), F32)
            L.gemv(kc, x[:M], fmt, packed, out, route="tiled", variant={**v, "T4_WARPS": warps})
            assert torch.equal(out, base), (M, v)


def check_rows_and_variants(kc: KernelCompiler, fmt: TensorFormat, packed: dict[str, torch.Tensor], x: torch.Tensor,
                            ref: torch.Tensor, define: dict[str, int]) -> list[torch.Tensor]:
    """The tiled gemv with `define` at rows 1..8: to `ref` (fp64) within the fp32 bound, row 6 batched
    bit-equal to alone, every stage variant the same bits. -> the outputs per row count."""
    N = packed[""].shape[0]
    lone = poisoned((1, N), F32)
    L.gemv(kc, x[6:7], fmt, packed, lone, route="tiled", variant=define)
    outs = []
    for M in range(1, 9):
        out = poisoned((M, N), F32)
        L.gemv(kc, x[:M], fmt, packed, out, route="tiled", variant=define)
        assert rel(out, ref[:M]) < 1e-5, M
        if M > 6:
            assert torch.equal(out[6], lone[0]), M
        for v in VARIANTS:
            other = poisoned((M, N), F32)
            L.gemv(kc, x[:M], fmt, packed, other, route="tiled", variant={**v, **define})
            assert torch.equal(other, out), (M, v)
        outs.append(out)
    return outs


def dq_weights(parts: dict[str, torch.Tensor], g: int) -> torch.Tensor:
    """gemv_tiled.cu T4_DQ's bf16 weights, float64: (16 + q) s_b + m'_b rounded once to bf16, s_b = s to
    bf16, m'_b = (m - 16 s) (fp32) to bf16."""
    q = unpack_int4(parts[""]).double()
    s = parts[".scales"].float()
    sb = s.to(BF).double().repeat_interleave(g, 1)
    mb = (parts[".mins"].float() - 16.0 * s).to(BF).double().repeat_interleave(g, 1)
    exact = (16.0 + q) * sb + mb  # exact in fp64
    # rounded once to bf16's 8 significant bits, to nearest even (torch's fp64 -> bf16 goes through fp32)
    _, e = torch.frexp(exact)
    return torch.ldexp(torch.round(torch.ldexp(exact, 8 - e)), e - 8)


@pytest.mark.parametrize("K", [64, 576, 4096, 14336])
def test_gemv_tiled_dq_is_its_bf16_weights(kc: KernelCompiler, K: int) -> None:
    """T4_DQ (asym int4 in groups of 32 dequantized to bf16 in registers): the fp32 sums of x times its
    bf16 weights (dq_weights) to the fp32 bound at every row count, rows batched or alone bit-equal, every
    stage variant the same bits; against the logical weights' product within 3 % (an H100 measured 1.0-1.5 %:
    s and m - 16 s rounded to bf16 scale the error by 16 + q rather than q)."""
    fmt = TensorFormat("int4", 32, False)
    N = 256
    parts = weight(fmt, N, K, seed=K + 1)
    packed = L.gemv_pack("tiled", fmt, parts)
    x = torch.randn(8, K, generator=torch.Generator(device=DEV).manual_seed(3), device=DEV).to(BF)
    ref = x.double() @ dq_weights(parts, 32).T
    exact = x.double() @ dequantize(fmt, parts, torch.float64).T
    for M, out in enumerate(check_rows_and_variants(kc, fmt, packed, x, ref, {"T4_DQ": 1}), 1):
        assert rel(out, exact[:M]) < 3e-2, M


@pytest.mark.parametrize("g", [32, 128])
@pytest.mark.parametrize("K", [32, 576, 4096, 14336])
def test_gemv_tiled_int8_f16_is_exact(kc: KernelCompiler, K: int, g: int) -> None:
    """T4_F16 (int8 mmas in fp16): weights exact, activations exact after their scaling by 2^-8 (these are),
    so fp64 to the fp32 bound at every row count; rows batched or alone bit-equal; every stage variant the
    same bits; activations past fp16's own range exact, past 2^8 times it clamped (finite), not inf."""
    fmt = TensorFormat("int8", g)
    if K % g:
        pytest.skip("group size does not divide K")
    N = 256
    parts = weight(fmt, N, K, seed=K + g)
    packed = L.gemv_pack("tiled", fmt, parts)
    x = torch.randn(8, K, generator=torch.Generator(device=DEV).manual_seed(5), device=DEV).to(BF)
    ref = x.double() @ dequantize(fmt, parts, torch.float64).T
    f16 = {"T4_F16": 1}
    check_rows_and_variants(kc, fmt, packed, x, ref, f16)
    # activations past fp16's range (Gemma's MLP inputs): scaled by 2^-8 first, so exact up to ~1.7e7; beyond,
    # clamped (finite)
    big = x[:1].clone()
    big[0, :4] = torch.tensor([1e6, -3e5, 7e4, -65520.0])
    out = poisoned((1, N), F32)
    L.gemv(kc, big, fmt, packed, out, route="tiled", variant=f16)
    assert rel(out, big.double() @ dequantize(fmt, parts, torch.float64).T) < 1e-5
    big[0, 0] = 1e9
    L.gemv(kc, big, fmt, packed, out, route="tiled", variant=f16)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
@pytest.mark.parametrize("dtype", [BF, F32], ids=["bf16", "f32"])
def test_dequantize_weight_from_tiles_equals_quant_dequantize(kc: KernelCompiler, fmt: TensorFormat,
                                                              dtype: torch.dtype) -> None:
    """The prompt route's expansion (dequant.cu's dequantize_tiles) of the tiled layout is bit-equal to
    quant.dequantize (rows in 16s: the layout is tiled; test_kernels' N = 100 keeps quant.py's)."""
    for N, K in ((96, 576), (64, 2048)):
        if K % fmt.group_size:
            continue
        parts = weight(fmt, N, K, seed=N)
        out = poisoned((N, K), dtype)
        L.dequantize_weight(kc, fmt, L.gemv_pack("tiled", fmt, parts), out, "tiled")
        assert torch.equal(out, dequantize(fmt, parts, dtype))


def test_gemv_tiled_strided_rows_and_refusals(kc: KernelCompiler) -> None:
    """x and out rows with strides beyond their widths (a view of a wider buffer); what it refuses."""
    from ninfer.kernels.compiler import KernelError

    fmt = TensorFormat("int4", 32, False)
    N, K = 512, 1536
    parts = weight(fmt, N, K, seed=1)
    packed = L.gemv_pack("tiled", fmt, parts)
    wide = torch.randn(4, K + 64, device=DEV).to(BF)
    x = wide[:, 32:32 + K]
    out_wide = poisoned((4, N + 16), F32)
    L.gemv(kc, x, fmt, packed, out_wide[:, :N], route="tiled")
    ref = x.double() @ dequantize(fmt, parts, torch.float64).T
    assert rel(out_wide[:, :N], ref) < 1e-5
    assert torch.isnan(out_wide[:, N:]).all()  # nothing written past the view
    odd = quantize(torch.randn(40, 256, device=DEV), fmt)  # N not in 16s: not tiled, and refused
    with pytest.raises(KernelError, match="tiled gemv does not take"):
        L.gemv(kc, torch.randn(1, 256, device=DEV).to(BF), fmt, L.gemv_pack("tiled", fmt, odd),
               poisoned((1, 40), F32), route="tiled")
    with pytest.raises(KernelError, match="tiled gemv does not take"):  # fp32 activations: warp route
        L.gemv(kc, torch.randn(1, K, device=DEV), fmt, packed, poisoned((1, N), F32), route="tiled")


@pytest.mark.parametrize("weights", ["int4", "int8"])
def test_model_on_the_tiled_route(weights: str) -> None:
    """SmolLM2-135M shape, int4 / int8: prompt logits bit-equal to the other route's (mma for int4,
    warp for int8: the prompt route expands either layout to quant.dequantize's bits), and
    teacher-forced decode logits close to them."""
    from ninfer.engine.backends.cuda_runner import CudaModelRunner
    from ninfer.engine.batch import ScheduledBatch, SequenceWork
    from ninfer.engine.request import SamplingParams
    from ninfer.engine.synthetic import SyntheticArtifact
    from ninfer.kernels.profile import DeviceProfile

    artifact = SyntheticArtifact("smollm2-135m", weights, seed=4)
    other = "mma" if weights == "int4" else "warp"
    runners = {r: CudaModelRunner(artifact, num_pages=16, page_size=64, device="cuda",
                                  profile=DeviceProfile(gemv={"int4_sym": r, "int4_asym": r, "int8": r}))
               for r in (other, "tiled")}
    ops = runners["tiled"].ops
    if weights == "int4":
        asym = TensorFormat("int4", 32, False)
        assert ops.gemv_route(asym, 576, 960) == "tiled"
        assert ops.gemv_route(asym, 608, 960) == "mma" and ops.gemv_route(asym, 576, 40) == "mma"  # K, N do not fit
    else:
        int8 = TensorFormat("int8", 32)
        assert ops.gemv_route(int8, 576, 960) == "tiled" and ops.gemv_route(int8, 608, 960) == "tiled"
        assert ops.gemv_route(int8, 576, 40) == "warp"  # N not in 16s: warp, not int8's slower mma
    prompt = torch.randint(0, 49152, (120,), generator=torch.Generator().manual_seed(2)).tolist()
    first = {r: run.forward_logits(prompt) for r, run in runners.items()}
    assert torch.equal(first[other], first["tiled"])
    forced = torch.randint(0, 49152, (12,), generator=torch.Generator().manual_seed(3)).tolist()
    pages = [0, 1, 2]
    logits = {}
    for r, run in runners.items():
        run.run(ScheduledBatch([SequenceWork(seq_id=1, token_ids=prompt, start_pos=0, block_table=pages, sample=True,
                                             sampling=SamplingParams(temperature=0.0))]))
        steps = []
        for i, tok in enumerate(forced):
            work = SequenceWork(seq_id=1, token_ids=[tok], start_pos=len(prompt) + i, block_table=pages, sample=True,
                                sampling=SamplingParams(temperature=0.0), output_token_ids=forced[:i])
            steps.append(run.run_with_logits(ScheduledBatch([work]))[1][0])
        logits[r] = torch.stack(steps)
    assert any(src == "gemv_tiled.cu" for src, _ in runners["tiled"].kc._modules)  # decode ran the kernel
    assert not any(src == "gemv_tiled.cu" for src, _ in runners[other].kc._modules)
    a, b = logits["tiled"].double(), logits[other].double()
    assert ((a - b).norm(dim=-1) / b.norm(dim=-1)).max().item() < 0.05

