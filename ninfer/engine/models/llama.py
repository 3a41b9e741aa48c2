"""Llama (SmolLM2, Llama 3, and Mistral-style files: llama blocks, every layer within a sliding
window where the config or GGUF declares one): the record and the one forward, over a flat token batch.

At load q/k/v and gate/up are fused into one projection each; the backend decides how each
weight is kept (ops.linear_weight)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ninfer.engine.config import ModelConfig
from ninfer.engine.models.spec import ATTENTION, Architecture, Shapes
from ninfer.engine.models.weights import WeightReader

LINEAR_SUFFIXES = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight",
                   "gate_proj.weight", "up_proj.weight", "down_proj.weight",
                   "embed_tokens.weight", "lm_head.weight")

GGUF_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}


def global_weights(c: ModelConfig) -> Shapes:
    """Embedding and final norm (the lm_head, when untied, goes last: see with_lm_head)."""
    return {"model.embed_tokens.weight": (c.vocab_size, c.hidden_size), "model.norm.weight": (c.hidden_size,)}


def with_lm_head(shapes: Shapes, c: ModelConfig) -> Shapes:
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, c.hidden_size)
    return shapes


def attention_weights(c: ModelConfig, qk_norm: bool) -> Shapes:
    """Per-layer suffix -> shape of a llama layer (input norm, attention, post norm, MLP), in the
    order synthetic weights are drawn."""
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    shapes: Shapes = {
        "input_layernorm.weight": (c.hidden_size,),
        "self_attn.q_proj.weight": (q, c.hidden_size),
        "self_attn.k_proj.weight": (kv, c.hidden_size),
        "self_attn.v_proj.weight": (kv, c.hidden_size),
        "self_attn.o_proj.weight": (c.hidden_size, q),
    } | mlp_weights(c)
    if c.attention_bias:
        shapes |= {"self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,), "self_attn.v_proj.bias": (kv,)}
    if qk_norm:
        shapes |= {"self_attn.q_norm.weight": (c.head_dim,), "self_attn.k_norm.weight": (c.head_dim,)}
    return shapes


def mlp_weights(c: ModelConfig) -> Shapes:
    return {"post_attention_layernorm.weight": (c.hidden_size,),
            "mlp.gate_proj.weight": (c.intermediate_size, c.hidden_size),
            "mlp.up_proj.weight": (c.intermediate_size, c.hidden_size),
            "mlp.down_proj.weight": (c.hidden_size, c.intermediate_size)}


def llama_weights(c: ModelConfig, qk_norm: bool) -> Shapes:
    shapes = global_weights(c)
    per_layer = attention_weights(c, qk_norm)
    for i in range(c.num_hidden_layers):
        shapes |= {f"model.layers.{i}.{sfx}": shape for sfx, shape in per_layer.items()}
    return with_lm_head(shapes, c)


@dataclass(slots=True)
class MLP:
    gate_up: Any  # [2 * intermediate, hidden]
    down: Any  # [hidden, intermediate]

    @classmethod
    def load(cls, w: WeightReader, p: str) -> MLP:
        return cls(w.linear([p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"], glu=True),
                   w.linear([p + "mlp.down_proj.weight"]))

    def add_norm(self, ops: Any, x: torch.Tensor, residual: torch.Tensor, norm: Any, eps: float,
                 then: Any = None) -> torch.Tensor:
        """The MLP's output added into the residual stream, then RMSNorm with `norm` (the down
        projection and the norm are one op: a decode step fuses them); then: the one weight the result
        feeds (ops.linear_add_rms_norm)."""
        return ops.linear_add_rms_norm(ops.gated_linear(x, self.gate_up, "silu"), self.down, residual, norm, eps,
                                       then=then)


@dataclass(slots=True)
class Attention:
    qkv: Any  # [(heads + 2 * kv_heads) * head_dim, hidden]
    o_proj: Any  # [hidden, heads * head_dim]
    q_norm: Any  # [head_dim] (qk_norm) or None
    k_norm: Any

    @classmethod
    def load(cls, w: WeightReader, p: str, c: ModelConfig, qk_norm: bool) -> Attention:
        a = p + "self_attn."
        bias = [a + f"{x}_proj.bias" for x in "qkv"] if c.attention_bias else None
        norms = (w.vector(a + "q_norm.weight"), w.vector(a + "k_norm.weight")) if qk_norm else (None, None)
        return cls(w.linear([a + f"{x}_proj.weight" for x in "qkv"], bias), w.linear([a + "o_proj.weight"]), *norms)

    def __call__(self, ops: Any, layer: int, x: torch.Tensor, c: ModelConfig) -> torch.Tensor:
        return ops.linear(self.heads(ops, layer, x), self.o_proj)

    def heads(self, ops: Any, layer: int, x: torch.Tensor) -> torch.Tensor:
        """The attention heads' output, before o_proj."""
        return ops.attention(layer, ops.linear(x, self.qkv), self.q_norm, self.k_norm)

    def add_norm(self, ops: Any, layer: int, x: torch.Tensor, residual: torch.Tensor, norm: Any,
                 eps: float, then: Any = None) -> torch.Tensor:
        """The attention output added into the residual stream, then RMSNorm with `norm` (o_proj and
        the norm are one op: a decode step fuses them); then: the one weight the result feeds."""
        return ops.linear_add_rms_norm(self.heads(ops, layer, x), self.o_proj, residual, norm, eps, then=then)


