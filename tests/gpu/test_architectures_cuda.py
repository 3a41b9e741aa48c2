"""qwen2, Mistral-style llama and gemma3, and every RoPE scaling, on the cuda backend.

Kernels: paged attention with a sliding window and score soft-capping (decode with split-K across
the window's partitions, prefill with prefix hits) against an fp64 reference, batch-invariant; the
geglu MLP kernel against torch. Models: tiny random-weight transformers models of shapes the kernels
take (head_dim 64), fp32: logits against transformers, greedy tokens identical through CUDA-graph
decode, chunked prefill past the window and batches equal to one-shot; gemma3's attention
soft-capping (which transformers' Gemma 3 does not apply) against our torch backend. RoPE: tiny
llamas with linear, llama3, yarn and the spec's interpolation, 300-token prompts past the original
context, against transformers (interpolation: against the torch backend).
"""
from __future__ import annotations

import types

import pytest
import torch

from ninfer.engine.batch import ScheduledBatch, SequenceWork
from ninfer.engine.config import ModelConfig
from ninfer.engine.request import SamplingParams
from ninfer.formats import TensorFormat
from ninfer.kernels import launchers as L
from test_kernels import ACTS, BF, DEV, TOL, gen, make_cache, poisoned, randn, rel

transformers = pytest.importorskip("transformers")
PAGE = 16
GREEDY = SamplingParams(temperature=0.0)


# ---------------------------------------------------------------- kernels

