"""Compressed KV caches on the cuda backend (--kv-dtype int8|fp8): kv_quantize_write against the
torch reference quantizer on fresh random rows, paged attention reading the int8 / e4m3 codes
directly against fp64 attention over the dequantized cache (decode with split-K, and prefill),
gemma3's sliding window and score soft-capping over the codes (decode and prefill), and greedy
agreement of the real default model with an int8 / fp8 cache against its bf16 cache."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import ninfer.kernels.launchers as L
from ninfer.kernels.compiler import KernelCompiler
from test_architectures_cuda import ref_window_attention
from test_kernels import BF, DEV, gen, make_cache, poisoned, randn, ref_attention, rel

CODES = pytest.mark.parametrize("codes", [torch.int8, torch.float8_e4m3fn], ids=["int8", "fp8"])
QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}
TINY = torch.finfo(torch.float16).tiny


def ref_quantize(x: torch.Tensor, codes: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, H, D] -> (codes [T, H, D], f16 scales [T, H]), as the torch backend's int8_quantize
    (and the same rule with e4m3 for fp8)."""
    x = x.float()
    scale = (x.abs().amax(-1) / QMAX[codes]).clamp_min(TINY).to(torch.float16)
    y = x / scale.float()[..., None]
    if codes == torch.int8:
        return torch.round(y).clamp(-127, 127).to(torch.int8), scale
    return y.clamp(-448, 448).to(torch.float8_e4m3fn), scale


