"""The residual add + RMSNorm fused into a gemv's epilogue (common.cuh tile_epilogue GEMV_NORM: the
block that finishes last norms the rows) on every route that has it — launchers.gemv mma / tiled,
blocks.gemv_blocks mma / tile — against the gemv followed by rmsnorm_residual on fresh random data:
the gemv output, the updated residual and the normed rows bit-equal, for 1..8 rows, hidden sizes
below and above rmsnorm_residual's 2048 block-size switch, back-to-back launches (the arrival
counter resets itself); and a model with the fused norm against the same runner without it."""
from __future__ import annotations

import pytest
import torch

from ninfer.engine.quant import TensorFormat
from ninfer.kernels import blocks as B
from ninfer.kernels import launchers as L
from ninfer.kernels.compiler import KernelCompiler, KernelError
from test_fused_glu import BF, DEV, poisoned, stored

# (kernel family, route, format, K); N (the hidden size) from NS
CASES = [
    ("gemv", "mma", TensorFormat("bf16"), 576),
    ("gemv", "mma", TensorFormat("int4", 32, True), 1024),
    ("gemv", "tiled", TensorFormat("int4", 32, False), 1536),
    ("blocks", "mma", TensorFormat("q5_0"), 2304),
    ("blocks", "tile", TensorFormat("q4_k"), 2304),
    ("blocks", "tile", TensorFormat("q6_k"), 1536),
    ("blocks", "tile", TensorFormat("q5_k"), 2304),
    ("blocks", "tile", TensorFormat("q5_0"), 576),
    ("blocks", "tile", TensorFormat("q5_1"), 2304),
    ("blocks", "tile", TensorFormat("iq4_nl"), 576),
]
IDS = [f"{fam}-{route}-{fmt.format}-K{K}" for fam, route, fmt, K in CASES]
NS = [576, 2304]  # rmsnorm_residual runs 128 threads below 2048, 256 from it


def gemv(kc, fam, route, fmt, parts, x, out, norm=None):
    if fam == "blocks":
        B.gemv_blocks(kc, x, fmt, parts[""], out, route, norm=norm)
    else:
        L.gemv(kc, x, fmt, parts, out, route, norm=norm)


@pytest.mark.parametrize("N", NS)
@pytest.mark.parametrize("fam,route,fmt,K", CASES, ids=IDS)
def test_fused_norm_equals_gemv_then_rmsnorm(kc: KernelCompiler, fam: str, route: str, fmt: TensorFormat, K: int,
                                             N: int) -> None:
    parts = stored(fmt, N, K, seed=N + K)
    if fam == "gemv":
        parts = L.gemv_pack(route, fmt, parts)
    g = torch.Generator(DEV).manual_seed(N)
    x = (torch.randn(8, K, generator=g, device=DEV) * 0.5).to(BF)
    h = (torch.randn(8, N, generator=g, device=DEV) * 2).to(BF)
    w = (1 + 0.3 * torch.randn(N, generator=g, device=DEV)).to(BF)
    counter = torch.zeros(1, dtype=torch.int32, device=DEV)
    for M in (1, 3, 8, 2):  # back to back: the counter must be zero again after each launch
        y, res, out = poisoned((M, N)), h[:M].clone(), poisoned((M, N))
        gemv(kc, fam, route, fmt, parts, x[:M], y, norm=(res, w, out, 1e-6, counter))
        y2, res2, out2 = poisoned((M, N)), h[:M].clone(), poisoned((M, N))
        gemv(kc, fam, route, fmt, parts, x[:M], y2)
        L.rmsnorm_residual(kc, y2, w, out2, 1e-6, residual=res2)
        assert torch.equal(y, y2), f"M={M}: the gemv output changed"
        assert torch.equal(res, res2), f"M={M}: the residual differs from rmsnorm_residual's"
        assert torch.equal(out, out2), f"M={M}: the normed rows differ from rmsnorm_residual's"
        assert int(counter.item()) == 0, "the arrival counter was not reset"


def test_fused_norm_refuses(kc: KernelCompiler) -> None:
    fmt = TensorFormat("int4", 32, False)
    parts = stored(fmt, 576, 576, seed=1)
    x = torch.randn(2, 576, device=DEV).to(BF)
    h, w = torch.randn(2, 576, device=DEV).to(BF), torch.ones(576, device=DEV).to(BF)
    counter = torch.zeros(1, dtype=torch.int32, device=DEV)
    y = poisoned((2, 576))
    with pytest.raises(KernelError, match="fused norm"):
        L.gemv(kc, x, fmt, parts, y, "warp", norm=(h, w, poisoned((2, 576)), 1e-6, counter))
    with pytest.raises(KernelError, match="alias"):
        L.gemv(kc, x, fmt, L.gemv_pack("mma", fmt, parts), y, "mma", norm=(y, w, poisoned((2, 576)), 1e-6, counter))


TINY = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
            head_dim=64, max_position_embeddings=1024, num_hidden_layers=3)


@pytest.mark.parametrize("weights", ["bf16", "int4", "q4_k_m"])
def test_model_with_fused_norm_matches_unfused(weights: str, monkeypatch) -> None:
    """A tiny llama in bf16 on the cuda runner: o_proj and down_proj with the residual norm in their
    epilogue (CudaOps.FUSE_NORM on; off by default) against the same runner with it refused: 24 greedy
    tokens through CUDA-graph decode identical."""
    from ninfer.engine.backends.cuda_runner import CudaModelRunner
    from ninfer.engine.ops.cuda_ops import CudaOps
    from ninfer.engine.synthetic import SHAPES, SyntheticArtifact
    from test_architectures_cuda import PAGE, greedy

    monkeypatch.setitem(SHAPES, "tiny", dict(SHAPES["smollm2-135m"], **TINY))
    monkeypatch.setattr(CudaOps, "FUSE_NORM", True)
    monkeypatch.setattr(CudaOps, "PRE_NORM", False)  # else the norms go to their consumers' prologues
    monkeypatch.setattr(CudaOps, "SPLIT_NORM", False)  # or are split between the tiled gemvs
    artifact = SyntheticArtifact("tiny", weights, seed=6)
    prompt = torch.randint(0, 512, (40,), generator=torch.Generator().manual_seed(6)).tolist()
    fused = CudaModelRunner(artifact, num_pages=16, page_size=PAGE, device="cuda", dtype=BF)
    assert all(fused.ops._norm_route(layer.mlp.down) for layer in fused.model.layers)
    tokens = greedy(fused, prompt, 24)
    monkeypatch.setattr(CudaOps, "_norm_route", lambda self, w: False)
    plain = CudaModelRunner(artifact, num_pages=16, page_size=PAGE, device="cuda", dtype=BF)
    assert greedy(plain, prompt, 24) == tokens