def ref_window_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, table: torch.Tensor,
                         n_keys: int, scale: float, window: int, softcap: float) -> torch.Tensor:
    """q [Hq, D] of one token at position n_keys - 1, keys max(0, n_keys - window)..n_keys - 1; fp64."""
    page_size, Hkv, D = k_cache.shape[1:]
    first = max(0, n_keys - window) if window else 0
    pos = torch.arange(first, n_keys, device=DEV)
    slot = table.long()[pos // page_size] * page_size + pos % page_size
    k = k_cache.view(-1, Hkv, D)[slot].double()
    v = v_cache.view(-1, Hkv, D)[slot].double()
    G = q.shape[0] // Hkv
    s = torch.einsum("hgd,nhd->hgn", q.double().view(Hkv, G, D), k) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    return torch.einsum("hgn,nhd->hgd", s.softmax(-1), v).reshape(-1, D)


@pytest.mark.parametrize("window,softcap", [(700, 0.0), (5, 0.0), (0, 2.0), (300, 1.5)])
@pytest.mark.parametrize("D,Hq,Hkv", [(64, 8, 2), (256, 8, 4)])
@ACTS
def test_paged_attention_decode_window_softcap(kc, D: int, Hq: int, Hkv: int, window: int, softcap: float,
                                               act: torch.dtype) -> None:
    g = gen(20)
    lens = [1, 17, 600, 1500, 513, 1100]  # windows that start inside, at and before partition bounds
    k_cache, v_cache, tables = make_cache(g, lens, Hkv, D, 16, act)
    q = randn((len(lens), Hq, D), g, act, scale=3.0)  # large scores, so capping matters
    ctx = torch.tensor(lens, dtype=torch.int32, device=DEV)
    out = poisoned((len(lens), Hq, D), act)
    scale = 0.1
    L.paged_attention_decode(kc, q, k_cache, v_cache, tables, ctx, max(lens), out, scale, window=window, softcap=softcap)
    for b, n in enumerate(lens):
        ref = ref_window_attention(q[b], k_cache, v_cache, tables[b], n, scale, window, softcap)
        assert rel(out[b], ref) < TOL[act], f"sequence {b}"
    # batch invariance: the long sequence alone gives the same bits
    one = poisoned((1, Hq, D), act)
    L.paged_attention_decode(kc, q[3:4], k_cache, v_cache, tables[3:4], ctx[3:4], lens[3], one, scale,
                             window=window, softcap=softcap)
    assert torch.equal(one[0], out[3])


@pytest.mark.parametrize("window,softcap", [(6, 0.0), (50, 3.0)])
@ACTS
def test_paged_attention_prefill_window_softcap(kc, window: int, softcap: float, act: torch.dtype) -> None:
    g = gen(21)
    D, Hq, Hkv = 64, 8, 2
    start, new = [0, 100, 5], [37, 20, 1]
    lens = [s + n for s, n in zip(start, new)]
    k_cache, v_cache, tables = make_cache(g, lens, Hkv, D, 16, act)
    T = sum(new)
    q = randn((T, Hq, D), g, act, scale=3.0)
    cu = torch.tensor([0, 37, 57, 58], dtype=torch.int32, device=DEV)
    sp = torch.tensor(start, dtype=torch.int32, device=DEV)
    out = poisoned((T, Hq, D), act)
    L.paged_attention_prefill(kc, q, k_cache, v_cache, tables, cu, sp, max(lens), out, 0.125, window=window,
                              softcap=softcap)
    t = 0
    for b in range(3):
        for i in range(new[b]):
            ref = ref_window_attention(q[t], k_cache, v_cache, tables[b], start[b] + i + 1, 0.125, window, softcap)
            assert rel(out[t], ref) < TOL[act], f"sequence {b} token {i}"
            t += 1


@ACTS
def test_geglu(kc, act: torch.dtype) -> None:
    g = gen(22)
    T, inter = 37, 1024
    gate_up = randn((T, 2 * inter), g, act, scale=2.0)
    out = poisoned((T, inter), act)
    L.geglu(kc, gate_up, out)
    x = gate_up.double()
    ref = torch.nn.functional.gelu(x[:, :inter], approximate="tanh") * x[:, inter:]
    assert rel(out, ref) < TOL[act]


# ---------------------------------------------------------------- models

def _hf_artifact(hf):
    """transformers model -> (same model on cuda, an artifact-like object over its fp32 weights)."""
    sd = {k: v.detach().clone().cuda() for k, v in hf.state_dict().items()
          if not (k == "lm_head.weight" and hf.config.tie_word_embeddings)}
    raw = hf.config.to_dict() | {"architectures": [type(hf).__name__]}
    config = ModelConfig.from_hf(raw)
    meta = types.SimpleNamespace(config=config, tensor_formats={k: TensorFormat("f32") for k in sd})
    artifact = types.SimpleNamespace(meta=meta, path="tiny",
                                     load_parts=lambda device: {k: {"": v.to(device)} for k, v in sd.items()},
                                     load_dequantized=lambda: {k: v.cpu() for k, v in sd.items()})
    return hf.cuda(), artifact


COMMON = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
              head_dim=64, rms_norm_eps=1e-6)


