"""Qwen2 / Qwen2.5: the llama blocks with a bias on the q, k and v projections (always; o_proj has
none). With `use_sliding_window`, layers from `max_window_layers` on attend within `sliding_window`
(transformers' rule; the released models leave it off)."""
from __future__ import annotations

from typing import Any

from ninfer.engine.models.llama import GGUF_LAYER_NAMES, LINEAR_SUFFIXES, LlamaModel, attention_only, llama_weights
from ninfer.engine.models.spec import Architecture


def _hf_fields(hf: dict[str, Any]) -> dict[str, Any]:
    fields: dict[str, Any] = {"attention_bias": True}
    window = hf.get("sliding_window") if hf.get("use_sliding_window") else None
    if window:
        layers = hf["num_hidden_layers"]
        first = hf.get("max_window_layers", 28)
        fields["sliding_window"] = int(window)
        fields["layer_types"] = hf.get("layer_types") or [
            "sliding_attention" if i >= first else "full_attention" for i in range(layers)]
    return fields


QWEN2 = Architecture(
    name="qwen2", hf_architectures=("Qwen2ForCausalLM",), hf_model_types=("qwen2",), gguf_architecture="qwen2",
    weights=lambda c: llama_weights(c, qk_norm=False), layer_kinds=attention_only, model=LlamaModel,
    gguf_layer_names=GGUF_LAYER_NAMES, quantizable=LINEAR_SUFFIXES, hf_fields=_hf_fields)
