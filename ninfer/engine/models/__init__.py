"""Architecture registry: the weights each architecture expects, as data.

Tensor names follow Hugging Face. Shapes are logical ([out, in] for a linear weight),
whatever format the artifact stores them in.
"""
from __future__ import annotations

from ninfer.engine.config import ModelConfig

# Per-layer weights: name suffix -> shape builder.
_LAYER_WEIGHTS = {
    "input_layernorm.weight": lambda c: (c.hidden_size,),
    "self_attn.q_proj.weight": lambda c: (c.num_attention_heads * c.head_dim, c.hidden_size),
    "self_attn.k_proj.weight": lambda c: (c.num_key_value_heads * c.head_dim, c.hidden_size),
    "self_attn.v_proj.weight": lambda c: (c.num_key_value_heads * c.head_dim, c.hidden_size),
    "self_attn.o_proj.weight": lambda c: (c.hidden_size, c.num_attention_heads * c.head_dim),
    "post_attention_layernorm.weight": lambda c: (c.hidden_size,),
    "mlp.gate_proj.weight": lambda c: (c.intermediate_size, c.hidden_size),
    "mlp.up_proj.weight": lambda c: (c.intermediate_size, c.hidden_size),
    "mlp.down_proj.weight": lambda c: (c.hidden_size, c.intermediate_size),
}
_ATTENTION_BIAS = {
    "self_attn.q_proj.bias": lambda c: (c.num_attention_heads * c.head_dim,),
    "self_attn.k_proj.bias": lambda c: (c.num_key_value_heads * c.head_dim,),
    "self_attn.v_proj.bias": lambda c: (c.num_key_value_heads * c.head_dim,),
}
_QK_NORM = {
    "self_attn.q_norm.weight": lambda c: (c.head_dim,),
    "self_attn.k_norm.weight": lambda c: (c.head_dim,),
}

# Weights that may be stored quantized (2-D linear weights and the embedding).
QUANTIZABLE_SUFFIXES = (
    "q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight",
    "gate_proj.weight", "up_proj.weight", "down_proj.weight",
    "embed_tokens.weight", "lm_head.weight",
)


def expected_weights(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the architecture needs, name -> logical shape."""
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (config.vocab_size, config.hidden_size),
        "model.norm.weight": (config.hidden_size,),
    }
    per_layer = dict(_LAYER_WEIGHTS)
    if config.attention_bias:
        per_layer |= _ATTENTION_BIAS
    if config.qk_norm:
        per_layer |= _QK_NORM
    for i in range(config.num_hidden_layers):
        for suffix, shape in per_layer.items():
            shapes[f"model.layers.{i}.{suffix}"] = shape(config)
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, config.hidden_size)
    return shapes


def is_quantizable(name: str) -> bool:
    return name.endswith(QUANTIZABLE_SUFFIXES)
