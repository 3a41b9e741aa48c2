"""GGUF and Hugging Face folder import: config, lossless repacking, weight modes, errors."""
from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf_synth import llama_permute, write_tiny_gguf

from ninfer.engine.artifact import Artifact
from ninfer.engine.convert import convert
from ninfer.engine.convert.common import sha256_file
from ninfer.engine.convert.gguf import llama3_rope_divisors
from ninfer.engine.convert.gguf_reader import GGUFFile
from ninfer.engine.quant import dequantize
from ninfer.engine.tokenizer import Tokenizer
from ninfer.errors import ArtifactError

MIXED = {"blk.0.attn_q.weight": Q.Q4_0, "blk.0.attn_k.weight": Q.F16, "blk.1.ffn_up.weight": Q.BF16,
         "blk.1.attn_v.weight": Q.Q8_0, "blk.1.attn_q.weight": Q.F32}


def _fmt(art: Artifact, name: str) -> dict:
    return art.meta.tensor_formats[name].to_dict()


# ---- the default model ------------------------------------------------------------------------------

def test_smollm2_artifact(smollm2_artifact: Path, smollm2_gguf: Path) -> None:
    art = Artifact.open(smollm2_artifact)
    meta, cfg = art.meta, art.meta.config
    assert (meta.name, meta.model_id) == ("SmolLM2-135M-Instruct", "SmolLM2-135M-Instruct")
    assert (cfg.architecture, cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size) == ("llama", 30, 576, 1536)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.vocab_size) == (9, 3, 64, 49152)
    assert cfg.tie_word_embeddings and cfg.rope_theta == 100000.0 and cfg.max_position_embeddings == 8192
    assert "lm_head.weight" not in meta.tensor_formats
    assert _fmt(art, "model.embed_tokens.weight") == {"format": "int8", "group_size": 32, "symmetric": True}
    assert _fmt(art, "model.layers.3.mlp.down_proj.weight") == {"format": "int4", "group_size": 32, "symmetric": False}
    assert _fmt(art, "model.layers.3.input_layernorm.weight") == {"format": "f32"}
    st = meta.special_tokens
    assert (st.bos_token_id, st.eos_token_id, st.stop_token_ids, st.add_bos_token) == (1, 2, [0, 2], False)
    assert "<|im_start|>" in meta.chat_template
    assert meta.source["kind"] == "gguf" and meta.source["sha256"] == sha256_file(smollm2_gguf)


def test_smollm2_weights_bit_exact(smollm2_artifact: Path, smollm2_gguf: Path) -> None:
    # quant.dequantize of our parts == gguf's own dequantize of the file's blocks (q/k rows re-permuted)
    art = Artifact.open(smollm2_artifact)
    parts = art.load_parts()
    src = {t.name: t for t in GGUFFile(smollm2_gguf).tensors}
    pairs = {"token_embd.weight": ("model.embed_tokens.weight", None),
             "blk.7.attn_q.weight": ("model.layers.7.self_attn.q_proj.weight", 9),
             "blk.7.attn_k.weight": ("model.layers.7.self_attn.k_proj.weight", 3),
             "blk.7.attn_v.weight": ("model.layers.7.self_attn.v_proj.weight", None),
             "blk.29.ffn_down.weight": ("model.layers.29.mlp.down_proj.weight", None),
             "output_norm.weight": ("model.norm.weight", None)}
    for gname, (name, n_head) in pairs.items():
        t = src[gname]
        want = gguf.quants.dequantize(np.array(t.data).reshape(t.shape[0], -1), t.tensor_type).reshape(t.shape)
        got = dequantize(art.meta.tensor_formats[name], parts[name]).numpy()
        if n_head:
            got = llama_permute(got, n_head)
        assert np.array_equal(got, want), gname


# ---- synthetic GGUF files ---------------------------------------------------------------------------

def test_llama_gguf_keep_is_lossless(tmp_path: Path) -> None:
    g = write_tiny_gguf(tmp_path / "Tiny-Llama-Q4_1.gguf", "llama", tied=False, type_overrides=MIXED)
    art = Artifact.open(convert(g.path, tmp_path / "out.ninfer", progress=False))
    weights = art.load_dequantized()
    for name, held in g.hf_weights.items():  # HF row order: the q/k permutation is undone
        assert torch.equal(weights[name], torch.from_numpy(held)), name
    assert art.meta.name == "Tiny-Llama"
    expect = {"model.layers.0.self_attn.q_proj.weight": {"format": "int4", "group_size": 32, "symmetric": True},
              "model.layers.0.self_attn.k_proj.weight": {"format": "f16"},
              "model.layers.1.mlp.up_proj.weight": {"format": "bf16"},
              "model.layers.1.self_attn.v_proj.weight": {"format": "int8", "group_size": 32, "symmetric": True},
              "model.layers.1.self_attn.q_proj.weight": {"format": "f32"},
              "lm_head.weight": {"format": "int8", "group_size": 32, "symmetric": True}}
    assert {k: _fmt(art, k) for k in expect} == expect
    assert not art.meta.config.tie_word_embeddings
    st = art.meta.special_tokens
    assert (st.bos_token_id, st.eos_token_id, st.add_bos_token, st.stop_token_ids) == (1, 2, True, [2])
    assert Tokenizer.from_metadata(art.meta).encode("hello world", add_special_tokens=True)[0] == 1