def dequantize(cache: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return cache.float() * scale.float()[..., None]


def quantized_cache(kc: KernelCompiler, g: torch.Generator, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    codes: torch.dtype):
    """Write every slot of bf16 caches through kv_quantize_write -> codes and scales."""
    pages, ps, Hkv, D = k_cache.shape
    T = pages * ps
    kq = torch.zeros(k_cache.shape, dtype=codes, device=DEV)
    vq = torch.zeros(k_cache.shape, dtype=codes, device=DEV)
    ks = torch.zeros(k_cache.shape[:3], dtype=torch.float16, device=DEV)
    vs = torch.zeros(k_cache.shape[:3], dtype=torch.float16, device=DEV)
    slots = torch.arange(T, dtype=torch.int32, device=DEV)
    L.kv_quantize_write(kc, k_cache.view(T, Hkv, D).contiguous(), v_cache.view(T, Hkv, D).contiguous(), slots,
                        kq, vq, ks, vs)
    return kq, vq, ks, vs


@CODES
def test_kv_quantize_write_matches_the_reference(kc: KernelCompiler, codes: torch.dtype) -> None:
    g = gen(11)
    T, Hkv, D, pages, ps = 37, 4, 128, 12, 16
    k = randn((T, Hkv, D), g, BF, scale=3.0)
    v = randn((T, Hkv, D), g, BF, scale=0.01)
    k[5] = 0  # an all-zero row takes the smallest scale
    slots = torch.randperm(pages * ps, generator=g, device=DEV)[:T].to(torch.int32)
    slots[7] = -1  # padding: not written
    kq = torch.zeros((pages, ps, Hkv, D), dtype=codes, device=DEV)
    vq = kq.clone()
    ks = torch.zeros((pages, ps, Hkv), dtype=torch.float16, device=DEV)
    vs = ks.clone()
    L.kv_quantize_write(kc, k, v, slots, kq, vq, ks, vs)
    torch.cuda.synchronize()
    for rows, cache, scales in ((k, kq, ks), (v, vq, vs)):
        want_codes, want_scale = ref_quantize(rows, codes)
        flat, flat_s = cache.view(-1, Hkv, D), scales.view(-1, Hkv)
        written = slots >= 0
        got = flat[slots[written].long()]
        assert torch.equal(flat_s[slots[written].long()], want_scale[written])
        diff = (got.float() - want_codes[written].float()).abs()
        assert (diff == 0).float().mean().item() > 0.999 and diff.max().item() <= (1 if codes == torch.int8 else 32)
    untouched = torch.ones(pages * ps, dtype=torch.bool, device=DEV)
    untouched[slots[slots >= 0].long()] = False
    assert (ks.view(-1, Hkv)[untouched] == 0).all()


@CODES
@pytest.mark.parametrize("D,Hq,Hkv", [(64, 9, 3), (128, 32, 8), (256, 8, 1)])
def test_decode_attention_reads_the_codes(kc: KernelCompiler, codes: torch.dtype, D: int, Hq: int, Hkv: int) -> None:
    g = gen(12)
    lens = [1, 17, 600, 1500, 513]
    k_cache, v_cache, tables = make_cache(g, lens, Hkv, D, 16, BF)
    kq, vq, ks, vs = quantized_cache(kc, g, k_cache, v_cache, codes)
    kd, vd = dequantize(kq, ks), dequantize(vq, vs)
    q = randn((len(lens), Hq, D), g, BF)
    ctx = torch.tensor(lens, dtype=torch.int32, device=DEV)
    out = poisoned((len(lens), Hq, D), BF)
    L.paged_attention_decode(kc, q, kq, vq, tables, ctx, max(lens), out, D ** -0.5, k_scale=ks, v_scale=vs)
    for b, n in enumerate(lens):
        ref = ref_attention(q[b], kd, vd, tables[b], n, D ** -0.5)  # the dequantized cache, fp64
        assert rel(out[b], ref) < 1e-2, f"sequence {b}"
        # and the compressed cache stays close to the bf16 one it came from
        assert rel(out[b], ref_attention(q[b], k_cache, v_cache, tables[b], n, D ** -0.5)) < (3e-2 if codes == torch.int8 else 8e-2)


@CODES
def test_prefill_attention_reads_the_codes(kc: KernelCompiler, codes: torch.dtype) -> None:
    g = gen(13)
    D, Hq, Hkv = 128, 16, 4
    start, new = [0, 100, 5], [37, 20, 1]
    lens = [s + n for s, n in zip(start, new)]
    k_cache, v_cache, tables = make_cache(g, lens, Hkv, D, 16, BF)
    kq, vq, ks, vs = quantized_cache(kc, g, k_cache, v_cache, codes)
    kd, vd = dequantize(kq, ks), dequantize(vq, vs)
    T = sum(new)
    q = randn((T, Hq, D), g, BF)
    cu = torch.tensor([0, 37, 57, 58], dtype=torch.int32, device=DEV)
    sp = torch.tensor(start, dtype=torch.int32, device=DEV)
    out = poisoned((T, Hq, D), BF)
    L.paged_attention_prefill(kc, q, kq, vq, tables, cu, sp, max(lens), out, D ** -0.5, k_scale=ks, v_scale=vs)
    t = 0
    for b in range(3):
        for i in range(new[b]):
            assert rel(out[t], ref_attention(q[t], kd, vd, tables[b], start[b] + i + 1, D ** -0.5)) < 1e-2
            t += 1


@CODES
@pytest.mark.parametrize("window,softcap", [(700, 0.0), (5, 0.0), (0, 2.0), (300, 1.5)])
def test_window_and_softcap_over_the_codes(kc: KernelCompiler, codes: torch.dtype, window: int,
                                           softcap: float) -> None:
    """gemma3 / Mistral layers over a compressed cache: decode (split-K across the window's
    partitions) and prefill (after a prefix) against fp64 over the dequantized cache."""
    g = gen(15)
    D, Hq, Hkv = 64, 8, 2
    lens = [1, 17, 600, 1500, 513, 1100]
    k_cache, v_cache, tables = make_cache(g, lens, Hkv, D, 16, BF)
    kq, vq, ks, vs = quantized_cache(kc, g, k_cache, v_cache, codes)
    kd, vd = dequantize(kq, ks), dequantize(vq, vs)
    q = randn((len(lens), Hq, D), g, BF, scale=3.0)
    ctx = torch.tensor(lens, dtype=torch.int32, device=DEV)
    out = poisoned((len(lens), Hq, D), BF)
    L.paged_attention_decode(kc, q, kq, vq, tables, ctx, max(lens), out, 0.1, window=window, softcap=softcap,
                             k_scale=ks, v_scale=vs)
    for b, n in enumerate(lens):
        ref = ref_window_attention(q[b], kd, vd, tables[b], n, 0.1, window, softcap)
        assert rel(out[b], ref) < 1e-2, f"sequence {b}"
    start, new = [0, 100, 5], [37, 20, 1]
    lens = [s + n for s, n in zip(start, new)]
    k_cache, v_cache, tables = make_cache(g, lens, Hkv, D, 16, BF)
    kq, vq, ks, vs = quantized_cache(kc, g, k_cache, v_cache, codes)
    kd, vd = dequantize(kq, ks), dequantize(vq, vs)
    T = sum(new)
    q = randn((T, Hq, D), g, BF, scale=3.0)
    cu = torch.tensor([0, 37, 57, 58], dtype=torch.int32, device=DEV)
    sp = torch.tensor(start, dtype=torch.int32, device=DEV)
    out = poisoned((T, Hq, D), BF)
    L.paged_attention_prefill(kc, q, kq, vq, tables, cu, sp, max(lens), out, 0.125, window=window, softcap=softcap,
                              k_scale=ks, v_scale=vs)
    t = 0
    for b in range(3):
        for i in range(new[b]):
            ref = ref_window_attention(q[t], kd, vd, tables[b], start[b] + i + 1, 0.125, window, softcap)
            assert rel(out[t], ref) < 1e-2, f"sequence {b} token {i}"
            t += 1


def test_the_mma_prefill_route_refuses_a_compressed_cache(kc: KernelCompiler) -> None:
    from ninfer.kernels.compiler import KernelError

    g = gen(16)
    k_cache, v_cache, tables = make_cache(g, [20], 2, 64, 16, BF)
    kq, vq, ks, vs = quantized_cache(kc, g, k_cache, v_cache, torch.int8)
    q = randn((20, 2, 64), g, BF)
    cu = torch.tensor([0, 20], dtype=torch.int32, device=DEV)
    sp = torch.tensor([0], dtype=torch.int32, device=DEV)
    with pytest.raises(KernelError, match="warp route"):
        L.paged_attention_prefill(kc, q, kq, vq, tables, cu, sp, 20, poisoned((20, 2, 64)), 0.125, "mma",
                                  k_scale=ks, v_scale=vs)


def test_a_compressed_cache_needs_its_scales(kc: KernelCompiler) -> None:
    from ninfer.kernels.compiler import KernelError

    g = gen(14)
    k_cache, v_cache, tables = make_cache(g, [20], 2, 64, 16, BF)
    kq = torch.zeros(k_cache.shape, dtype=torch.int8, device=DEV)
    q = randn((1, 2, 64), g, BF)
    with pytest.raises(KernelError, match="k_scale"):
        L.paged_attention_decode(kc, q, kq, kq, tables, torch.tensor([20], dtype=torch.int32, device=DEV), 20,
                                 poisoned((1, 2, 64)), 0.125)


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
def test_greedy_agreement_with_the_bf16_cache(kv_dtype: str, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    """64 greedy steps of the default model (teacher-forced on the bf16 run's tokens): the argmax
    agrees at nearly every step and max |Δlogit| stays small. Prints both for docs/PERF.md."""
    from ninfer.engine.artifact import Artifact
    from ninfer.engine.backends.cuda_runner import CudaModelRunner
    from ninfer.engine.batch import ScheduledBatch, SequenceWork
    from ninfer.engine.request import SamplingParams

    path = os.environ.get("NINFER_TEST_ARTIFACT")
    artifact = Artifact.open(Path(path) if path else request.getfixturevalue("smollm2_artifact"))
    prompt = [(i * 7919) % 40000 + 10 for i in range(300)]

    def run(runner, forced):
        pages = list(range(8))
        rows, fed = [], []
        w = SequenceWork(seq_id=0, token_ids=prompt, start_pos=0, block_table=pages, sample=True,
                         sampling=SamplingParams(temperature=0.0))
        rows.append(runner.batch_logits(ScheduledBatch([w]))[0].float())
        for i in range(64):
            t = forced[i] if forced is not None else int(rows[-1].argmax())
            fed.append(t)
            w = SequenceWork(seq_id=0, token_ids=[t], start_pos=len(prompt) + i, block_table=pages, sample=True,
                             sampling=SamplingParams(temperature=0.0), output_token_ids=fed[:])
            rows.append(runner.batch_logits(ScheduledBatch([w]))[0].float())
        return rows, fed

    kw = dict(num_pages=8, page_size=64, device="cuda:0", cuda_graph=False, kernel_cache_dir=tmp_path)
    ref, forced = run(CudaModelRunner(artifact, **kw), None)
    ours, _ = run(CudaModelRunner(artifact, kv_dtype=kv_dtype, **kw), forced)
    delta = max((a - b).abs().max().item() for a, b in zip(ref, ours))
    agree = sum(int(a.argmax() == b.argmax()) for a, b in zip(ref, ours)) / len(ref)
    print(f"kv_dtype={kv_dtype}: max|dlogit|={delta:.4f} greedy agreement={agree:.3f} over {len(ref)} steps")
    assert agree >= 0.9 and delta < 3.0


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
def test_lookup_verify_rows_over_the_codes_are_plain_greedy_bit_for_bit(kv_dtype: str, smollm2_artifact) -> None:
    """--spec lookup over a compressed cache: verify rows quantize their K/V into the pages like
    decode rows and read the same codes, so committed tokens equal plain greedy's with the same
    cache bit for bit (default model, CUDA graphs per verify width)."""
    from test_speculative_cuda import K, generate

    from ninfer.engine.artifact import Artifact
    from ninfer.engine.backends.cuda_runner import CudaModelRunner
    from ninfer.engine.config import SpecConfig
    from ninfer.engine.tokenizer import Tokenizer

    artifact = Artifact.open(smollm2_artifact)
    tokenizer = Tokenizer.from_metadata(artifact.meta)
    texts = ["Repeat exactly: the cat sat on the mat, the cat sat on the mat, the cat sat on the mat.",
             "List the numbers from 1 to 25, separated by commas."]
    prompts = [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": t}])) for t in texts]
    runner = CudaModelRunner(artifact, num_pages=64, page_size=64, device="cuda", max_draft_tokens=K,
                             kv_dtype=kv_dtype)
    assert runner.k_cache[0].dtype == {"int8": torch.int8, "fp8": torch.float8_e4m3fn}[kv_dtype]
    plain, _ = generate(runner, tokenizer, prompts, None)
    spec, snap = generate(runner, tokenizer, prompts, SpecConfig("lookup", draft_tokens=K, ngram_min=1, ngram_max=3))
    assert spec == plain
    assert snap.drafted_tokens > 0 and snap.accepted_tokens > 0


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
def test_gemma3_over_the_codes_matches_the_torch_backend_closely(kv_dtype: str) -> None:
    """A tiny gemma3 (sliding layers, two RoPE bases, score and final soft-capping), fp32 compute:
    the cuda backend over an int8 / e4m3 cache stays close to the torch backend over an fp32
    cache and, with int8, equal within rounding to the torch backend over its own int8 cache (the
    same quantization rule on the same K/V: codes differ at most at rounding ties)."""
    from test_architectures_cuda import PAGE, _hf_artifact, _perturb, tiny_models

    from ninfer.engine.backends.cuda_runner import CudaModelRunner
    from ninfer.engine.backends.torch_runner import TorchModelRunner

    transformers = pytest.importorskip("transformers")
    torch.manual_seed(6)
    hf = transformers.AutoModelForCausalLM.from_config(tiny_models()["gemma3"]).float().eval()
    _perturb(hf)
    _, artifact = _hf_artifact(hf)
    artifact.meta.config.attn_logit_softcapping = 0.5
    prompt = torch.randint(0, 512, (90,), generator=torch.Generator().manual_seed(2)).tolist()
    ours = CudaModelRunner(artifact, num_pages=64, page_size=PAGE, device="cuda", dtype=torch.float32,
                           kv_dtype=kv_dtype).forward_logits(prompt)
    ref = TorchModelRunner(artifact, num_pages=64, page_size=PAGE, device="cuda",
                           dtype=torch.float32).forward_logits(prompt)
    err = ((ours - ref).norm(dim=-1) / ref.norm(dim=-1)).max().item()
    assert err < (3e-2 if kv_dtype == "int8" else 8e-2), err
    assert (ours.argmax(-1) == ref.argmax(-1)).float().mean().item() >= 0.9
    if kv_dtype == "int8":
        same = TorchModelRunner(artifact, num_pages=64, page_size=PAGE, device="cuda", dtype=torch.float32,
                                kv_dtype="int8").forward_logits(prompt)
        assert ((ours - same).norm(dim=-1) / same.norm(dim=-1)).max().item() < 1e-3
