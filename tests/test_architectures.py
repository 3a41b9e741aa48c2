"""qwen2, Mistral-style llama and gemma3 against transformers on tiny random-weight models, fp32:
from Hugging Face folders and from GGUF files written as llama.cpp's converter writes them.

Each tiny model exercises what its architecture adds: qwen2 q/k/v biases, a sliding window on its
upper layer (use_sliding_window, max_window_layers) and YaRN; Mistral a window on every layer and
linear RoPE scaling; gemma3 (1 + w) sandwich norms, the scaled embedding, sliding/global layers with
two RoPE bases (linear scaling on the global one), query_pre_attn_scalar and final logit
soft-capping (attention-score capping, which transformers' Gemma 3 does not apply, is checked
against a direct computation below). Windows are a few tokens so the prompts and greedy runs cross them.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from ninfer.engine.artifact import Artifact
from ninfer.engine.backends.torch_runner import TorchModelRunner
from ninfer.engine.config import ModelConfig
from torch_model_helpers import assert_greedy_agrees, hf_greedy, hf_logits, ours_greedy

transformers = pytest.importorskip("transformers")

F32_LOGIT_TOL = 1e-4
F32_NEAR_TIE = 2 * F32_LOGIT_TOL
PROMPT = [1, 504, 3458, 282, 4649, 314, 253, 1345, 30, 216, 11, 3012, 1183, 77, 9001, 12]
COMMON = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=2)


def tiny_configs() -> dict[str, object]:
    return {
        "qwen2": transformers.Qwen2Config(
            **COMMON, num_hidden_layers=2, tie_word_embeddings=True, max_position_embeddings=256,
            use_sliding_window=True, sliding_window=5, max_window_layers=1,
            rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                             "original_max_position_embeddings": 64}),
        "mistral": transformers.MistralConfig(
            **COMMON, num_hidden_layers=2, tie_word_embeddings=False, max_position_embeddings=512, sliding_window=6,
            rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}),
        "gemma3": transformers.Gemma3TextConfig(
            **COMMON, num_hidden_layers=4, tie_word_embeddings=True, max_position_embeddings=1024, sliding_window=4,
            layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
            query_pre_attn_scalar=24, final_logit_softcapping=3.0,
            rope_parameters={"full_attention": {"rope_type": "linear", "rope_theta": 100000.0, "factor": 8.0},
                             "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}),
    }


def _perturb(model) -> None:
    """Random init zeroes biases and gemma's (1 + w) norms and sets other norms to 1: move them so a
    missing bias or a missing / doubled 1 shows in a comparison."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.uniform_(-0.5, 0.5)
            elif name.endswith("norm.weight"):
                p.uniform_(-0.3, 0.3) if isinstance(model, transformers.Gemma3ForCausalLM) else p.uniform_(0.5, 1.5)


