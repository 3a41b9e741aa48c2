"""The gated MLP activation fused into the gate_up gemv's epilogue (common.cuh tile_epilogue,
GEMV_GLU) on every route that has it — launchers.gemv mma (bf16, int8, int4 narrow and wide) and
tiled (int4, int8), blocks.gemv_blocks mma and tile — against, on fresh random data: the same weight's gemv
into bf16 followed by swiglu / geglu (bit-equal: what the unfused decode step computed), torch in
fp64 (close), and its own lone rows (batch invariant); the interleaved swiglu / geglu of the prompt
route against torch; and a model on the fused route (cuda decode logits against the torch backend)."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as Q

from ninfer.engine.quant import TensorFormat, dequantize, quantize
from ninfer.kernels import blocks as B
from ninfer.kernels import launchers as L
from ninfer.kernels.compiler import KernelCompiler, KernelError

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gguf_synth import random_blocks  # noqa: E402

DEV = "cuda"
BF = torch.bfloat16
# (kernel family, route, format, K): every route and format the fused epilogue serves
CASES = [
    ("gemv", "mma", TensorFormat("bf16"), 576),
    ("gemv", "mma", TensorFormat("int8", 32, True), 576),
    ("gemv", "mma", TensorFormat("int4", 32, False), 576),   # narrow rows (K % 128 != 0)
    ("gemv", "mma", TensorFormat("int4", 32, True), 1024),   # interleaved 16-byte rows
    ("gemv", "tiled", TensorFormat("int4", 32, False), 576),
    ("gemv", "tiled", TensorFormat("int4", 64, True), 1536),
    ("gemv", "tiled", TensorFormat("int8", 32), 576),
    ("gemv", "tiled", TensorFormat("int8", 64), 1536),
    ("blocks", "mma", TensorFormat("q5_0"), 2304),
    ("blocks", "mma", TensorFormat("q5_k"), 2304),
    ("blocks", "tile", TensorFormat("q4_k"), 2304),
    ("blocks", "tile", TensorFormat("q6_k"), 2304),
    ("blocks", "tile", TensorFormat("q5_k"), 2304),
    ("blocks", "tile", TensorFormat("q5_0"), 576),   # units of 2 blocks
    ("blocks", "tile", TensorFormat("q5_1"), 800),   # units of 1 block
    ("blocks", "tile", TensorFormat("iq4_xs"), 2304),
]
IDS = [f"{fam}-{route}-{fmt.format}{'' if not fmt.quantized else ('-sym' if fmt.symmetric else '-asym') + str(fmt.group_size)}-K{K}"
       for fam, route, fmt, K in CASES]
I = 760  # intermediate rows: N = 1520, 95 tiles (not a power of two)
ACTS = {"silu": F.silu, "gelu_tanh": lambda g: F.gelu(g, approximate="tanh")}


def rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    assert not torch.isnan(out).any(), "output has NaN (unwritten or broken)"
    return ((out - ref).norm() / ref.norm()).item()


def poisoned(shape: tuple[int, ...]) -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=BF, device=DEV)


def stored(fmt: TensorFormat, N: int, K: int, seed: int) -> dict[str, torch.Tensor]:
    """A weight [N, K] as stored: quant.py's parts, or llama.cpp blocks."""
    if fmt.blocks:
        data = random_blocks(np.random.default_rng(seed), Q[fmt.format.upper()], N, K, scale=0.05)
        return {"": torch.from_numpy(data).to(DEV)}
    w = torch.randn(N, K, generator=torch.Generator(DEV).manual_seed(seed), device=DEV) * 0.05
    return {"": w.to(BF)} if fmt.format == "bf16" else quantize(w, fmt)


def run(kc: KernelCompiler, fam: str, route: str, fmt: TensorFormat, parts: dict[str, torch.Tensor],
        x: torch.Tensor, out: torch.Tensor, glu: str = "") -> None:
    if fam == "blocks":
        B.gemv_blocks(kc, x, fmt, parts[""], out, route, glu=glu)
    else:
        L.gemv(kc, x, fmt, parts, out, route, glu=glu)


