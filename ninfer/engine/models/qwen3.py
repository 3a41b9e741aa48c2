"""Qwen3 (dense): the llama blocks plus a per-head RMSNorm on q and k before RoPE
(`self_attn.q_norm` / `self_attn.k_norm`, [head_dim] each)."""
from __future__ import annotations

from ninfer.engine.models.llama import GGUF_LAYER_NAMES, LINEAR_SUFFIXES, LlamaModel, attention_only, llama_weights
from ninfer.engine.models.spec import Architecture


class Qwen3Model(LlamaModel):
    qk_norm = True


QWEN3 = Architecture(
    name="qwen3", hf_architectures=("Qwen3ForCausalLM",), hf_model_types=("qwen3",), gguf_architecture="qwen3",
    weights=lambda c: llama_weights(c, qk_norm=True), layer_kinds=attention_only, model=Qwen3Model,
    gguf_layer_names=GGUF_LAYER_NAMES, quantizable=LINEAR_SUFFIXES, qk_norm=True)
