"""RoPE scaling against transformers' own implementations (modeling_rope_utils and a model's rotary
embedding), the spec's linear interpolation against its formula, and the serve options."""
from __future__ import annotations

import math

import pytest
import torch

from ninfer.engine.config import ModelConfig
from ninfer.engine.ops.torch_ops import RotaryEmbedding
from ninfer.engine.rope import Rope, RopeOverride
from ninfer.errors import ConfigError

transformers = pytest.importorskip("transformers")

HEAD_DIM = 64
SCALINGS = [
    {"rope_type": "linear", "factor": 4.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 1024},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048},
    {"rope_type": "yarn", "factor": 2.5, "original_max_position_embeddings": 4096, "beta_fast": 16, "beta_slow": 2},
    {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "mscale": 1.0,
     "mscale_all_dim": 0.707},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1000, "attention_factor": 1.25,
     "truncate": False},
]


def hf_config(scaling: dict | None, theta: float = 1e6, partial: float = 1.0):
    params = {"rope_theta": theta, **(scaling or {"rope_type": "default"})}
    if partial != 1.0:
        params["partial_rotary_factor"] = partial
    return transformers.LlamaConfig(hidden_size=256, num_attention_heads=4, head_dim=HEAD_DIM,
                                     max_position_embeddings=16384, rope_parameters=params)


@pytest.mark.parametrize("scaling", SCALINGS, ids=lambda s: f"{s['rope_type']}-{s['factor']}")
def test_inverse_frequencies_and_attention_factor_equal_transformers(scaling: dict) -> None:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    ref_inv, ref_factor = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](hf_config(scaling), "cpu")
    rope = Rope.of(HEAD_DIM, 1e6, scaling)
    assert torch.equal(rope.inv_freq(), ref_inv)
    assert rope.attention_factor() == pytest.approx(ref_factor, rel=1e-12)
    assert not torch.equal(rope.inv_freq(), Rope.of(HEAD_DIM, 1e6, None).inv_freq())


