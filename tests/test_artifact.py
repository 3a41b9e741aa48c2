"""The .ninfer v3 file: a round trip, and every kind of broken file fails with an ArtifactError that
names the file and the problem."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from ninfer.engine.artifact import FORMAT_VERSION, Artifact, ArtifactMetadata, SpecialTokens, write_artifact
from ninfer.engine.config import ModelConfig
from ninfer.engine.models import expected_weights, is_quantizable
from ninfer.engine.quant import TensorFormat, quantize
from ninfer.errors import ArtifactError

CONFIG = ModelConfig(architecture="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                     num_attention_heads=2, num_key_value_heads=1, head_dim=16, tie_word_embeddings=True)


def _parts_and_meta() -> tuple[dict[str, torch.Tensor], ArtifactMetadata]:
    torch.manual_seed(0)
    tensors, formats = {}, {}
    for name, shape in expected_weights(CONFIG).items():
        fmt = TensorFormat("int4", 32, symmetric=False) if is_quantizable(name) else TensorFormat("f32")
        for suffix, part in quantize(torch.randn(shape), fmt).items():
            tensors[name + suffix] = part
        formats[name] = fmt
    meta = ArtifactMetadata(name="tiny", model_id="tiny", config=CONFIG, tensor_formats=formats,
                            tokenizer_json="{}", chat_template=None, special_tokens=SpecialTokens(eos_token_id=1),
                            source={"kind": "synthetic"})
    return tensors, meta


def _save_raw(path: Path, tensors: dict[str, torch.Tensor], meta_json: str, version: str = FORMAT_VERSION) -> Path:
    save_file(tensors, str(path), metadata={"ninfer.format_version": version, "ninfer.metadata": meta_json})
    return path


def test_round_trip(tmp_path: Path) -> None:
    tensors, meta = _parts_and_meta()
    path = write_artifact(tmp_path / "ok.ninfer", tensors, meta)
    art = Artifact.open(path)
    assert art.meta.config == CONFIG and art.meta.special_tokens.eos_token_id == 1
    parts = art.load_parts()
    name = "model.layers.0.mlp.up_proj.weight"
    assert torch.equal(parts[name][".mins"], tensors[name + ".mins"])
    assert art.load_dequantized()[name].shape == (64, 32)


def _assert_fails(path: Path, *fragments: str) -> None:
    with pytest.raises(ArtifactError) as e:
        Artifact.open(path)
    msg = str(e.value)
    assert str(path) in msg
    for f in fragments:
        assert f in msg, msg


def test_not_safetensors(tmp_path: Path) -> None:
    path = tmp_path / "junk.ninfer"
    path.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00this is not json at all")
    _assert_fails(path, "not a safetensors file")
    path.write_bytes(b"abc")
    _assert_fails(path, "not a safetensors file")
    _assert_fails(tmp_path / "absent.ninfer", "no such file")


def test_wrong_format_version(tmp_path: Path) -> None:
    tensors, meta = _parts_and_meta()
    _assert_fails(_save_raw(tmp_path / "v2.ninfer", tensors, meta.to_json(), version="2"), "format_version '2'")


def test_plain_safetensors_without_metadata(tmp_path: Path) -> None:
    path = tmp_path / "plain.safetensors"
    save_file({"x": torch.zeros(2)}, str(path))
    _assert_fails(path, "not a .ninfer artifact")


def test_missing_tensor(tmp_path: Path) -> None:
    tensors, meta = _parts_and_meta()
    del tensors["model.layers.0.self_attn.k_proj.weight.scales"]
    _assert_fails(_save_raw(tmp_path / "m.ninfer", tensors, meta.to_json()),
                  "missing tensor model.layers.0.self_attn.k_proj.weight.scales")


def test_misshaped_tensor(tmp_path: Path) -> None:
    tensors, meta = _parts_and_meta()
    tensors["model.norm.weight"] = torch.ones(31)
    _assert_fails(_save_raw(tmp_path / "s.ninfer", tensors, meta.to_json()),
                  "model.norm.weight", "shape [31]", "expected [32]")


def test_wrong_dtype(tmp_path: Path) -> None:
    tensors, meta = _parts_and_meta()
    tensors["model.norm.weight"] = torch.ones(32, dtype=torch.float16)
    _assert_fails(_save_raw(tmp_path / "d.ninfer", tensors, meta.to_json()), "model.norm.weight", "dtype")


def test_unknown_architecture(tmp_path: Path) -> None:
    tensors, meta = _parts_and_meta()
    doc = json.loads(meta.to_json())
    doc["architecture"] = doc["config"]["architecture"] = "gpt9"
    _assert_fails(_save_raw(tmp_path / "a.ninfer", tensors, json.dumps(doc)), "unknown architecture 'gpt9'")


def test_unknown_tensor_format(tmp_path: Path) -> None:
    tensors, meta = _parts_and_meta()
    doc = json.loads(meta.to_json())
    doc["tensors"]["model.norm.weight"] = {"format": "int3"}
    _assert_fails(_save_raw(tmp_path / "f.ninfer", tensors, json.dumps(doc)), "unknown tensor format 'int3'")


def test_metadata_not_json(tmp_path: Path) -> None:
    tensors, _ = _parts_and_meta()
    _assert_fails(_save_raw(tmp_path / "j.ninfer", tensors, "{not json"), "not valid JSON")


def test_write_refuses_invalid(tmp_path: Path) -> None:
    tensors, meta = _parts_and_meta()
    del tensors["model.embed_tokens.weight"]
    with pytest.raises(ArtifactError, match="missing tensor model.embed_tokens.weight"):
        write_artifact(tmp_path / "w.ninfer", tensors, meta)
    assert not (tmp_path / "w.ninfer").exists()


def test_model_facts_are_read_once_from_the_artifact(tmp_path: Path) -> None:
    """The facts the server reports (/v1/models meta, /props) come from the engine's loader."""
    import math
    from types import SimpleNamespace

    from ninfer.engine.loader import model_facts
    from ninfer.engine.synthetic import SyntheticArtifact

    tensors, meta = _parts_and_meta()
    path = write_artifact(tmp_path / "ok.ninfer", tensors, meta)
    art = Artifact.open(path)
    facts = model_facts(art, SimpleNamespace(vocab_size=60), max_context=128)
    header_len = int.from_bytes(path.read_bytes()[:8], "little")
    assert facts.stored_bytes == sum(t.numel() * t.element_size() for t in tensors.values())
    assert facts.stored_bytes == path.stat().st_size - 8 - header_len  # the payload after the header
    assert facts.num_parameters == sum(math.prod(s) for s in expected_weights(CONFIG).values())
    assert facts.weight_formats == ("f32", "int4ag32")
    assert (facts.path, facts.vocab_size, facts.logits_size, facts.max_context) == (str(path), 60, 64, 128)
    assert (facts.trained_context, facts.hidden_size) == (CONFIG.max_position_embeddings, 32)

    synthetic = SyntheticArtifact("smollm2-135m", "bf16")
    facts = model_facts(synthetic, SimpleNamespace(vocab_size=49152), max_context=8192)
    shapes = expected_weights(synthetic.meta.config).values()
    assert facts.stored_bytes == sum(math.prod(s) * (2 if len(s) == 2 else 4) for s in shapes)
    assert facts.weight_formats == ("bf16", "f32") and facts.path == "synthetic:smollm2-135m"