@pytest.mark.parametrize("activation", list(ACTS))
@pytest.mark.parametrize("fam,route,fmt,K", CASES, ids=IDS)
def test_fused_glu_gemv(kc: KernelCompiler, fam: str, route: str, fmt: TensorFormat, K: int, activation: str) -> None:
    gate, up = stored(fmt, I, K, seed=K), stored(fmt, I, K, seed=K + 1)
    parts = {sfx: L.glu_rows(gate[sfx], up[sfx]) for sfx in gate}
    if fam == "gemv":
        assert L.gemv_route_ok(route, fmt, K, BF, 2 * I)
        parts = L.gemv_pack(route, fmt, parts)
    x = (torch.randn(8, K + 64, generator=torch.Generator(DEV).manual_seed(7), device=DEV) * 0.5).to(BF)[:, :K]
    g64 = x.double() @ dequantize(fmt, gate, torch.float64).T
    u64 = x.double() @ dequantize(fmt, up, torch.float64).T
    ref = ACTS[activation](g64) * u64
    gated = L.swiglu if activation == "silu" else L.geglu
    lone = []
    for m in range(8):
        out = poisoned((1, I))
        run(kc, fam, route, fmt, parts, x[m:m + 1], out, glu=activation)
        lone.append(out[0])
    for M in (1, 2, 3, 5, 8):
        out = poisoned((M, I + 8))[:, :I]  # a row-strided output
        run(kc, fam, route, fmt, parts, x[:M], out, glu=activation)
        gate_up = poisoned((M, 2 * I))
        run(kc, fam, route, fmt, parts, x[:M], gate_up)
        unfused = poisoned((M, I))
        gated(kc, gate_up, unfused, interleaved=True)
        assert torch.equal(out, unfused), f"M={M}: the fused epilogue differs from gemv + {gated.__name__}"
        assert rel(out, ref[:M]) < 2e-2
        for m in range(M):
            assert torch.equal(out[m], lone[m]), f"M={M} row {m} differs from the row alone"


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("activation", list(ACTS))
@pytest.mark.parametrize("act", [BF, torch.float32])
def test_gated_kernels_against_torch(kc: KernelCompiler, interleaved: bool, activation: str, act: torch.dtype) -> None:
    T, inter = 37, 1536
    gate = torch.randn(T, inter, device=DEV) * 2
    up = torch.randn(T, inter, device=DEV)
    gate_up = torch.cat([gate, up], 1)
    if interleaved:  # columns in glu_rows' order: gate_up^T's rows interleaved
        gate_up = L.glu_rows(gate.T.contiguous(), up.T.contiguous()).T.contiguous()
    gate_up = gate_up.to(act)
    out = torch.full((T, inter), float("nan"), dtype=act, device=DEV)
    (L.swiglu if activation == "silu" else L.geglu)(kc, gate_up, out, interleaved=interleaved)
    ref = ACTS[activation](gate.to(act).double()) * up.to(act).double()
    assert rel(out, ref) < (1e-2 if act == BF else 1e-6)


def test_fused_glu_refuses_what_it_cannot_do(kc: KernelCompiler) -> None:
    fmt = TensorFormat("int4", 32, False)
    parts = quantize(torch.randn(2 * I, 576, device=DEV) * 0.05, fmt)
    x = torch.randn(1, 576, device=DEV).to(BF)
    with pytest.raises(KernelError, match="no fused gated activation"):
        L.gemv(kc, x, fmt, parts, poisoned((1, I)), "warp", glu="silu")
    with pytest.raises(KernelError, match="glu must be one of"):
        L.gemv(kc, x, fmt, L.gemv_pack("mma", fmt, parts), poisoned((1, I)), "mma", glu="relu")
    with pytest.raises(KernelError, match="shape"):
        L.gemv(kc, x, fmt, L.gemv_pack("mma", fmt, parts), poisoned((1, 2 * I)), "mma", glu="silu")


TINY = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
            head_dim=64, max_position_embeddings=1024, num_hidden_layers=2)


@pytest.mark.parametrize("weights", ["bf16", "int4", "int8", "q4_k_m"])
@pytest.mark.parametrize("base", ["smollm2-135m", "gemma3-4b"])
def test_model_with_fused_glu_matches_unfused(base: str, weights: str, monkeypatch) -> None:
    """A tiny llama (SwiGLU) and gemma3 (GeGLU) in bf16 on the cuda runner, MLPs on glu weights
    (decode: the fused epilogue wherever the route has it; prompt: the interleaved swiglu / geglu)
    against the same runner with glu weights refused (gemv, then swiglu / geglu): prompt logits to
    bf16 noise, and 16 greedy tokens through CUDA-graph decode identical."""
    from ninfer.engine.backends.cuda_runner import CudaModelRunner
    from ninfer.engine.ops.cuda_ops import CudaOps
    from ninfer.engine.synthetic import SHAPES, SyntheticArtifact
    from test_architectures_cuda import PAGE, greedy

    extra = dict(sliding_window=20, layer_types=["sliding_attention", "full_attention"]) if base == "gemma3-4b" else {}
    monkeypatch.setitem(SHAPES, "tiny", dict(SHAPES[base], **TINY, **extra))
    artifact = SyntheticArtifact("tiny", weights, seed=5)
    prompt = torch.randint(0, 512, (40,), generator=torch.Generator().manual_seed(5)).tolist()
    fused = CudaModelRunner(artifact, num_pages=16, page_size=PAGE, device="cuda", dtype=BF)
    glu = [layer.mlp.gate_up.glu for layer in fused.model.layers]
    assert all(glu)  # every format decodes on a route with the fused epilogue (int8: tiled)
    monkeypatch.setattr(CudaOps, "_glu_ok", lambda self, items, bias: False)
    plain = CudaModelRunner(artifact, num_pages=16, page_size=PAGE, device="cuda", dtype=BF)
    assert not any(layer.mlp.gate_up.glu for layer in plain.model.layers)
    a, b = fused.forward_logits(prompt).float(), plain.forward_logits(prompt).float()
    assert ((a - b).norm(dim=-1) / b.norm(dim=-1)).max().item() < 1e-2
    assert greedy(fused, prompt, 16) == greedy(plain, prompt, 16)
