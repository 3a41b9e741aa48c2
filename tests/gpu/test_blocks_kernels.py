"""blocks.cu (llama.cpp block formats read in place) against the torch dequantize reference on fresh
random blocks: gemv for 1..8 rows on every route (warp: fp32 math, bf16 and fp32 activations; mma:
tensor cores, bf16; tile: tensor cores over whole blocks of the TILE_FORMATS (q4_k, q5_k, q6_k, q5_0,
q5_1, iq4_nl, iq4_xs), bf16, also at the llama-8b and SmolLM2 decode shapes), bf16 and fp32 outputs,
batch invariance, dequant_blocks (prefill expansion and the embedding gather), and the cuda runner
against the torch runner on a tiny GGUF of every block type and on synthetic llama-8b Q4_K / Q4_K_M
weights."""
from __future__ import annotations

import gc
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from ninfer.engine.quant import dequantize
from ninfer.formats import BLOCK_FORMATS, TensorFormat
from ninfer.kernels import blocks as B
from ninfer.kernels.compiler import KernelCompiler, KernelError

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gguf_synth import random_blocks  # noqa: E402

DEV = "cuda"
BF, F32 = torch.bfloat16, torch.float32
NAMES = list(BLOCK_FORMATS)
TOL = {BF: 1e-2, F32: 1e-5}


def blocks(name: str, N: int, K: int, seed: int) -> torch.Tensor:
    data = random_blocks(np.random.default_rng(seed), Q[name.upper()], N, K, scale=0.05)
    return torch.from_numpy(data).to(DEV)


def rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    assert not torch.isnan(out).any(), "output has NaN (unwritten or broken)"
    return ((out - ref).norm() / ref.norm()).item()


def poisoned(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=dtype, device=DEV)


