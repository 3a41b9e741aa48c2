"""A residual norm split between two decode gemvs, tiled or mma (common.cuh GEMV_HWOUT / GEMV_RSCALE,
CudaOps.SPLIT_NORM) on fresh random data: the residual gemv's epilogue adds its output into the residual
with rmsnorm_residual's bits, writes h * w bit for bit as torch rounds it and the 16-column sums of
squares; the consumer's sums, scaled by each row's rinv, within bf16 rounding of rmsnorm_residual then the
plain gemv, and a row's bits the same at every row count (batch invariance) and with and without RS_PAR;
the launcher's refusals; and a tiny llama with SPLIT_NORM against the same runner without it."""
from __future__ import annotations

import pytest
import torch

from ninfer.engine.quant import TensorFormat
from ninfer.kernels import launchers as L
from ninfer.kernels.compiler import KernelCompiler, KernelError
from test_fused_glu import BF, DEV, poisoned, rel, stored
from test_prenorm import TINY, count_gemv

# (route, format): the tiled route's formats, bf16's mma pipeline (the rule's MMA_PIPE) and one quantized mma
CASES = [("tiled", TensorFormat("int4", 32, False)), ("tiled", TensorFormat("int4", 64, True)),
         ("tiled", TensorFormat("int8", 32)), ("mma", TensorFormat("bf16")), ("mma", TensorFormat("int8", 32, True))]
CIDS = ["tiled-int4-asym32", "tiled-int4-sym64", "tiled-int8-32", "mma-bf16", "mma-int8-32"]