def test_qwen3_gguf_not_permuted_and_tied(tmp_path: Path) -> None:
    g = write_tiny_gguf(tmp_path / "tiny-qwen3.gguf", "qwen3", tokenizer="gpt2", tied=True)
    art = Artifact.open(convert(g.path, tmp_path / "q.ninfer", progress=False))
    weights = art.load_dequantized()
    for name, held in g.hf_weights.items():
        assert torch.equal(weights[name], torch.from_numpy(held)), name
    cfg = art.meta.config
    assert cfg.architecture == "qwen3" and cfg.tie_word_embeddings and cfg.head_dim == 16
    assert "model.layers.1.self_attn.k_norm.weight" in art.meta.tensor_formats
    tok = Tokenizer.from_metadata(art.meta)
    ids = tok.encode("<|im_start|>user\nhello world<|im_end|>")
    assert tok.encode("<|im_start|>") == [ids[0]] and ids[-1] == tok.eos_token_id
    assert tok.id_to_piece(tok.bos_token_id) == "<|endoftext|>"
    assert tok.decode(ids) == "<|im_start|>user\nhello world<|im_end|>"
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "<|im_start|>user\nhi<|im_end|>\n"


@pytest.mark.parametrize("weights", ["bf16", "int8", "int4"])
def test_weight_modes(tmp_path: Path, weights: str) -> None:
    g = write_tiny_gguf(tmp_path / "t.gguf", "llama", tied=False, type_overrides=MIXED)
    art = Artifact.open(convert(g.path, tmp_path / f"{weights}.ninfer", weights=weights, progress=False))
    dq = art.load_dequantized()
    for name, held in g.hf_weights.items():
        fmt = art.meta.tensor_formats[name]
        ref = torch.from_numpy(held)
        if ref.ndim == 1:
            assert fmt.format == "f32" and torch.equal(dq[name], ref)
            continue
        src_type = g.types[name]
        if weights == "bf16":
            assert fmt.format == "bf16"
            assert torch.equal(dq[name], ref.to(torch.bfloat16).float())
        elif (weights, src_type) in (("int8", Q.Q8_0), ("int4", Q.Q4_1), ("int4", Q.Q4_0)):
            assert fmt.format == weights and torch.equal(dq[name], ref)  # already that format: kept exactly
        else:
            assert fmt.format == weights and fmt.group_size == 32 and fmt.symmetric == (weights == "int8")
            rel = ((dq[name] - ref).norm() / ref.norm()).item()
            assert rel < (0.01 if weights == "int8" else 0.12), (name, rel)