@dataclass(slots=True)
class DecoderLayer:
    input_norm: Any  # [hidden]
    attn: Attention
    post_norm: Any
    mlp: MLP


class LlamaModel:
    """forward(ops, input_ids [T]) -> final normed hidden [T, hidden]; compute_logits."""

    qk_norm = False

    def __init__(self, config: ModelConfig, embed: Any, layers: list[DecoderLayer], norm: Any, lm_head: Any) -> None:
        self.config = config
        self.embed = embed  # [vocab, hidden]
        self.layers = layers
        self.norm = norm
        self.lm_head = lm_head  # [vocab, hidden]; `embed` when tied

    @classmethod
    def load(cls, w: WeightReader, config: ModelConfig) -> LlamaModel:
        c = config
        layers = []
        for i in range(c.num_hidden_layers):
            p = f"model.layers.{i}."
            layers.append(DecoderLayer(w.vector(p + "input_layernorm.weight"), Attention.load(w, p, c, cls.qk_norm),
                                       w.vector(p + "post_attention_layernorm.weight"), MLP.load(w, p)))
            w.release(p)
        embed = w.embedding("model.embed_tokens.weight", lm_head=c.tie_word_embeddings)
        lm_head = embed if c.tie_word_embeddings else w.linear(["lm_head.weight"], logits=True)
        return cls(c, embed, layers, w.vector("model.norm.weight"), lm_head)

    def forward(self, ops: Any, input_ids: torch.Tensor) -> torch.Tensor:
        """All layers over the flat batch of the step ops.begin() was given (K/V written)."""
        eps, layers = self.config.rms_norm_eps, self.layers
        h = ops.embed(input_ids, self.embed)  # the residual stream
        x = ops.rms_norm(h, layers[0].input_norm, eps)
        for i, layer in enumerate(layers):
            # each normed row feeds one projection (the MLP's gate_up, the next layer's qkv), which a
            # backend may hand the norm to (ops.linear_add_rms_norm's `then`); the last is returned
            x = layer.attn.add_norm(ops, i, x, h, layer.post_norm, eps, then=layer.mlp.gate_up)
            last = i + 1 == len(layers)
            nxt = self.norm if last else layers[i + 1].input_norm
            x = layer.mlp.add_norm(ops, x, h, nxt, eps, then=None if last else layers[i + 1].attn.qkv)
        return x

    def compute_logits(self, ops: Any, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """hidden [n, hidden] -> logits [n, vocab] float32 (into `out` when given)."""
        return ops.logits(hidden, self.lm_head, out)


def attention_only(c: ModelConfig) -> tuple[str, ...]:
    return (ATTENTION,) * c.num_hidden_layers


def every_layer_sliding(window: Any, layers: int) -> dict[str, Any]:
    """ModelConfig fields for a model whose every layer attends within `window` (None/0: none)."""
    if not window:
        return {}
    return {"sliding_window": int(window), "layer_types": ["sliding_attention"] * layers}


def _hf_fields(hf: dict[str, Any]) -> dict[str, Any]:
    # Mistral's config.json: sliding_window (null from v0.2 on) applies to every layer
    return every_layer_sliding(hf.get("sliding_window"), hf["num_hidden_layers"]) if hf.get("model_type") == "mistral" else {}


def _gguf_fields(key: Any, layers: int) -> dict[str, Any]:
    # llama.cpp writes {arch}.attention.sliding_window when a model declares one
    return every_layer_sliding(key("attention.sliding_window", 0), layers)


LLAMA = Architecture(
    name="llama", hf_architectures=("LlamaForCausalLM", "MistralForCausalLM"), hf_model_types=("llama", "mistral"),
    gguf_architecture="llama", weights=lambda c: llama_weights(c, qk_norm=False), layer_kinds=attention_only,
    model=LlamaModel, gguf_layer_names=GGUF_LAYER_NAMES, quantizable=LINEAR_SUFFIXES,
    hf_fields=_hf_fields, gguf_fields=_gguf_fields)