def data(M: int, N: int, K: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A residual gemv's input x [M, K], the residual h [M, N] and a norm weight [N], bf16."""
    g = torch.Generator(DEV).manual_seed(seed)
    x = (torch.randn(M, K, generator=g, device=DEV) * 0.5).to(BF)
    h = (torch.randn(M, N, generator=g, device=DEV) * 2).to(BF)
    w = (1 + 0.3 * torch.randn(N, generator=g, device=DEV)).to(BF)
    return x, h, w


def hwout(kc: KernelCompiler, x: torch.Tensor, fmt: TensorFormat, parts: dict, h: torch.Tensor,
          w: torch.Tensor, route: str = "tiled") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(h * w, parts, the residual after) of an hwout gemv."""
    M, N = h.shape
    res, out = h.clone(), poisoned((M, N))
    sums = torch.full((M, N // 16), float("nan"), device=DEV)
    L.gemv(kc, x, fmt, parts, out, route, hwout=(res, w, sums))
    return out, sums, res


@pytest.mark.parametrize("N,K", [(576, 1536), (4096, 4096), (4096, 14336), (2304, 2304)])
@pytest.mark.parametrize("route,fmt", CASES, ids=CIDS)
def test_hwout_adds_the_residual_and_writes_h_times_w(kc: KernelCompiler, route: str, fmt: TensorFormat, N: int,
                                                      K: int) -> None:
    """1..8 rows (N / 16 <= 2 SMs at 4096: the tiled rule's register cap): the residual as rmsnorm_residual
    adds the plain gemv's output, h * w as torch rounds it, the sums of squares within fp32 rounding of
    torch's and a row's the same at every row count."""
    if fmt.quantized and K % fmt.group_size:
        pytest.skip("group size does not divide K")
    parts = L.gemv_pack(route, fmt, stored(fmt, N, K, seed=N + 5 * K))
    x, h, w = data(8, N, K, seed=N + K)
    one = [hwout(kc, x[m:m + 1], fmt, parts, h[m:m + 1], w, route)[1] for m in range(8)]
    for M in (1, 3, 8, 2):
        out, sums, res = hwout(kc, x[:M], fmt, parts, h[:M], w, route)
        y = poisoned((M, N))
        L.gemv(kc, x[:M], fmt, parts, y, route)
        res2 = h[:M].clone()
        L.rmsnorm_residual(kc, y, w, poisoned((M, N)), 1e-6, residual=res2)
        assert torch.equal(res, res2), f"M={M}: the residual differs from rmsnorm_residual's add"
        assert torch.equal(out, (res.float() * w.float()).to(BF)), f"M={M}: h * w"
        ref = res.double().pow(2).view(M, N // 16, 16).sum(-1)
        assert torch.allclose(sums.double(), ref, rtol=1e-5, atol=0), f"M={M}: sums of squares"
        for m in range(M):
            assert torch.equal(sums[m:m + 1], one[m]), f"M={M} row {m}: other sums than alone"


@pytest.mark.parametrize("glu", ["", "silu"])
@pytest.mark.parametrize("N,K", [(1536, 576), (6144, 4096), (16384, 4096), (1520, 2304)])
@pytest.mark.parametrize("route,fmt", CASES, ids=CIDS)
def test_rscale_gemv_is_the_normed_gemv(kc: KernelCompiler, route: str, fmt: TensorFormat, N: int, K: int,
                                        glu: str) -> None:
    """An hwout gemv [K, K2] then the consumer [N, K] with rscale: within bf16 rounding of rmsnorm_residual
    then the plain gemv (N 16384: int4's staged activations), and a row's bits at 1, 3, 8 and 2 rows
    those it has alone."""
    if fmt.quantized and K % fmt.group_size:
        pytest.skip("group size does not divide K")
    K2 = 1536
    x, h, w = data(8, K, K2, seed=N + K)
    o_parts = L.gemv_pack(route, fmt, stored(fmt, K, K2, seed=K + 11))
    parts = L.gemv_pack(route, fmt, stored(fmt, N, K, seed=N + 3 * K))
    width = N // 2 if glu else N
    for eps in (1e-6, 1e-5):
        hw, sums, _ = hwout(kc, x, fmt, o_parts, h, w, route)
        alone = []
        for m in range(8):
            y = poisoned((1, width))
            L.gemv(kc, hw[m:m + 1], fmt, parts, y, route, glu=glu, rscale=(sums[m:m + 1], eps))
            alone.append(y)
        # the reference: the residual gemv, rmsnorm_residual, the plain gemv
        y0 = poisoned((8, K))
        L.gemv(kc, x, fmt, o_parts, y0, route)
        res, normed, ref = h.clone(), poisoned((8, K)), poisoned((8, width))
        L.rmsnorm_residual(kc, y0, w, normed, eps, residual=res)
        L.gemv(kc, normed, fmt, parts, ref, route, glu=glu)
        for M in (1, 3, 8, 2):
            y = poisoned((M, width))
            L.gemv(kc, hw[:M], fmt, parts, y, route, glu=glu, rscale=(sums[:M], eps))
            assert rel(y, ref[:M]) < 1e-2, f"eps {eps} M={M}: {rel(y, ref[:M])}"
            for m in range(M):
                assert torch.equal(y[m:m + 1], alone[m]), f"eps {eps} M={M} row {m}: other bits than alone"


@pytest.mark.parametrize("glu", ["", "silu"])
@pytest.mark.parametrize("route,fmt", CASES, ids=CIDS)
def test_rscale_par_gives_the_same_bits(kc: KernelCompiler, route: str, fmt: TensorFormat, glu: str,
                                        monkeypatch) -> None:
    """RS_PAR (launchers.RSCALE_PAR_ROWS: a warp a row reduces the sums) against warp 0 reducing them all:
    the same bits at 1..8 rows (speed only)."""
    N, K = 1536, 4096
    g = torch.Generator(DEV).manual_seed(9)
    hw = (torch.randn(8, K, generator=g, device=DEV) * 0.5).to(BF)
    sums = torch.rand(8, K // 16, generator=g, device=DEV) * 16
    parts = L.gemv_pack(route, fmt, stored(fmt, N, K, seed=13))
    width = N // 2 if glu else N
    for M in range(1, 9):
        out = {}
        for par in (False, True):
            monkeypatch.setattr(L, "RSCALE_PAR_ROWS", 1 if par else L.MAX_GEMV_ROWS + 1)
            out[par] = poisoned((M, width))
            L.gemv(kc, hw[:M], fmt, parts, out[par], route, glu=glu, rscale=(sums[:M], 1e-6))
        assert not torch.isnan(out[True]).any() and torch.equal(out[True], out[False]), f"M={M}"


@pytest.mark.parametrize("N,K", [(4096, 4096), (576, 1536)])
@pytest.mark.parametrize("route,fmt", CASES, ids=CIDS)
def test_hw_early_gives_the_same_bits(kc: KernelCompiler, route: str, fmt: TensorFormat, N: int, K: int,
                                      monkeypatch) -> None:
    """launchers.HWOUT_EARLY (the residual and norm weights loaded after the PDL wait) against the epilogue's
    loads: the same residual, h * w and sums at 1..8 rows (speed only)."""
    if fmt.quantized and K % fmt.group_size:
        pytest.skip("group size does not divide K")
    parts = L.gemv_pack(route, fmt, stored(fmt, N, K, seed=17))
    x, h, w = data(8, N, K, seed=19)
    for M in range(1, 9):
        out = {}
        for early in (False, True):
            monkeypatch.setattr(L, "HWOUT_EARLY", early)
            out[early] = hwout(kc, x[:M], fmt, parts, h[:M], w, route)
        for a, b in zip(out[False], out[True]):
            assert not torch.isnan(b).any() and torch.equal(a, b), f"M={M}"


def test_hwout_and_rscale_refuse(kc: KernelCompiler) -> None:
    fmt = TensorFormat("int4", 32, False)
    stored_w = stored(fmt, 576, 576, seed=1)
    tiled = L.gemv_pack("tiled", fmt, stored_w)
    x, h, w = data(1, 576, 576, seed=2)
    sums = torch.zeros(1, 36, device=DEV)
    with pytest.raises(KernelError, match="mma / tiled routes"):
        L.gemv(kc, x, fmt, stored_w, poisoned((1, 576)), "warp", hwout=(h, w, sums))
    with pytest.raises(KernelError, match="mma / tiled routes"):
        L.gemv(kc, x, fmt, stored_w, poisoned((1, 576)), "warp", rscale=(sums, 1e-6))
    with pytest.raises(KernelError, match="alias"):
        L.gemv(kc, x, fmt, tiled, h, "tiled", hwout=(h, w, sums))
    with pytest.raises(KernelError, match="no glu"):
        L.gemv(kc, x, fmt, tiled, poisoned((1, 288)), "tiled", glu="silu", hwout=(h, w, sums))
    with pytest.raises(KernelError, match="parts"):
        L.gemv(kc, x, fmt, tiled, poisoned((1, 576)), "tiled", hwout=(h, w, torch.zeros(1, 35, device=DEV)))
    with pytest.raises(KernelError, match="no prenorm"):
        L.gemv(kc, x, fmt, tiled, poisoned((1, 576)), "tiled", prenorm=(h, w, 1e-6), rscale=(sums, 1e-6))
    with pytest.raises(KernelError, match="K <= "):
        K = L.RSCALE_MAX_K + 64
        big = L.gemv_pack("tiled", fmt, stored(fmt, 16, K, seed=3))
        L.gemv(kc, torch.zeros(1, K, dtype=BF, device=DEV), fmt, big, poisoned((1, 16)), "tiled",
               rscale=(torch.zeros(1, K // 16, device=DEV), 1e-6))


@pytest.mark.parametrize("weights", ["int4", "int8", "bf16"])
def test_model_with_split_norms(weights: str, monkeypatch) -> None:
    """A tiny llama on the cuda runner with CudaOps.SPLIT_NORM (every norm between o_proj and gate_up and
    between down and the next qkv split between them; bf16's on the mma route, SPLIT_MMA) against the same
    runner without it (PRE_NORM off in both): the first decode step's logits within bf16 rounding, and 24
    greedy tokens through CUDA-graph decode the same."""
    from ninfer.engine.backends.cuda_runner import CudaModelRunner
    from ninfer.engine.batch import ScheduledBatch
    from ninfer.engine.ops.cuda_ops import CudaOps
    from ninfer.engine.synthetic import SHAPES, SyntheticArtifact
    from test_architectures_cuda import PAGE, greedy, work

    monkeypatch.setitem(SHAPES, "tiny", dict(SHAPES["smollm2-135m"], **TINY))
    monkeypatch.setattr(CudaOps, "PRE_NORM", False)
    artifact = SyntheticArtifact("tiny", weights, seed=7)
    prompt = torch.randint(0, 512, (40,), generator=torch.Generator().manual_seed(7)).tolist()

    def first_decode_logits(runner) -> torch.Tensor:
        pages = list(range(-(-(len(prompt) + 1) // PAGE)))
        out = runner.run(ScheduledBatch([work(prompt, 0, pages)]))
        first = out.sampled[1]
        return runner.run_with_logits(ScheduledBatch([work([first], len(prompt), pages, [first])]))[1][0]

    monkeypatch.setattr(CudaOps, "SPLIT_NORM", False)
    plain = CudaModelRunner(artifact, num_pages=16, page_size=PAGE, device="cuda", dtype=BF)
    tokens, logits = greedy(plain, prompt, 24), first_decode_logits(plain)
    del plain
    seen = count_gemv(monkeypatch, "hwout", "rscale")
    monkeypatch.setattr(CudaOps, "SPLIT_NORM", True)
    monkeypatch.setattr(CudaOps, "SPLIT_MMA", True)
    split = CudaModelRunner(artifact, num_pages=16, page_size=PAGE, device="cuda", dtype=BF)
    assert greedy(split, prompt, 24) == tokens
    assert rel(first_decode_logits(split), logits) < 1e-2
    assert seen["hwout"] > 0 and seen["hwout"] == seen["rscale"], seen
