"""A decode row's residual norm moved into the gemv that consumes it (common.cuh GEMV_PNORM, on the tiled
route and bf16's mma pipeline: every block forms rmsnorm(residual + x) * w in its shared memory, the
residual only read) and the residual's add moved into the next residual gemv's epilogue (common.cuh
GEMV_CATCHUP), against what they replace on fresh random data: rmsnorm_residual then the gemv, bit for
bit (int4 asym / sym, int8, bf16; hidden sizes below and above rmsnorm_residual's 2048 block-size
switch; a plain and a gated-MLP epilogue), the residual add bit for bit (1..8 rows, shapes whose rule
caps registers), the launcher's refusals, and a model with CudaOps.PRE_NORM against the same runner
without it."""
from __future__ import annotations

import pytest
import torch

from ninfer.engine.quant import TensorFormat
from ninfer.kernels import launchers as L
from ninfer.kernels.compiler import KernelCompiler, KernelError
from test_fused_glu import BF, DEV, poisoned, stored

# (route, format): the tiled route's formats and the mma route's bf16 pipeline
ROUTES = [("tiled", TensorFormat("int4", 32, False)), ("tiled", TensorFormat("int4", 64, True)),
          ("tiled", TensorFormat("int8", 32)), ("mma", TensorFormat("bf16"))]
RIDS = ["tiled-int4-asym32", "tiled-int4-sym64", "tiled-int8-32", "mma-bf16"]


def rows(K: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A residual gemv's output x [1, K], the residual h [1, K] and a norm weight [K], bf16."""
    g = torch.Generator(DEV).manual_seed(seed)
    x = (torch.randn(1, K, generator=g, device=DEV) * 0.5).to(BF)
    h = (torch.randn(1, K, generator=g, device=DEV) * 2).to(BF)
    w = (1 + 0.3 * torch.randn(K, generator=g, device=DEV)).to(BF)
    return x, h, w


@pytest.mark.parametrize("glu", ["", "silu"])
@pytest.mark.parametrize("K", [576, 2304, 4096])
@pytest.mark.parametrize("route,fmt", ROUTES, ids=RIDS)
def test_prenorm_gemv_equals_rmsnorm_then_gemv(kc: KernelCompiler, route: str, fmt: TensorFormat, K: int,
                                               glu: str) -> None:
    N = 1520 if glu else 1536  # gate_up rows: I = 760 (95 tiles); else 96 tiles
    parts = L.gemv_pack(route, fmt, stored(fmt, N, K, seed=N + K))
    x, h, w = rows(K, seed=K)
    width = N // 2 if glu else N
    for eps in (1e-6, 1e-5):
        res, y = h.clone(), poisoned((1, width))
        L.gemv(kc, x, fmt, parts, y, route, glu=glu, prenorm=(res, w, eps))
        assert torch.equal(res, h), "the prenorm gemv wrote the residual"
        res2, normed, y2 = h.clone(), poisoned((1, K)), poisoned((1, width))
        L.rmsnorm_residual(kc, x, w, normed, eps, residual=res2)
        L.gemv(kc, normed, fmt, parts, y2, route, glu=glu)
        assert torch.equal(y, y2), f"eps {eps}: other bits than rmsnorm_residual then the gemv"


@pytest.mark.parametrize("N,K", [(1536, 576), (4096, 4096), (4096, 14336), (2304, 2304)])
@pytest.mark.parametrize("route,fmt", ROUTES + [("mma", TensorFormat("int4", 32, False))],
                         ids=RIDS + ["mma-int4-asym32"])
def test_catchup_gemv_adds_the_previous_output(kc: KernelCompiler, route: str, fmt: TensorFormat, N: int,
                                               K: int) -> None:
    """y as the plain gemv's, and residual += y_prev as rmsnorm_residual adds it, 1..8 rows (N / 16 <= 2
    SMs at 4096: the tiled rule's register cap)."""
    if fmt.quantized and K % fmt.group_size:
        pytest.skip("group size does not divide K")
    parts = L.gemv_pack(route, fmt, stored(fmt, N, K, seed=N + 3 * K))
    g = torch.Generator(DEV).manual_seed(N)
    x = (torch.randn(8, K, generator=g, device=DEV) * 0.5).to(BF)
    y_prev = (torch.randn(8, N, generator=g, device=DEV) * 0.5).to(BF)
    h = (torch.randn(8, N, generator=g, device=DEV) * 2).to(BF)
    w = torch.ones(N, dtype=BF, device=DEV)
    for M in (1, 3, 8, 2):
        res, y = h[:M].clone(), poisoned((M, N))
        L.gemv(kc, x[:M], fmt, parts, y, route, catchup=(y_prev[:M], res))
        y2 = poisoned((M, N))
        L.gemv(kc, x[:M], fmt, parts, y2, route)
        res2 = h[:M].clone()
        L.rmsnorm_residual(kc, y_prev[:M], w, poisoned((M, N)), 1e-6, residual=res2)
        assert torch.equal(y, y2), f"M={M}: the gemv output changed"
        assert torch.equal(res, res2), f"M={M}: the residual differs from rmsnorm_residual's add"
        assert torch.equal(res, h[:M] + y_prev[:M]), f"M={M}: the residual differs from torch's bf16 add"


def test_prenorm_and_catchup_refuse(kc: KernelCompiler) -> None:
    fmt = TensorFormat("int4", 32, False)
    parts = stored(fmt, 1536, 576, seed=1)
    tiled = L.gemv_pack("tiled", fmt, parts)
    x2 = torch.randn(2, 576, device=DEV).to(BF)
    x, h, w = rows(576, seed=2)
    with pytest.raises(KernelError, match="one bf16 row"):
        L.gemv(kc, x2, fmt, tiled, poisoned((2, 1536)), "tiled", prenorm=(h, w, 1e-6))
    with pytest.raises(KernelError, match="bf16 weights"):
        L.gemv(kc, x, fmt, L.gemv_pack("mma", fmt, parts), poisoned((1, 1536)), "mma", prenorm=(h, w, 1e-6))
    with pytest.raises(KernelError, match="routes"):
        L.gemv(kc, x, fmt, parts, poisoned((1, 1536)), "warp", prenorm=(h, w, 1e-6))
    with pytest.raises(KernelError, match="one bf16 row"):  # K past TILED_XSMEM_BYTES
        big = TensorFormat("int4", 32, False)
        K = L.TILED_XSMEM_BYTES // 2
        xb, hb, wb = rows(K, seed=3)
        L.gemv(kc, xb, big, L.gemv_pack("tiled", big, stored(big, 16, K, seed=3)), poisoned((1, 16)), "tiled",
               prenorm=(hb, wb, 1e-6))
    y = poisoned((1, 1536))
    with pytest.raises(KernelError, match="alias"):
        L.gemv(kc, x, fmt, tiled, y, "tiled", catchup=(poisoned((1, 1536)), y))
    with pytest.raises(KernelError, match="no glu"):
        L.gemv(kc, x, fmt, tiled, poisoned((1, 768)), "tiled", glu="silu",
               catchup=(poisoned((1, 1536)), poisoned((1, 1536))))


def count_gemv(monkeypatch, *keys: str) -> dict[str, int]:
    """launchers.gemv replaced by itself counting the calls given each of `keys` (its keyword arguments)."""
    seen = dict.fromkeys(keys, 0)
    gemv = L.gemv

    def counting(*args, **kwargs):
        for key in seen:
            seen[key] += kwargs.get(key) is not None
        return gemv(*args, **kwargs)

    monkeypatch.setattr(L, "gemv", counting)
    return seen


TINY = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
            head_dim=64, max_position_embeddings=1024, num_hidden_layers=3)


