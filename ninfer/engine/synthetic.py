"""Random-weight models of named real shapes, for speed work without weights (`--synthetic NAME`).

`SyntheticArtifact` quacks like `Artifact` (meta, load_parts, load_dequantized) but makes its
tensors on the target device instead of reading a file.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from ninfer.engine.artifact import ArtifactMetadata, SpecialTokens
from ninfer.engine.config import ModelConfig
from ninfer.engine.models import expected_weights, is_quantizable
from ninfer.engine.quant import DEFAULT_GROUP_SIZE, TensorFormat, quantize
from ninfer.errors import ConfigError

_LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                   "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def _every_fourth_full(layers: int) -> list[str]:
    return ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)]


# name -> Hugging Face config fields of the real model with that shape.
SHAPES: dict[str, dict] = {
    "smollm2-135m": dict(architecture="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                         num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                         rope_theta=100000.0, max_position_embeddings=8192, tie_word_embeddings=True),
    "llama-1b": dict(architecture="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                     num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                     rope_theta=500000.0, max_position_embeddings=131072, tie_word_embeddings=True,
                     rope_scaling=dict(_LLAMA3_SCALING, factor=32.0)),
    "llama-8b": dict(architecture="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                     num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                     rope_theta=500000.0, max_position_embeddings=131072, rope_scaling=_LLAMA3_SCALING),
    "qwen3-0.6b": dict(architecture="qwen3", vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                       num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                       rope_theta=1000000.0, max_position_embeddings=40960, tie_word_embeddings=True,
                       rms_norm_eps=1e-6),
    "qwen3-8b": dict(architecture="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                     num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                     rope_theta=1000000.0, max_position_embeddings=40960, rms_norm_eps=1e-6),
    # Qwen2.5-7B (config.json): q/k/v biases, untied, no sliding window (use_sliding_window false)
    "qwen2.5-7b": dict(architecture="qwen2", vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                       num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4, head_dim=128,
                       rope_theta=1000000.0, max_position_embeddings=32768, rms_norm_eps=1e-6, attention_bias=True),
    # Mistral-7B-v0.1 (config.json): llama blocks, every layer within a 4096-token window
    "mistral-7b": dict(architecture="llama", vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                       num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                       rope_theta=10000.0, max_position_embeddings=32768, sliding_window=4096,
                       layer_types=["sliding_attention"] * 32),
    # Gemma-3-4B's language model (text_config): five 1024-token sliding layers (RoPE base 1e4) to
    # one global (base 1e6, linear scaling 8), query_pre_attn_scalar 256, tied embeddings
    "gemma3-4b": dict(architecture="gemma3", vocab_size=262208, hidden_size=2560, intermediate_size=10240,
                      num_hidden_layers=34, num_attention_heads=8, num_key_value_heads=4, head_dim=256,
                      rope_theta=1000000.0, rope_local_theta=10000.0, rope_scaling={"rope_type": "linear", "factor": 8.0},
                      max_position_embeddings=131072, rms_norm_eps=1e-6, tie_word_embeddings=True,
                      sliding_window=1024, query_pre_attn_scalar=256.0,
                      layer_types=["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(34)]),
    # Qwen3.5-0.8B's language model. From its model card: hidden 1024, 24 layers as 6 x (3 Gated
    # DeltaNet + 1 gated attention), DeltaNet 16 QK / 16 V heads of 128, attention 8 Q / 2 KV heads of
    # 256, rotary dim 64 (factor 0.25), vocabulary 248320 (padded), context 262144; llama.cpp names
    # 24 layers x 1024 "0.8B". Not verified against its config.json (third-party listings only):
    # intermediate 3584, rope theta 1e7, tied embeddings; conv kernel 4 and eps 1e-6 are the
    # transformers defaults.
    "qwen3.5-0.8b": dict(architecture="qwen3_5", vocab_size=248320, hidden_size=1024, intermediate_size=3584,
                         num_hidden_layers=24, num_attention_heads=8, num_key_value_heads=2, head_dim=256,
                         rope_theta=10000000.0, max_position_embeddings=262144, tie_word_embeddings=True,
                         rms_norm_eps=1e-6, partial_rotary_factor=0.25, layer_types=_every_fourth_full(24),
                         linear_num_key_heads=16, linear_num_value_heads=16, linear_key_head_dim=128,
                         linear_value_head_dim=128, linear_conv_kernel_dim=4),
    # transformers' Qwen3_5TextConfig() defaults (documented as Qwen3.5-9B; rope theta and context are
    # the defaults 10000 / 32768, not the released model's).
    "qwen3.5-9b": dict(architecture="qwen3_5", vocab_size=248320, hidden_size=4096, intermediate_size=12288,
                       num_hidden_layers=32, num_attention_heads=16, num_key_value_heads=4, head_dim=256,
                       rope_theta=10000.0, max_position_embeddings=32768, rms_norm_eps=1e-6,
                       partial_rotary_factor=0.25, layer_types=_every_fourth_full(32),
                       linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
                       linear_value_head_dim=128, linear_conv_kernel_dim=4),
}

# Tensors (by name suffix) whose initial value is not "linear: normal std 0.02, norm: ones", as
# transformers initializes them. qwen3_5 scales by 1 + w (w starts at 0) in every RMSNorm but the
# gated one, and starts the delta rule's decay at A_log = log(U(0.01, 16)) with dt_bias = 1.
_INIT: dict[str, dict[str, str]] = {
    "qwen2": {"_proj.bias": "normal"},  # transformers zeroes them; random ones exercise the bias
    "gemma3": {"norm.weight": "zeros"},  # every gemma3 RMSNorm scales by 1 + w
    "qwen3_5": {"input_layernorm.weight": "zeros", "post_attention_layernorm.weight": "zeros",
                "model.norm.weight": "zeros", "q_norm.weight": "zeros", "k_norm.weight": "zeros",
                "linear_attn.A_log": "log_uniform", "linear_attn.dt_bias": "ones"},
}


def _word_level_tokenizer(vocab_size: int) -> str:
    """A tokenizer whose token i is the text "<i>" so any id decodes (benchmarks feed ids)."""
    vocab = {f"<{i}>": i for i in range(vocab_size)}
    return json.dumps({
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": [],
        "normalizer": None, "pre_tokenizer": {"type": "WhitespaceSplit"}, "post_processor": None,
        "decoder": None, "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<0>"},
    })


WEIGHTS = ("bf16", "f32", "int8", "int4", "q4_k", "q6_k", "q4_k_m")


def _q4_k_m(name: str, layers: int, tied: bool) -> str:
    """The block format llama.cpp's quantize tool gives weight `name` in a Q4_K_M file: q6_k for the
    lm_head (the embedding when tied) and for v_proj / down_proj of its `use_more_bits` layers, q4_k
    for the rest."""
    if name == "lm_head.weight" or (tied and name == "model.embed_tokens.weight"):
        return "q6_k"
    if name.endswith(("v_proj.weight", "down_proj.weight")):
        i = int(name.split(".")[2])
        if i < layers // 8 or i >= 7 * layers // 8 or (i - layers // 8) % 3 == 2:
            return "q6_k"
    return "q4_k"


class SyntheticArtifact:
    """Random weights (normal, std 0.02; norms 1; as _INIT says otherwise) of a named shape, in
    `weights` format: bf16, f32, int8 / int4 (group 32), q4_k / q6_k (llama.cpp blocks, round to
    nearest), or q4_k_m (q4_k with q6_k where a Q4_K_M file has it)."""

    def __init__(self, name: str, weights: str = "bf16", seed: int = 0) -> None:
        if name not in SHAPES:
            raise ConfigError(f"--synthetic {name!r}: known shapes are {', '.join(SHAPES)}")
        if weights not in WEIGHTS:
            raise ConfigError(f"synthetic weights must be one of {', '.join(WEIGHTS)}, got {weights!r}")
        config = ModelConfig(**SHAPES[name])
        self.path = Path(f"synthetic:{name}")
        self.seed = seed
        shapes = expected_weights(config)
        self._init = _INIT.get(config.architecture, {})
        formats = {}
        for wname, shape in shapes.items():
            if len(shape) == 2 and is_quantizable(wname, config) and weights in ("int8", "int4"):
                formats[wname] = TensorFormat(weights, DEFAULT_GROUP_SIZE, symmetric=False)
            elif len(shape) == 2 and is_quantizable(wname, config) and weights in ("q4_k", "q6_k", "q4_k_m") \
                    and shape[1] % 256 == 0:
                kind = (_q4_k_m(wname, config.num_hidden_layers, config.tie_word_embeddings) if weights == "q4_k_m"
                        else weights)
                formats[wname] = TensorFormat(kind)
            elif len(shape) == 2:
                formats[wname] = TensorFormat("f32" if weights == "f32" else "bf16")
            else:
                formats[wname] = TensorFormat("f32")
        self._shapes = shapes
        self.meta = ArtifactMetadata(
            name=f"synthetic-{name}", model_id=f"synthetic-{name}", config=config, tensor_formats=formats,
            tokenizer_json=_word_level_tokenizer(config.vocab_size), chat_template=None,
            special_tokens=SpecialTokens(eos_token_id=None, stop_token_ids=[]),
            source={"kind": "synthetic", "sha256": None, "path": name, "weights": weights},
        )

    def _tensor(self, name: str, gen: torch.Generator, device: str) -> torch.Tensor:
        shape = self._shapes[name]
        rule = next((r for sfx, r in self._init.items() if name.endswith(sfx)), "ones" if len(shape) == 1 else None)
        if rule == "zeros":
            return torch.zeros(shape, dtype=torch.float32, device=device)
        if rule == "ones":
            return torch.ones(shape, dtype=torch.float32, device=device)
        if rule == "log_uniform":
            return (torch.rand(shape, generator=gen, dtype=torch.float32, device=device) * 15.99 + 0.01).log()
        return torch.randn(shape, generator=gen, dtype=torch.float32, device=device) * 0.02

    @property
    def payload_bytes(self) -> int:
        """Bytes these weights would take stored in an artifact (as Artifact.payload_bytes)."""
        return sum(math.prod(stored) * fmt.stored_dtypes()[suffix].itemsize
                   for name, fmt in self.meta.tensor_formats.items()
                   for suffix, stored in fmt.stored_shapes(self._shapes[name]).items())

    def load_parts(self, device: str | torch.device = "cpu",
                   names: set[str] | None = None) -> dict[str, dict[str, torch.Tensor]]:
        """Every weight (only `names`, when given: the others are still drawn, one at a time, so
        that a pipeline stage's weights are the same values as the whole model's)."""
        device = str(device)
        gen = torch.Generator(device=device).manual_seed(self.seed)
        parts = {}
        for name, fmt in self.meta.tensor_formats.items():
            t = self._tensor(name, gen, device)
            if names is None or name in names:
                parts[name] = quantize(t, fmt)
        return parts

    def load_dequantized(self, dtype: torch.dtype = torch.float32,
                         device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
        from ninfer.engine.quant import dequantize

        return {name: dequantize(self.meta.tensor_formats[name], parts, dtype)
                for name, parts in self.load_parts(device).items()}