def tiny_models() -> dict[str, object]:
    return {
        "qwen2": transformers.Qwen2Config(**COMMON, num_hidden_layers=3, tie_word_embeddings=True,
                                          max_position_embeddings=1024, use_sliding_window=True, sliding_window=24,
                                          max_window_layers=1,
                                          rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                                           "original_max_position_embeddings": 64}),
        "mistral": transformers.MistralConfig(**COMMON, num_hidden_layers=2, max_position_embeddings=1024,
                                              sliding_window=40),
        "gemma3": transformers.Gemma3TextConfig(
            **COMMON, num_hidden_layers=4, max_position_embeddings=1024, sliding_window=20,
            layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
            query_pre_attn_scalar=48, final_logit_softcapping=5.0,
            rope_parameters={"full_attention": {"rope_type": "linear", "rope_theta": 100000.0, "factor": 4.0},
                             "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}),
    }


def _perturb(hf) -> None:
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith(".bias"):
                p.uniform_(-0.5, 0.5)
            elif name.endswith("norm.weight"):
                p.uniform_(-0.3, 0.3) if "gemma" in hf.config.model_type else p.uniform_(0.5, 1.5)


def work(tokens: list[int], start: int, pages: list[int], generated: list[int] | None = None,
         seq_id: int = 1) -> SequenceWork:
    return SequenceWork(seq_id=seq_id, token_ids=tokens, start_pos=start, block_table=pages, sample=True,
                        sampling=GREEDY, output_token_ids=list(generated or []), state_slot=seq_id)


def greedy(runner, prompt: list[int], steps: int) -> list[int]:
    pages = list(range(-(-(len(prompt) + steps) // PAGE)))
    out = runner.run(ScheduledBatch([work(prompt, 0, pages)]))
    tokens = [out.sampled[1]]
    while len(tokens) < steps:
        out = runner.run(ScheduledBatch([work([tokens[-1]], len(prompt) + len(tokens) - 1, pages, tokens)]))
        tokens.append(out.sampled[1])
    return tokens


def check_model(hf, artifact, prompt_len: int = 100, steps: int = 32) -> None:
    from ninfer.engine.backends.cuda_runner import CudaModelRunner

    runner = CudaModelRunner(artifact, num_pages=128, page_size=PAGE, device="cuda", dtype=torch.float32,
                             num_state_slots=4)
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, 512, (prompt_len,), generator=g).tolist()
    ours = runner.forward_logits(prompt)
    with torch.no_grad():
        ref = hf(torch.tensor([prompt], device="cuda")).logits[0]
    err = ((ours - ref).norm(dim=-1) / ref.norm(dim=-1)).max().item()
    assert err < 1e-4, err
    with torch.no_grad():
        hf.generation_config.eos_token_id = None
        ref_ids = hf.generate(torch.tensor([prompt], device="cuda"), max_new_tokens=steps, do_sample=False,
                              pad_token_id=0)[0, len(prompt):].tolist()
    assert greedy(runner, prompt, steps) == ref_ids
    assert runner.graphs.captures >= 1
    # chunked prefill past the window and a batch of different lengths equal one-shot
    n = len(prompt)
    per = -(-n // PAGE)
    pages = list(range(per))
    for start, end in ((0, n // 3), (n // 3, 2 * n // 3 + 1), (2 * n // 3 + 1, n)):
        logits = runner.batch_logits(ScheduledBatch([work(prompt[start:end], start, pages)]))
    assert torch.allclose(logits[0], ours[-1], atol=2e-4, rtol=0)
    short = prompt[:9]
    seqs = [work(prompt, 0, list(range(per, 2 * per)), seq_id=0), work(short, 0, [2 * per], seq_id=1)]
    logits = runner.batch_logits(ScheduledBatch(seqs))
    assert torch.allclose(logits[0], ours[-1], atol=2e-4, rtol=0)
    assert torch.allclose(logits[1], runner.forward_logits(short)[-1], atol=2e-4, rtol=0)


@pytest.fixture
def fp32_reference():
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    yield
    torch.set_float32_matmul_precision(previous)


@pytest.mark.parametrize("name", ["qwen2", "mistral", "gemma3"])
def test_architecture_matches_transformers(name: str, fp32_reference) -> None:
    torch.manual_seed(5)
    cfg = tiny_models()[name]
    cfg._attn_implementation = "eager"
    hf = transformers.AutoModelForCausalLM.from_config(cfg).float().eval()
    _perturb(hf)
    check_model(*_hf_artifact(hf))


def test_gemma3_attention_softcap_matches_torch_backend(fp32_reference) -> None:
    """Score soft-capping (Gemma 2 style; transformers' Gemma 3 ignores it) against our torch ops."""
    from ninfer.engine.backends.cuda_runner import CudaModelRunner
    from ninfer.engine.backends.torch_runner import TorchModelRunner

    torch.manual_seed(6)
    hf = transformers.AutoModelForCausalLM.from_config(tiny_models()["gemma3"]).float().eval()
    _perturb(hf)
    _, artifact = _hf_artifact(hf)
    artifact.meta.config.attn_logit_softcapping = 0.5  # small, so it changes the scores a lot
    prompt = torch.randint(0, 512, (90,), generator=torch.Generator().manual_seed(2)).tolist()
    ours = CudaModelRunner(artifact, num_pages=64, page_size=PAGE, device="cuda", dtype=torch.float32)
    ref = TorchModelRunner(artifact, num_pages=64, page_size=PAGE, device="cuda", dtype=torch.float32)
    a, b = ours.forward_logits(prompt), ref.forward_logits(prompt)
    assert ((a - b).norm(dim=-1) / b.norm(dim=-1)).max().item() < 1e-4
    assert greedy(ours, prompt, 16) == greedy(ref, prompt, 16)


ROPES = [
    {"rope_type": "linear", "factor": 4.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 64},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64, "mscale": 1.0,
     "mscale_all_dim": 0.5, "beta_fast": 16},
]


@pytest.mark.parametrize("scaling", ROPES, ids=lambda s: s["rope_type"] + str(s["factor"]))
def test_rope_scaling_matches_transformers(scaling: dict, fp32_reference) -> None:
    torch.manual_seed(7)
    cfg = transformers.LlamaConfig(**COMMON, num_hidden_layers=2, max_position_embeddings=1024,
                                   rope_parameters={"rope_theta": 10000.0, **scaling})
    hf = transformers.LlamaForCausalLM(cfg).float().eval()
    check_model(*_hf_artifact(hf), prompt_len=300, steps=16)


def test_rope_interpolation_matches_torch_backend(fp32_reference) -> None:
    """--rope-scaling-factor: the cuda tables against the torch backend's over positions past the threshold."""
    from ninfer.engine.backends.cuda_runner import CudaModelRunner
    from ninfer.engine.backends.torch_runner import TorchModelRunner
    from ninfer.engine.rope import RopeOverride

    torch.manual_seed(8)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**COMMON, num_hidden_layers=2,
                                                                max_position_embeddings=128)).float().eval()
    _, artifact = _hf_artifact(hf)
    plain = artifact.meta.config
    artifact.meta.config = RopeOverride(scaling_factor=4.0, original_context=64).apply(plain, 400)
    prompt = torch.randint(0, 512, (400,), generator=torch.Generator().manual_seed(3)).tolist()
    ours = CudaModelRunner(artifact, num_pages=64, page_size=PAGE, device="cuda", dtype=torch.float32)
    ref = TorchModelRunner(artifact, num_pages=64, page_size=PAGE, device="cuda", dtype=torch.float32)
    a, b = ours.forward_logits(prompt), ref.forward_logits(prompt)
    assert ((a - b).norm(dim=-1) / b.norm(dim=-1)).max().item() < 1e-4
    assert greedy(ours, prompt, 16) == greedy(ref, prompt, 16)
    # positions up to the threshold rotate as plain RoPE: the first 64 logits are the plain model's
    artifact.meta.config = plain
    first = TorchModelRunner(artifact, num_pages=64, page_size=PAGE, device="cuda", dtype=torch.float32)
    assert torch.allclose(first.forward_logits(prompt[:64]), b[:64], atol=1e-5, rtol=0)


# ---------------------------------------------------------------- every architecture x weight format

TINY = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
            head_dim=64, max_position_embeddings=1024)
# each architecture's synthetic shape, shrunk to what the kernels take; windows a few pages long
TINY_SHAPES = {
    "llama": ("smollm2-135m", dict(num_hidden_layers=2)),
    "mistral": ("mistral-7b", dict(num_hidden_layers=2, sliding_window=24, layer_types=["sliding_attention"] * 2)),
    "qwen2": ("qwen2.5-7b", dict(num_hidden_layers=2)),
    "qwen3": ("qwen3-8b", dict(num_hidden_layers=2)),
    "qwen3_5": ("qwen3.5-0.8b", dict(num_hidden_layers=4, layer_types=["linear_attention", "full_attention"] * 2,
                                     linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=64,
                                     linear_value_head_dim=64)),
    "gemma3": ("gemma3-4b", dict(num_hidden_layers=3, sliding_window=20,
                                 layer_types=["sliding_attention", "full_attention", "sliding_attention"])),
}


@pytest.mark.parametrize("weights", ["f32", "bf16", "int8", "int4"])
@pytest.mark.parametrize("arch", list(TINY_SHAPES))
def test_every_architecture_and_weight_format_matches_torch_backend(arch: str, weights: str, monkeypatch) -> None:
    """The cuda runner (fp32 activations; quantized weights read by the gemv kernel in decode) against
    the torch runner in fp32 on the same stored weights: prompt logits, and 16 greedy tokens."""
    from ninfer.engine.backends.cuda_runner import CudaModelRunner
    from ninfer.engine.backends.torch_runner import TorchModelRunner
    from ninfer.engine.synthetic import SHAPES, SyntheticArtifact

    base, extra = TINY_SHAPES[arch]
    monkeypatch.setitem(SHAPES, "tiny", dict(SHAPES[base], **TINY, **extra))
    artifact = SyntheticArtifact("tiny", weights, seed=4)
    assert artifact.meta.config.architecture == ("llama" if arch == "mistral" else arch)
    prompt = torch.randint(0, 512, (100,), generator=torch.Generator().manual_seed(4)).tolist()
    ours = CudaModelRunner(artifact, num_pages=64, page_size=PAGE, device="cuda", dtype=torch.float32,
                           num_state_slots=4)
    ref = TorchModelRunner(artifact, num_pages=64, page_size=PAGE, device="cuda", dtype=torch.float32,
                           num_state_slots=4)
    a, b = ours.forward_logits(prompt), ref.forward_logits(prompt)
    assert ((a - b).norm(dim=-1) / b.norm(dim=-1)).max().item() < 1e-4
    assert greedy(ours, prompt, 16) == greedy(ref, prompt, 16)


def test_bf16_window_layers_take_the_warp_route_beside_mma(monkeypatch) -> None:
    """bf16 with head_dim 64: full-attention layers' prompt rows on the tensor-core kernel, the
    sliding-window layers' on the warp kernel (the mma route refuses a window): against the fp32
    torch backend within bf16 noise, and a chunked prefill equal to one shot."""
    from ninfer.engine.backends.cuda_runner import CudaModelRunner
    from ninfer.engine.backends.torch_runner import TorchModelRunner
    from ninfer.engine.synthetic import SHAPES, SyntheticArtifact
    from ninfer.kernels.compiler import KernelError

    monkeypatch.setitem(SHAPES, "tiny", dict(SHAPES["qwen2.5-7b"], **TINY, num_hidden_layers=4, sliding_window=24,
                                             layer_types=["full_attention", "sliding_attention"] * 2))
    artifact = SyntheticArtifact("tiny", "bf16", seed=9)
    ours = CudaModelRunner(artifact, num_pages=64, page_size=PAGE, device="cuda", dtype=torch.bfloat16)
    assert ours.ops.prefill_attention == "mma"
    prompt = torch.randint(0, 512, (150,), generator=torch.Generator().manual_seed(9)).tolist()
    a = ours.forward_logits(prompt).float()
    b = TorchModelRunner(artifact, num_pages=64, page_size=PAGE, device="cuda", dtype=torch.float32).forward_logits(prompt)
    assert ((a - b).norm(dim=-1) / b.norm(dim=-1)).max().item() < 0.05
    pages = list(range(10))
    for start, end in ((0, 64), (64, 128), (128, 150)):
        logits = ours.batch_logits(ScheduledBatch([work(prompt[start:end], start, pages)]))
    assert torch.equal(logits[0], ours.forward_logits(prompt)[-1])
    q = torch.zeros(4, 4, 64, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(KernelError, match="no sliding window"):
        L.paged_attention_prefill(ours.kc, q, ours.k_cache[0], ours.v_cache[0],
                                  torch.zeros(1, 1, dtype=torch.int32, device="cuda"),
                                  torch.tensor([0, 4], dtype=torch.int32, device="cuda"),
                                  torch.zeros(1, dtype=torch.int32, device="cuda"), 4, q.clone(), 0.125, "mma", window=8)