@pytest.mark.parametrize("weights", ["int4", "int8", "bf16"])
def test_model_with_prenorm_matches_without(weights: str, monkeypatch) -> None:
    """A tiny llama on the cuda runner with CudaOps.PRE_NORM (the norms in the gate_up and next qkv gemvs'
    prologues, the residual caught up by o_proj and down) against the same runner without it: 24 greedy
    tokens through CUDA-graph decode identical; int4 and int8 on the tiled route, bf16 on mma's
    pipeline."""
    from ninfer.engine.backends.cuda_runner import CudaModelRunner
    from ninfer.engine.ops.cuda_ops import CudaOps
    from ninfer.engine.synthetic import SHAPES, SyntheticArtifact
    from test_architectures_cuda import PAGE, greedy

    monkeypatch.setitem(SHAPES, "tiny", dict(SHAPES["smollm2-135m"], **TINY))
    artifact = SyntheticArtifact("tiny", weights, seed=7)
    prompt = torch.randint(0, 512, (40,), generator=torch.Generator().manual_seed(7)).tolist()
    monkeypatch.setattr(CudaOps, "PRE_NORM", False)
    monkeypatch.setattr(CudaOps, "SPLIT_NORM", False)  # tests/gpu/test_split_norm.py
    plain = CudaModelRunner(artifact, num_pages=16, page_size=PAGE, device="cuda", dtype=BF)
    tokens = greedy(plain, prompt, 24)
    del plain
    seen = count_gemv(monkeypatch, "prenorm", "catchup")
    monkeypatch.setattr(CudaOps, "PRE_NORM", True)
    fused = CudaModelRunner(artifact, num_pages=16, page_size=PAGE, device="cuda", dtype=BF)
    assert greedy(fused, prompt, 24) == tokens
    assert seen["prenorm"] > 0 and seen["catchup"] > 0, seen