CASES = [("warp", BF, BF), ("warp", BF, F32), ("warp", F32, F32), ("mma", BF, BF), ("mma", BF, F32),
         ("tile", BF, BF), ("tile", BF, F32)]


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("M", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("route,act,out_dtype", CASES, ids=[f"{r}-{a}-{o}".replace("torch.", "") for r, a, o in CASES])
def test_gemv_blocks(kc: KernelCompiler, name: str, M: int, route: str, act: torch.dtype,
                     out_dtype: torch.dtype) -> None:
    """N = 1000 (not a multiple of 16: the mma route's last tile is partial), K = 2048 + 256."""
    fmt = TensorFormat(name)
    N, K = 1000, 2304
    if not B.route_ok(route, fmt, act, K):
        pytest.skip(f"the {route} route does not take {name}")
    w = blocks(name, N, K, seed=M)
    x = (torch.randn(M, K, generator=torch.Generator(DEV).manual_seed(M), device=DEV)).to(act)
    out = poisoned((M, N), out_dtype)
    B.gemv_blocks(kc, x, fmt, w, out, route)
    ref = x.double() @ dequantize(fmt, {"": w}, torch.float64).T
    assert rel(out, ref) < TOL[out_dtype]


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("route", B.ROUTES)
def test_gemv_blocks_batch_invariant_and_strided(kc: KernelCompiler, name: str, route: str) -> None:
    """Row 0 bit-equal whatever M is; x and out may be row-strided views (a fused projection's slice)."""
    fmt = TensorFormat(name)
    N, K = 576, 1536
    if not B.route_ok(route, fmt, BF, K):
        pytest.skip(f"the {route} route does not take {name}")
    w = blocks(name, N, K, seed=11)
    x = torch.randn(8, K + 256, device=DEV).to(BF)[:, :K]
    out8 = poisoned((8, N + 64), F32)[:, 32:32 + N]
    out1 = poisoned((1, N), F32)
    B.gemv_blocks(kc, x, fmt, w, out8, route)
    B.gemv_blocks(kc, x[:1], fmt, w, out1, route)
    assert torch.equal(out1[0], out8[0])
    assert rel(out8, x.double() @ dequantize(fmt, {"": w}, torch.float64).T) < 1e-5


# (N, K) of llama-8b's decode gemvs (o, down, gate/up halves, lm_head) and SmolLM2-135M's down
# (k/v alone: 16 warps per block); for the 32-element formats also SmolLM2's q/o, k/v and gate/up
# halves (K = 576: units of 2 blocks) and a width of an odd count of blocks (q5_1 alone: units of 1)
SHAPES = [(4096, 4096), (4096, 14336), (14336, 4096), (128256, 4096), (1024, 4096), (576, 1536)]
SMALL_SHAPES = [(4096, 4096), (4096, 14336), (1024, 4096), (576, 1536), (576, 576), (192, 576), (1536, 576),
                (320, 800)]
TILE_CASES = [(name, N, K) for name in B.TILE_FORMATS for N, K in (SHAPES if name in ("q4_k", "q6_k") else SMALL_SHAPES)
              if B.route_ok("tile", TensorFormat(name), BF, K)]


@pytest.mark.parametrize("prefetch,bounded", [(False, None), (True, None), (False, True)],
                         ids=["", "prefetch", "bounded"])
@pytest.mark.parametrize("name,N,K", TILE_CASES, ids=[f"{name}-{n}x{k}" for name, n, k in TILE_CASES])
def test_gemv_blocks_tile_at_model_shapes(kc: KernelCompiler, name: str, N: int, K: int, prefetch: bool,
                                          bounded: bool | None, monkeypatch: pytest.MonkeyPatch) -> None:
    """The tile route at the shapes decode runs (8 and 16 warps per block; without the prefetch of the
    next block, with it, and with registers bounded in every 8-warp shape), rows 1..8, fresh random
    blocks: bf16 and fp32 outputs against fp64 over gguf-py's dequantization (the torch reference),
    and row r of an 8-row call bit-equal to the same row alone."""
    monkeypatch.setattr(B, "TILE_PREFETCH", prefetch)
    monkeypatch.setattr(B, "TILE_BOUNDED", bounded)
    fmt = TensorFormat(name)
    w = blocks(name, N, K, seed=N + K)
    x = torch.randn(8, K, generator=torch.Generator(DEV).manual_seed(K), device=DEV).to(BF)
    ref = x.double() @ dequantize(fmt, {"": w}, torch.float64).T
    out8 = poisoned((8, N), F32)
    B.gemv_blocks(kc, x, fmt, w, out8, "tile")
    assert rel(out8, ref) < 1e-5
    for M in range(1, 8):
        out = poisoned((M, N), F32)
        B.gemv_blocks(kc, x[:M], fmt, w, out, "tile")
        assert torch.equal(out, out8[:M]), M
        outb = poisoned((M, N), BF)
        B.gemv_blocks(kc, x[:M], fmt, w, outb, "tile")
        assert rel(outb, ref[:M]) < 1e-2
    mma = poisoned((8, N), F32)
    B.gemv_blocks(kc, x, fmt, w, mma, "mma")
    assert rel(out8, mma.double()) < 1e-5


def test_tile_prefetch_and_bounds_by_grid(kc: KernelCompiler) -> None:
    """Unforced, the tile route prefetches for PREFETCH_FORMATS where the grid fits on the SMs at once
    (llama-8b's o: 256 blocks of 8 warps, 2 per SM on 128+ SMs), not where blocks queue (64 per SM: more
    than any GPU holds), and never for the other formats; it bounds registers for q6_k and where blocks
    queue for many waves, only in 8-warp blocks."""
    sms = kc.sm_count
    if sms < 128:
        pytest.skip(f"{sms} SMs: llama-8b's o does not fit in one wave")
    for name in B.TILE_FORMATS:
        base, fmt = {"BLK_FMT": B.BLOCK_CODES[name]}, TensorFormat(name)
        assert B.tile_prefetch(kc, base, fmt, 4096, 4096) == (name in B.PREFETCH_FORMATS), name
        assert not B.tile_prefetch(kc, base, fmt, 16 * 64 * sms, 4096), name
        assert B.tile_bounded(kc, fmt, 4096) == (name == "q6_k"), name
        assert B.tile_bounded(kc, fmt, 16 * 64 * sms), name
        assert not B.tile_bounded(kc, fmt, 1024), name  # 16 warps per block


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("act", [BF, F32], ids=["bf16", "f32"])
def test_dequant_blocks_prefill_and_gather(kc: KernelCompiler, name: str, act: torch.dtype) -> None:
    """The whole weight (prefill: then cuBLAS at 512 rows) and a gather of rows (the embedding)."""
    fmt = TensorFormat(name)
    N, K = 768, 4096
    w = blocks(name, N, K, seed=3)
    ref = dequantize(fmt, {"": w}, torch.float32)
    out = poisoned((N, K), act)
    B.dequant_blocks(kc, fmt, w, out)
    if act == F32:
        assert rel(out, ref) < 1e-6
    else:
        assert torch.equal(out, ref.to(BF)) or rel(out, ref) < 4e-3
    x = torch.randn(512, K, device=DEV).to(BF)
    assert rel(x @ out.to(BF).T, x.double() @ ref.double().T) < 1e-2
    ids = torch.tensor([5, 0, N - 1, 5, 77], dtype=torch.int32, device=DEV)
    rows = poisoned((5, K), act)
    B.dequant_blocks(kc, fmt, w, rows, rows=ids)
    assert torch.equal(rows, out[ids.long()])


def test_block_launchers_check_arguments(kc: KernelCompiler) -> None:
    w = blocks("q4_k", 64, 512, seed=0)
    x = torch.randn(1, 512, device=DEV).to(BF)
    with pytest.raises(KernelError, match="multiple of the q4_k block size"):
        B.gemv_blocks(kc, torch.randn(1, 500, device=DEV).to(BF), TensorFormat("q4_k"), w, poisoned((1, 64), BF))
    with pytest.raises(KernelError, match="1..8 rows"):
        B.gemv_blocks(kc, torch.randn(9, 512, device=DEV).to(BF), TensorFormat("q4_k"), w, poisoned((9, 64), BF))
    with pytest.raises(KernelError, match="no block kernel"):
        B.gemv_blocks(kc, x, TensorFormat("int8", 32), w, poisoned((1, 64), BF))
    with pytest.raises(KernelError, match="bfloat16 activations"):
        B.gemv_blocks(kc, x.float(), TensorFormat("q4_k"), w, poisoned((1, 64), F32), "mma")
    with pytest.raises(KernelError, match="bfloat16 activations"):
        B.gemv_blocks(kc, x.float(), TensorFormat("q4_k"), w, poisoned((1, 64), F32), "tile")
    w2 = blocks("q2_k", 64, 512, seed=0)
    with pytest.raises(KernelError, match="tile route takes"):
        B.gemv_blocks(kc, x, TensorFormat("q2_k"), w2, poisoned((1, 64), BF), "tile")
    w5 = blocks("q5_0", 64, 800, seed=0)  # 25 blocks a row: 22-byte blocks leave odd rows 2 mod 4
    with pytest.raises(KernelError, match="K in 64s"):
        B.gemv_blocks(kc, torch.randn(1, 800, device=DEV).to(BF), TensorFormat("q5_0"), w5, poisoned((1, 64), BF),
                      "tile")


# ---- whole models: the cuda runner against the torch runner -----------------------------------------

def test_tiny_kquant_files_cuda_matches_torch(tmp_path: Path) -> None:
    """Tiny GGUFs of every block type (and mixed-format fused projections) served as stored: the cuda
    runner's prompt and decode logits against the fp32 torch runner on the same artifact; in fp32
    mode to summation order (1e-4), in bf16 as close as the bf16 torch runner is."""
    from test_cuda_runner import check
    from test_kquants import MIXES, TINY

    from gguf_synth import write_tiny_gguf
    from ninfer.engine.artifact import Artifact
    from ninfer.engine.backends.cuda_runner import CudaModelRunner
    from ninfer.engine.backends.torch_runner import TorchModelRunner
    from ninfer.engine.batch import ScheduledBatch, SequenceWork
    from ninfer.engine.model_store import resolve_model
    from ninfer.engine.request import SamplingParams

    greedy = SamplingParams(temperature=0.0)
    prompt = [1, 300, 301, 302, 303, 304, 310, 299, 320, 305]

    def logits(runner) -> torch.Tensor:
        """Prompt logits, then 4 teacher-forced decode steps (the decode route: gemv, graphs)."""
        out = [runner.forward_logits(prompt)]
        work = [SequenceWork(seq_id=1, token_ids=prompt, start_pos=0, block_table=[0, 1], sample=True,
                             sampling=greedy, output_token_ids=[])]
        runner.batch_logits(ScheduledBatch(work))
        for step, tok in enumerate([7, 300, 42, 301]):
            out.append(runner.batch_logits(ScheduledBatch([SequenceWork(
                seq_id=1, token_ids=[tok], start_pos=len(prompt) + step, block_table=[0, 1], sample=True,
                sampling=greedy, output_token_ids=[])])))
        return torch.cat(out)

    for mix, spec in MIXES.items():
        src = write_tiny_gguf(tmp_path / f"tiny.{mix}.gguf", tied=mix != "q4_k_m", **TINY, **spec)
        artifact = Artifact.open(resolve_model(str(src.path), tmp_path / "cache", announce=False))
        kinds = {f.format for f in artifact.meta.tensor_formats.values()}
        assert kinds >= ({"q4_k", "q6_k", "q5_0", "q5_1"} if mix == "q4_k_m" else
                         {"q5_k", "q6_k", "q2_k", "q3_k", "iq4_nl", "iq4_xs"})
        truth = logits(TorchModelRunner(artifact, num_pages=8, page_size=16, device=DEV, dtype=F32))
        fp32 = logits(CudaModelRunner(artifact, num_pages=8, page_size=16, device=DEV, dtype=F32))
        assert rel(fp32, truth) < 1e-4, mix
        bf16 = logits(CudaModelRunner(artifact, num_pages=8, page_size=16, device=DEV, dtype=BF))
        ref = logits(TorchModelRunner(artifact, num_pages=8, page_size=16, device=DEV))
        check(f"tiny {mix}", bf16, ref, truth)


@pytest.mark.parametrize("weights", ["q4_k", "q4_k_m"])
def test_llama_8b_kquant_matches_torch_backend(weights: str) -> None:
    """Synthetic llama-8b with Q4_K (and the Q4_K_M mix: q6_k v/down/lm_head segments) through the
    cuda runner: as close to the fp32 torch runner as the bf16 torch runner is (test_cuda_runner's
    criterion, prompt 512 and 64 teacher-forced decode steps)."""
    import test_cuda_runner as T
    from ninfer.engine.synthetic import SyntheticArtifact

    artifact = T.SharedWeights(SyntheticArtifact("llama-8b", weights, seed=1))
    g = torch.Generator().manual_seed(7)
    prompt = torch.randint(0, artifact.meta.config.vocab_size, (T.PROMPT,), generator=g).tolist()
    T.check_against_torch(f"llama-8b {weights}", artifact, prompt, list(range(-(-(T.PROMPT + T.STEPS) // T.PAGE))))