@pytest.fixture(scope="module")
def tiny(smollm2_hf_tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """name -> (HF folder, converted artifact, transformers model (eager attention))."""
    from ninfer.engine.convert import convert

    root = tmp_path_factory.mktemp("tiny_archs")
    out = {}
    for i, (name, cfg) in enumerate(tiny_configs().items()):
        torch.manual_seed(10 + i)
        cfg._attn_implementation = "eager"  # the one that applies soft-capping
        model = transformers.AutoModelForCausalLM.from_config(cfg).to(torch.float32)
        _perturb(model)
        folder = root / name
        model.save_pretrained(str(folder))
        for f in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(smollm2_hf_tokenizer_dir / f, folder / f)
        art = Artifact.open(convert(folder, root / f"{name}.ninfer", progress=False))
        out[name] = (folder, art, model.eval())
    return out


def check_against(runner: TorchModelRunner, hf, ids: list[int] = PROMPT, steps: int = 12) -> None:
    ours, ref = runner.forward_logits(ids), hf_logits(hf, ids)
    assert (ours - ref).abs().max().item() < F32_LOGIT_TOL
    (tokens,) = ours_greedy(runner, [ids], steps, [[5, 1, 7, 2]])
    assert_greedy_agrees(tokens, hf_greedy(hf, ids, steps), hf, ids, F32_NEAR_TIE)


@pytest.mark.parametrize("name", ["qwen2", "mistral", "gemma3"])
def test_hf_folder_matches_transformers(name: str, tiny) -> None:
    _, art, hf = tiny[name]
    check_against(TorchModelRunner(art, num_pages=8, page_size=8, dtype=torch.float32), hf)


def test_configs_read_what_each_architecture_adds(tiny) -> None:
    q, m, g = (tiny[n][1].meta.config for n in ("qwen2", "mistral", "gemma3"))
    assert q.architecture == "qwen2" and q.attention_bias
    assert q.layer_types == ["full_attention", "sliding_attention"] and q.sliding_window == 5
    assert q.rope_scaling["rope_type"] == "yarn"
    assert m.architecture == "llama" and m.layer_types == ["sliding_attention"] * 2 and m.sliding_window == 6
    assert g.architecture == "gemma3" and g.sliding_window == 4 and g.query_pre_attn_scalar == 24
    assert (g.rope_theta, g.rope_local_theta, g.rope_scaling["rope_type"]) == (100000.0, 10000.0, "linear")
    assert (g.attn_logit_softcapping, g.final_logit_softcapping) == (0.0, 3.0)


@pytest.mark.parametrize("name", ["qwen2", "gemma3"])
def test_features_are_exercised(name: str, tiny) -> None:
    """Dropping the window or the soft-capping changes the logits past the window: the tests see them."""
    _, art, hf = tiny[name]
    base = TorchModelRunner(art, num_pages=8, page_size=8, dtype=torch.float32).forward_logits(PROMPT)
    c = art.meta.config.to_dict()
    variants = [{"layer_types": None, "sliding_window": 0}]
    if name == "gemma3":
        variants += [{"attn_logit_softcapping": 1.0}, {"final_logit_softcapping": 0.0}, {"query_pre_attn_scalar": 0.0},
                     {"rope_local_theta": 0.0}]
    for change in variants:
        art.meta.config = ModelConfig(**{**c, **change})
        try:
            other = TorchModelRunner(art, num_pages=8, page_size=8, dtype=torch.float32).forward_logits(PROMPT)
        finally:
            art.meta.config = ModelConfig(**c)
        assert (other - base).abs().max().item() > 1e-3, change


@pytest.mark.parametrize("name", ["qwen2", "gemma3"])
def test_chunked_prefill_and_batches_equal_one_shot(name: str, tiny) -> None:
    """Chunks starting past the window, and sequences of different lengths in one batch."""
    from ninfer.engine.batch import ScheduledBatch, SequenceWork
    from torch_model_helpers import GREEDY

    _, art, _ = tiny[name]
    runner = TorchModelRunner(art, num_pages=16, page_size=4, dtype=torch.float32)
    whole = runner.forward_logits(PROMPT)
    table = [9, 3, 12, 0, 5, 7]
    rows = []
    for start, end in ((0, 3), (3, 11), (11, 16)):
        seq = SequenceWork(seq_id=0, token_ids=PROMPT[start:end], start_pos=start, block_table=table, sample=False,
                           sampling=GREEDY, output_token_ids=[])
        rows.append(runner.batch_logits(ScheduledBatch([seq]), all_rows=True))
    assert (torch.cat(rows) - whole).abs().max().item() < 1e-5
    short = PROMPT[:7]
    seqs = [SequenceWork(seq_id=i, token_ids=ids, start_pos=0, block_table=t, sample=False, sampling=GREEDY,
                         output_token_ids=[]) for i, (ids, t) in enumerate(((PROMPT, [1, 2, 3, 4]), (short, [8, 6])))]
    both = runner.batch_logits(ScheduledBatch(seqs), all_rows=True)
    assert (both[:len(PROMPT)] - whole).abs().max().item() < 1e-5
    assert (both[len(PROMPT):] - runner.forward_logits(short)).abs().max().item() < 1e-5


# ---- GGUF files as llama.cpp writes them -----------------------------------------------------------

def _gguf_keys(name: str, cfg: dict) -> dict:
    if name == "mistral":  # a llama file that declares a window, with linear scaling
        return {"rope.freq_base": 10000.0, "attention.sliding_window": 6, "rope.scaling.type": "linear",
                "rope.scaling.factor": 2.0}
    if name == "qwen2":  # llama.cpp's qwen2 converter writes no window: the file gives full attention
        return {"rope.freq_base": 10000.0, "rope.scaling.type": "yarn", "rope.scaling.factor": 4.0,
                "rope.scaling.original_context_length": 64}
    return {"rope.freq_base": 100000.0, "attention.sliding_window": 4, "rope.scaling.type": "linear",
            "rope.scaling.factor": 8.0, "final_logit_softcapping": 3.0}


def _hf_for_gguf(name: str, folder: Path, hf):
    """The reference for what a GGUF can say: qwen2 without its window (llama.cpp's converter drops
    it); gemma3 with llama.cpp's fixed layout (every sixth layer global, scale head_dim ** -0.5)."""
    cfg = json.loads((folder / "config.json").read_text())
    if name == "qwen2":
        cfg.update(use_sliding_window=False, layer_types=None)
    elif name == "gemma3":
        cfg.update(layer_types=None, sliding_window_pattern=6, query_pre_attn_scalar=16)
    else:
        return hf
    config = type(hf.config).from_dict(cfg)
    config._attn_implementation = "eager"
    model = type(hf)(config).to(torch.float32)
    model.load_state_dict(hf.state_dict())
    return model.eval()


@pytest.mark.parametrize("name", ["qwen2", "mistral", "gemma3"])
def test_gguf_file_matches_transformers(name: str, tiny, tmp_path: Path) -> None:
    from safetensors.numpy import load_file

    from gguf_arch_synth import write_arch_gguf
    from ninfer.engine.convert import convert

    folder, hf_art, hf = tiny[name]
    cfg = json.loads((folder / "config.json").read_text())
    tokenizer = json.loads((folder / "tokenizer.json").read_text())
    arch = "llama" if name == "mistral" else name
    path = tmp_path / f"tiny-{name}-F32.gguf"
    write_arch_gguf(path, arch, load_file(str(folder / "model.safetensors")), cfg, tokenizer, keys=_gguf_keys(name, cfg))
    art = Artifact.open(convert(path, tmp_path / f"{name}.ninfer", progress=False))
    c = art.meta.config
    assert c.architecture == hf_art.meta.config.architecture
    if name == "gemma3":
        assert c.layer_types == ["sliding_attention"] * 4 and c.rope_local_theta == 10000.0
    weights, want = art.load_dequantized(), hf_art.load_dequantized()
    assert set(weights) == set(want)
    for n, t in want.items():
        assert torch.allclose(weights[n], t, rtol=0, atol=1e-6), n  # norms: (1 + w) - 1
    check_against(TorchModelRunner(art, num_pages=8, page_size=8, dtype=torch.float32), _hf_for_gguf(name, folder, hf))


def _with_weights(hf, weights: dict[str, torch.Tensor]):
    """A copy of transformers model `hf` holding `weights` (an artifact's dequantized tensors)."""
    model = type(hf)(hf.config).to(torch.float32)
    missing, unexpected = model.load_state_dict(weights, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    model.tie_weights()
    return model.eval()


@pytest.mark.parametrize("weights", ["bf16", "int8", "int4"])
@pytest.mark.parametrize("name", ["qwen2", "mistral", "gemma3"])
def test_converted_weight_formats_match_transformers(name: str, weights: str, tiny, tmp_path: Path) -> None:
    """HF folder converted to bf16 / int8 / int4: transformers on the artifact's dequantized weights."""
    from ninfer.engine.convert import convert

    folder, _, hf = tiny[name]
    art = Artifact.open(convert(folder, tmp_path / f"{name}-{weights}.ninfer", weights=weights, progress=False))
    assert any(f.format == weights for f in art.meta.tensor_formats.values())
    ref = _with_weights(hf, art.load_dequantized())
    check_against(TorchModelRunner(art, num_pages=8, page_size=8, dtype=torch.float32), ref, steps=8)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1"])
@pytest.mark.parametrize("name", ["qwen2", "mistral", "gemma3"])
def test_quantized_gguf_kept_as_is_matches_transformers(name: str, qtype: str, tiny, tmp_path: Path) -> None:
    """A GGUF whose linear weights are Q8_0 / Q4_0 / Q4_1 is kept quantized (int8 / int4 groups of 32):
    transformers on the values the file holds."""
    from gguf import GGMLQuantizationType as Q
    from safetensors.numpy import load_file

    from gguf_arch_synth import write_arch_gguf
    from ninfer.engine.convert import convert

    folder, _, hf = tiny[name]
    cfg = json.loads((folder / "config.json").read_text())
    tokenizer = json.loads((folder / "tokenizer.json").read_text())
    path = tmp_path / f"tiny-{name}-{qtype}.gguf"
    write_arch_gguf(path, "llama" if name == "mistral" else name, load_file(str(folder / "model.safetensors")), cfg,
                    tokenizer, linear_type=getattr(Q, qtype), keys=_gguf_keys(name, cfg))
    art = Artifact.open(convert(path, tmp_path / f"{name}.ninfer", progress=False))
    kept = {f.format for n, f in art.meta.tensor_formats.items() if n.endswith("q_proj.weight")}
    assert kept == {"int8" if qtype == "Q8_0" else "int4"}
    ref = _with_weights(_hf_for_gguf(name, folder, hf), art.load_dequantized())
    check_against(TorchModelRunner(art, num_pages=8, page_size=8, dtype=torch.float32), ref, steps=8)


def test_unknown_architecture_and_rope_type_name_themselves() -> None:
    from ninfer.errors import ConfigError

    raw = tiny_configs()["qwen2"].to_dict()
    with pytest.raises(ConfigError, match="unknown architecture .*Phi3ForCausalLM"):
        ModelConfig.from_hf({**raw, "architectures": ["Phi3ForCausalLM"], "model_type": "phi3"})
    with pytest.raises(ConfigError, match="unsupported rope scaling type 'longrope'"):
        ModelConfig.from_hf({**raw, "architectures": ["Qwen2ForCausalLM"],
                             "rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4, "factor": 2.0}})


@pytest.mark.parametrize("name,billions", [("qwen2.5-7b", 7.6156), ("mistral-7b", 7.2417), ("gemma3-4b", 3.8803)])
def test_synthetic_shapes_have_the_published_parameter_counts(name: str, billions: float) -> None:
    import math

    from ninfer.engine.models import expected_weights
    from ninfer.engine.synthetic import SHAPES

    c = ModelConfig(**SHAPES[name])
    assert sum(math.prod(s) for s in expected_weights(c).values()) / 1e9 == pytest.approx(billions, abs=1e-4)


def test_unsupported_gguf_architecture_is_one_line(tmp_path: Path) -> None:
    import gguf

    from ninfer.engine.convert import convert
    from ninfer.errors import ArtifactError

    w = gguf.GGUFWriter(str(tmp_path / "phi.gguf"), "phi3")
    w.add_block_count(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ArtifactError, match=r"unsupported architecture 'phi3' \(supported: llama, qwen2, qwen3, qwen35, gemma3\)"):
        convert(tmp_path / "phi.gguf", tmp_path / "phi.ninfer", progress=False)


@pytest.mark.parametrize("window,softcap", [(0, 0.0), (3, 0.0), (0, 0.7), (5, 1.3)])
def test_paged_attention_window_and_softcap_against_direct_math(window: int, softcap: float) -> None:
    """The torch op over pages (prefill, a chunk after cached tokens, a decode row) against the
    definition: scores q.k * scale, capped, masked to the causal window, softmax, times v."""
    from ninfer.engine.ops.torch_ops import AttentionMetadata, paged_attention

    g = torch.Generator().manual_seed(0)
    H, KV, D, n, ps = 4, 2, 8, 11, 4
    q, k, v = (torch.randn(n, h, D, generator=g, dtype=torch.float64) * 3 for h in (H, KV, KV))
    scale = 0.3
    s = torch.einsum("qhd,khd->hqk", q, k.repeat_interleave(H // KV, 1)) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    pos = torch.arange(n)
    mask = pos[None, :] <= pos[:, None]
    if window:
        mask &= pos[None, :] > pos[:, None] - window
    want = torch.einsum("hqk,khd->qhd", s.masked_fill(~mask, float("-inf")).softmax(-1), v.repeat_interleave(H // KV, 1))
    cache = [torch.zeros(8, ps, KV, D, dtype=torch.float64) for _ in range(2)]
    table = [5, 2, 7]
    got = []
    for start, end in ((0, 6), (6, 10), (10, 11)):  # prefill, a chunk after cached tokens, a decode row
        meta, _ = AttentionMetadata.build([(start, end - start, table)], ps, torch.device("cpu"))
        got.append(paged_attention(q[start:end], k[start:end], v[start:end], *cache, meta, window, scale, softcap))
    assert torch.allclose(torch.cat(got), want.reshape(n, H * D), atol=1e-10, rtol=0)


def test_gemma3_on_two_cpu_stages_computes_one_device_bits(tiny) -> None:
    """Pipeline stages (engine/stages.py) are architecture-blind: gemma3's scaled embedding, sandwich
    norms and sliding/global layers split over two CPU stages give one device's logits exactly."""
    _, art, _ = tiny["gemma3"]
    one = TorchModelRunner(art, num_pages=4, page_size=16, dtype=torch.float32)
    two = TorchModelRunner(art, num_pages=4, page_size=16, dtype=torch.float32, devices=["cpu", "cpu"],
                           stage_layers=[3, 1])
    assert torch.equal(two.forward_logits(PROMPT), one.forward_logits(PROMPT))