@pytest.mark.parametrize("scaling", [None, *SCALINGS[:3]], ids=lambda s: s["rope_type"] if s else "default")
def test_cos_sin_tables_equal_the_models_rotary_embedding(scaling: dict | None) -> None:
    """Our torch tables (attention factor folded in) against LlamaRotaryEmbedding's cos and sin."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    cfg = hf_config(scaling)
    positions = torch.tensor([[0, 1, 7, 100, 1023, 2047, 2048, 5000, 16383]])
    ref_cos, ref_sin = LlamaRotaryEmbedding(cfg)(torch.zeros(1, dtype=torch.float32), positions)
    table = RotaryEmbedding(Rope.of(HEAD_DIM, 1e6, scaling), 64, torch.float32, torch.device("cpu"))
    cos, signed_sin = table.lookup(positions[0], int(positions.max()))
    half = HEAD_DIM // 2
    assert torch.equal(cos[:, 0], ref_cos[0])
    assert torch.equal(signed_sin[:, 0, half:], ref_sin[0, :, half:])
    assert torch.equal(signed_sin[:, 0, :half], -ref_sin[0, :, :half])


def test_partial_rotary_yarn_equals_transformers() -> None:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling = SCALINGS[2]
    ref_inv, _ = ROPE_INIT_FUNCTIONS["yarn"](hf_config(scaling, partial=0.5), "cpu")
    assert torch.equal(Rope.of(HEAD_DIM // 2, 1e6, scaling).inv_freq(), ref_inv)


def test_interpolate_follows_the_spec_formula() -> None:
    """--rope-scaling-factor F: a position p past the original context o rotates at o + (p - o) / F;
    positions up to o keep their exact angles."""
    o, f = 100, 4.0
    rope = Rope.of(HEAD_DIM, 10000.0, {"rope_type": "interpolate", "factor": f, "original_max_position_embeddings": o})
    plain = Rope.of(HEAD_DIM, 10000.0, None)
    angles, exact = rope.angles(500), plain.angles(500)
    assert torch.equal(angles[:o + 1], exact[:o + 1])
    for p in (101, 250, 499):
        want = (o + (p - o) / f) * plain.inv_freq()
        assert torch.allclose(angles[p], want, rtol=1e-6, atol=0)
    assert rope.attention_factor() == 1.0


def test_unsupported_scalings_name_their_type_or_field() -> None:
    with pytest.raises(ConfigError, match="unsupported rope scaling type 'dynamic'"):
        Rope.of(64, 1e4, {"rope_type": "dynamic", "factor": 2.0})
    with pytest.raises(ConfigError, match="'yarn' needs original_max_position_embeddings"):
        Rope.of(64, 1e4, {"rope_type": "yarn", "factor": 2.0})
    with pytest.raises(ConfigError, match="factor must be a number >= 1"):
        Rope.of(64, 1e4, {"type": "linear", "factor": 0.5})
    assert Rope.of(64, 1e4, {"type": "linear", "factor": 2.0}).kind == "linear"  # the older key


def test_from_hf_fills_transformers_defaults_for_yarn() -> None:
    base = dict(architectures=["LlamaForCausalLM"], vocab_size=32, hidden_size=64, intermediate_size=128,
                num_hidden_layers=1, num_attention_heads=4, max_position_embeddings=32768)
    c = ModelConfig.from_hf({**base, "rope_scaling": {"type": "yarn", "factor": 4.0}})
    assert c.rope_scaling["original_max_position_embeddings"] == 32768
    c = ModelConfig.from_hf({**base, "rope_scaling": {"rope_type": "yarn", "factor": None,
                                                      "original_max_position_embeddings": 8192}})
    assert c.rope_scaling["factor"] == 4.0


# ---- serve options -----------------------------------------------------------------------------------

def _config(native: int = 4096) -> ModelConfig:
    return ModelConfig(architecture="llama", vocab_size=32, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=native)


def test_rope_yarn_scales_by_max_context_over_native() -> None:
    opts = RopeOverride(yarn=True)
    assert opts.apply(_config(), 4096).rope_scaling is None  # within the native window: plain RoPE
    c = opts.apply(_config(), 12288)
    assert c.rope_scaling == {"rope_type": "yarn", "factor": 3.0, "original_max_position_embeddings": 4096}
    assert c.max_position_embeddings == 4 * 4096
    with pytest.raises(ConfigError, match="four times"):
        opts.apply(_config(), 4 * 4096 + 1)


def test_rope_yarn_factor_is_fixed_whatever_the_context() -> None:
    c = RopeOverride(yarn_factor=2.0).apply(_config(), None)
    assert c.rope_scaling["factor"] == 2.0 and c.rope_scaling["rope_type"] == "yarn"
    assert RopeOverride(yarn=True, yarn_factor=2.0).apply(_config(), 16384).rope_scaling["factor"] == 2.0
    with pytest.raises(ConfigError, match=r"--rope-yarn-factor must be in \[1, 4\]"):
        RopeOverride(yarn_factor=5.0)


def test_rope_scaling_factor_interpolates_past_the_original_context() -> None:
    c = RopeOverride(scaling_factor=8.0).apply(_config(), None)
    assert c.rope_scaling == {"rope_type": "interpolate", "factor": 8.0, "original_max_position_embeddings": 4096}
    c = RopeOverride(scaling_factor=8.0, original_context=2048).apply(_config(), 8192)
    assert c.rope_scaling["original_max_position_embeddings"] == 2048
    assert c.max_position_embeddings == 4 * 4096  # the cap is four times native whatever the factor
    with pytest.raises(ConfigError, match="excludes --rope-yarn"):
        RopeOverride(yarn=True, scaling_factor=2.0)
    with pytest.raises(ConfigError, match=r"\[1, 32\]"):
        RopeOverride(scaling_factor=33.0)
    with pytest.raises(ConfigError, match="needs --rope-scaling-factor"):
        RopeOverride(original_context=1024)


def test_serve_options_replace_the_models_own_scaling() -> None:
    own = _config()
    own.rope_scaling = {"rope_type": "linear", "factor": 2.0}
    assert RopeOverride().apply(own, 8192) is own  # no option: the model's own
    assert RopeOverride(yarn_factor=1.5).apply(own, None).rope_scaling["rope_type"] == "yarn"
    assert math.isclose(Rope.of(16, 1e4, RopeOverride(yarn_factor=1.5).scaling(4096, None)).attention_factor(),
                        0.1 * math.log(1.5) + 1.0)