def test_llama3_rope_freqs_become_rope_scaling(tmp_path: Path) -> None:
    freqs = llama3_rope_divisors(16, 10000.0, 8.0, 1.0, 4.0, 8192)
    assert freqs.min() == 1.0 and freqs.max() == 8.0 and ((freqs > 1) & (freqs < 8)).any()
    g = write_tiny_gguf(tmp_path / "r.gguf", "llama", rope_freqs=freqs)
    cfg = Artifact.open(convert(g.path, tmp_path / "r.ninfer", progress=False)).meta.config
    assert cfg.rope_scaling == {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


# ---- errors -----------------------------------------------------------------------------------------

def _fails(src: Path, out: Path, *fragments: str, weights: str = "keep") -> None:
    with pytest.raises(ArtifactError) as e:
        convert(src, out, weights=weights, progress=False)
    msg = str(e.value)
    assert str(src) in msg, msg
    for f in fragments:
        assert f in msg, msg
    assert not out.exists()


def test_source_errors(tmp_path: Path) -> None:
    out = tmp_path / "o.ninfer"
    _fails(tmp_path / "absent.gguf", out, "no such file")
    text = tmp_path / "notes.txt"
    text.write_text("hello")
    _fails(text, out, "not a GGUF file or a Hugging Face model folder")
    _fails(tmp_path, out, "not a GGUF file or a Hugging Face model folder")  # folder without config.json
    g = write_tiny_gguf(tmp_path / "t.gguf", "llama")
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(g.path.read_bytes()[:5000])
    _fails(truncated, out, "truncated")
    with pytest.raises(ArtifactError, match="unknown weights format 'int2'"):
        convert(g.path, out, weights="int2", progress=False)


def test_unknown_architecture(tmp_path: Path) -> None:
    path = tmp_path / "falcon.gguf"
    w = gguf.GGUFWriter(str(path), "falcon")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((8, 32), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    _fails(path, tmp_path / "o.ninfer", "unsupported architecture 'falcon'")


def test_unsupported_tensor_type(tmp_path: Path) -> None:
    g = write_tiny_gguf(tmp_path / "mx.gguf", "llama", type_overrides={"blk.1.ffn_gate.weight": Q.MXFP4})
    _fails(g.path, tmp_path / "o.ninfer", "blk.1.ffn_gate.weight", "MXFP4")
    # other weight modes dequantize it through gguf
    art = Artifact.open(convert(g.path, tmp_path / "ok.ninfer", weights="int8", progress=False))
    got = art.load_dequantized()["model.layers.1.mlp.gate_proj.weight"]
    ref = torch.from_numpy(g.hf_weights["model.layers.1.mlp.gate_proj.weight"])
    assert ((got - ref).norm() / ref.norm()).item() < 0.01


def test_missing_tensor(tmp_path: Path) -> None:
    g = write_tiny_gguf(tmp_path / "m.gguf", "llama", skip=("blk.1.ffn_up.weight",))
    _fails(g.path, tmp_path / "o.ninfer", "missing tensor model.layers.1.mlp.up_proj.weight")


# ---- Hugging Face folders ---------------------------------------------------------------------------

def _hf_state(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        state.update(load_file(str(f)))
    return state


def test_hf_llama_sharded_keep(tiny_hf_dirs: dict[str, Path], tmp_path: Path) -> None:
    src = tiny_hf_dirs["llama"]
    assert (src / "model.safetensors.index.json").is_file()
    art = Artifact.open(convert(src, tmp_path / "l.ninfer", progress=False))
    state = _hf_state(src)
    parts = art.load_parts()
    assert set(parts) == set(state)
    for name, t in state.items():
        assert art.meta.tensor_formats[name].format == "f32" and torch.equal(parts[name][""], t), name
    cfg = art.meta.config
    assert not cfg.tie_word_embeddings and cfg.rope_theta == 500000.0
    assert cfg.rope_scaling["rope_type"] == "llama3" and cfg.rope_scaling["factor"] == 8.0
    assert art.meta.chat_template == (src / "chat_template.jinja").read_text()
    st = art.meta.special_tokens
    assert (st.bos_token_id, st.eos_token_id, st.stop_token_ids) == (1, 2, [0, 2])
    assert art.meta.source["kind"] == "hf" and len(art.meta.source["sha256"]) == 64
    assert art.meta.name == "tiny-llama"


def test_hf_qwen3_tied_int4(tiny_hf_dirs: dict[str, Path], tmp_path: Path, qwen_style_template: str) -> None:
    src = tiny_hf_dirs["qwen3"]
    art = Artifact.open(convert(src, tmp_path / "q.ninfer", weights="int4", progress=False))
    assert art.meta.config.tie_word_embeddings and "lm_head.weight" not in art.meta.tensor_formats
    assert art.meta.chat_template == qwen_style_template
    assert art.meta.special_tokens.stop_token_ids == [0, 2]
    fmt = art.meta.tensor_formats
    assert fmt["model.layers.0.mlp.up_proj.weight"].to_dict() == {"format": "int4", "group_size": 32, "symmetric": False}
    assert fmt["model.layers.0.self_attn.q_norm.weight"].format == "f32"
    state = _hf_state(src)
    dq = art.load_dequantized()
    ref = state["model.layers.1.self_attn.o_proj.weight"]
    assert ((dq["model.layers.1.self_attn.o_proj.weight"] - ref).norm() / ref.norm()).item() < 0.12
    assert torch.equal(dq["model.layers.1.self_attn.k_norm.weight"], state["model.layers.1.self_attn.k_norm.weight"])


def test_hf_errors(tiny_hf_dirs: dict[str, Path], tmp_path: Path) -> None:
    import shutil

    bad = tmp_path / "bad-arch"
    shutil.copytree(tiny_hf_dirs["qwen3"], bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["architectures"], cfg["model_type"] = ["MambaForCausalLM"], "mamba"
    (bad / "config.json").write_text(json.dumps(cfg))
    _fails(bad, tmp_path / "o.ninfer", "unknown architecture")

    no_weights = tmp_path / "no-weights"
    shutil.copytree(tiny_hf_dirs["qwen3"], no_weights)
    (no_weights / "model.safetensors").unlink()
    _fails(no_weights, tmp_path / "o.ninfer", "no *.safetensors weights")

    not_st = tmp_path / "not-safetensors"
    shutil.copytree(tiny_hf_dirs["qwen3"], not_st)
    (not_st / "model.safetensors").write_bytes(b"garbage" * 10)
    _fails(not_st, tmp_path / "o.ninfer", "not a readable safetensors file")
