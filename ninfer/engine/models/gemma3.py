"""Gemma 3 (text): llama-shaped attention and MLP with Gemma's numerics.

- the embedding is scaled by sqrt(hidden_size);
- every RMSNorm scales by (1 + w) (Hugging Face stores w around 0; the loader adds the 1 once), and
  each layer has four: input, post-attention (on the attention output, before the residual add),
  pre-feedforward and post-feedforward (on the MLP output, before the residual add);
- q and k get a per-head RMSNorm before RoPE; scores are scaled by query_pre_attn_scalar ** -0.5;
- layers are "sliding_attention" (window `sliding_window`, RoPE base rope_local_theta, unscaled) or
  "full_attention" (RoPE base rope_theta with the model's rope scaling), five local to one global
  unless layer_types says otherwise;
- the MLP is gelu(tanh approximation)(gate) * up;
- optional soft-capping of the final logits (cap * tanh(x / cap)); attention-score capping is Gemma
  2's (the ops have it, `attn_logit_softcapping`), which Gemma 3 configs leave unset.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ninfer.engine.config import ModelConfig
from ninfer.engine.models.llama import GGUF_LAYER_NAMES as LLAMA_GGUF_NAMES
from ninfer.engine.models.llama import Attention, global_weights, with_lm_head
from ninfer.engine.models.spec import ATTENTION, Architecture, Shapes
from ninfer.engine.models.weights import WeightReader
from ninfer.errors import ConfigError

LINEAR_SUFFIXES = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight",
                   "gate_proj.weight", "up_proj.weight", "down_proj.weight", "embed_tokens.weight", "lm_head.weight")
NORMS = ("input_layernorm.weight", "post_attention_layernorm.weight", "pre_feedforward_layernorm.weight",
         "post_feedforward_layernorm.weight", "self_attn.q_norm.weight", "self_attn.k_norm.weight")
SLIDING_WINDOW_PATTERN = 6  # transformers' and llama.cpp's default: every sixth layer is global
LOCAL_ROPE_THETA = 10000.0  # transformers' default rope_local_base_freq, llama.cpp's fixed one


def layer_kinds(c: ModelConfig) -> tuple[str, ...]:
    return (ATTENTION,) * c.num_hidden_layers


def weights(c: ModelConfig) -> Shapes:
    shapes = global_weights(c)
    q, kv, H, inter = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim, c.hidden_size, c.intermediate_size
    per_layer = {
        "input_layernorm.weight": (H,),
        "self_attn.q_proj.weight": (q, H),
        "self_attn.k_proj.weight": (kv, H),
        "self_attn.v_proj.weight": (kv, H),
        "self_attn.o_proj.weight": (H, q),
        "self_attn.q_norm.weight": (c.head_dim,),
        "self_attn.k_norm.weight": (c.head_dim,),
        "post_attention_layernorm.weight": (H,),
        "pre_feedforward_layernorm.weight": (H,),
        "mlp.gate_proj.weight": (inter, H),
        "mlp.up_proj.weight": (inter, H),
        "mlp.down_proj.weight": (H, inter),
        "post_feedforward_layernorm.weight": (H,),
    }
    if c.attention_bias:
        per_layer |= {"self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,), "self_attn.v_proj.bias": (kv,)}
    for i in range(c.num_hidden_layers):
        shapes |= {f"model.layers.{i}.{sfx}": shape for sfx, shape in per_layer.items()}
    return with_lm_head(shapes, c)


@dataclass(slots=True)
class GeluMLP:
    gate_up: Any  # [2 * intermediate, hidden]
    down: Any

    @classmethod
    def load(cls, w: WeightReader, p: str) -> GeluMLP:
        return cls(w.linear([p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"], glu=True),
                   w.linear([p + "mlp.down_proj.weight"]))

    def __call__(self, ops: Any, x: torch.Tensor) -> torch.Tensor:
        return ops.linear(ops.gated_linear(x, self.gate_up, "gelu_tanh"), self.down)


@dataclass(slots=True)
class Gemma3Layer:
    input_norm: Any  # [hidden], 1 + w (all four)
    attn: Attention
    post_attn_norm: Any
    pre_ff_norm: Any
    mlp: GeluMLP
    post_ff_norm: Any


class Gemma3Model:
    """forward(ops, input_ids [T]) -> final normed hidden [T, hidden]; compute_logits."""

    def __init__(self, config: ModelConfig, embed: Any, layers: list[Gemma3Layer], norm: Any, lm_head: Any) -> None:
        self.config = config
        self.embed = embed
        self.layers = layers
        self.norm = norm
        self.lm_head = lm_head

    @classmethod
    def load(cls, w: WeightReader, config: ModelConfig) -> Gemma3Model:
        c, layers = config, []
        for i in range(c.num_hidden_layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            bias = [a + f"{x}_proj.bias" for x in "qkv"] if c.attention_bias else None
            attn = Attention(w.linear([a + f"{x}_proj.weight" for x in "qkv"], bias), w.linear([a + "o_proj.weight"]),
                             w.vector(a + "q_norm.weight", 1.0), w.vector(a + "k_norm.weight", 1.0))
            layers.append(Gemma3Layer(w.vector(p + "input_layernorm.weight", 1.0), attn,
                                      w.vector(p + "post_attention_layernorm.weight", 1.0),
                                      w.vector(p + "pre_feedforward_layernorm.weight", 1.0), GeluMLP.load(w, p),
                                      w.vector(p + "post_feedforward_layernorm.weight", 1.0)))
            w.release(p)
        embed = w.embedding("model.embed_tokens.weight", lm_head=c.tie_word_embeddings)
        lm_head = embed if c.tie_word_embeddings else w.linear(["lm_head.weight"], logits=True)
        return cls(c, embed, layers, w.vector("model.norm.weight", 1.0), lm_head)

    def forward(self, ops: Any, input_ids: torch.Tensor) -> torch.Tensor:
        c, layers = self.config, self.layers
        eps = c.rms_norm_eps
        h = ops.embed(input_ids, self.embed, c.hidden_size ** 0.5)  # the residual stream
        x = ops.rms_norm(h, layers[0].input_norm, eps)
        for i, layer in enumerate(layers):
            attn = ops.rms_norm(layer.attn(ops, i, x, c), layer.post_attn_norm, eps)
            x = ops.add_rms_norm(attn, h, layer.pre_ff_norm, eps)
            mlp = ops.rms_norm(layer.mlp(ops, x), layer.post_ff_norm, eps)
            nxt = layers[i + 1].input_norm if i + 1 < len(layers) else self.norm
            x = ops.add_rms_norm(mlp, h, nxt, eps)
        return x

    def compute_logits(self, ops: Any, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        logits = ops.logits(hidden, self.lm_head, out)
        cap = self.config.final_logit_softcapping
        return ops.soft_cap(logits, cap) if cap else logits


# ---- config.json / GGUF fields -------------------------------------------------------------------

def _pattern(layers: int, pattern: int = SLIDING_WINDOW_PATTERN) -> list[str]:
    return ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]


def _hf_fields(hf: dict[str, Any]) -> dict[str, Any]:
    act = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ConfigError(f"gemma3 with hidden_activation {act!r} is not supported (gelu_pytorch_tanh)")
    if hf.get("use_bidirectional_attention"):
        raise ConfigError("gemma3 with use_bidirectional_attention (an embedding model) is not supported")
    layers = hf["num_hidden_layers"]
    # rope: transformers >= 5 nests it per layer type; older configs have rope_theta (global),
    # rope_local_base_freq (local) and rope_scaling (global layers only)
    params = hf.get("rope_parameters")
    if isinstance(params, dict) and ("full_attention" in params or "sliding_attention" in params):
        full = dict(params.get("full_attention") or {})
        local = dict(params.get("sliding_attention") or {})
        theta = full.pop("rope_theta", 1_000_000.0)
        local_theta = local.pop("rope_theta", LOCAL_ROPE_THETA)
        scaling = full if full.get("rope_type", full.get("type", "default")) != "default" else None
        if local.get("rope_type", local.get("type", "default")) != "default":
            raise ConfigError(f"gemma3 sliding-window layers with rope scaling {local.get('rope_type')!r} are not supported")
    else:
        theta = hf.get("rope_theta", 1_000_000.0)
        local_theta = hf.get("rope_local_base_freq", LOCAL_ROPE_THETA)
        scaling = hf.get("rope_scaling")
    if isinstance(scaling, dict):
        scaling = {k: v for k, v in scaling.items() if k not in ("rope_theta", "partial_rotary_factor")}
        if scaling.get("rope_type", scaling.get("type")) in ("yarn", "llama3"):
            scaling.setdefault("original_max_position_embeddings", hf.get("max_position_embeddings", 131072))
    return {
        "rope_theta": float(theta), "rope_scaling": scaling, "rope_local_theta": float(local_theta),
        "sliding_window": int(hf.get("sliding_window") or 4096),
        "layer_types": list(hf.get("layer_types") or _pattern(layers, int(hf.get("sliding_window_pattern") or 6))),
        "query_pre_attn_scalar": float(hf.get("query_pre_attn_scalar") or 256),
        # attn_logit_softcapping is Gemma 2's: transformers' Gemma 3 attention does not apply it and
        # llama.cpp's converter asserts it is unset, so it is not read here either
        "final_logit_softcapping": float(hf.get("final_logit_softcapping") or 0.0),
        "head_dim": int(hf.get("head_dim") or 256),
        "rms_norm_eps": float(hf.get("rms_norm_eps", 1e-6)),
        "tie_word_embeddings": bool(hf.get("tie_word_embeddings", True)),
    }


def _gguf_fields(key: Any, layers: int) -> dict[str, Any]:
    # What llama.cpp's gemma3 loader fixes rather than reads: every sixth layer global, the local
    # RoPE base 10000 (unscaled), and scores scaled by head_dim ** -0.5 but for the 62-layer 27B,
    # whose query_pre_attn_scalar is hidden / heads.
    hidden, heads = int(key("embedding_length")), int(key("attention.head_count"))
    head_dim = int(key("attention.key_length", 256))
    window = int(key("attention.sliding_window", 0))
    return {
        "rope_local_theta": LOCAL_ROPE_THETA,
        "sliding_window": window,
        "layer_types": _pattern(layers) if window else None,
        "query_pre_attn_scalar": float(hidden // heads if layers == 62 else head_dim),
        "attn_logit_softcapping": float(key("attn_logit_softcapping", 0.0)),
        "final_logit_softcapping": float(key("final_logit_softcapping", 0.0)),
    }


def _minus_one(t: torch.Tensor, c: ModelConfig) -> torch.Tensor:
    return t - 1.0


# llama.cpp's gemma3 names: the llama ones, plus the sandwich norms (post_attention_norm is the
# norm of the attention output, ffn_norm the pre-feedforward one, post_ffw_norm the last).
GGUF_LAYER_NAMES = {
    **{k: v for k, v in LLAMA_GGUF_NAMES.items() if k != "ffn_norm.weight"},
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
# convert_hf_to_gguf.py's Gemma3Model stores every *norm.weight as 1 + w
GGUF_TRANSFORMS = {"model.norm.weight": _minus_one, **{n: _minus_one for n in NORMS}}


GEMMA3 = Architecture(
    name="gemma3", hf_architectures=("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration"),
    hf_model_types=("gemma3", "gemma3_text"), gguf_architecture="gemma3",
    weights=weights, layer_kinds=layer_kinds, model=Gemma3Model, quantizable=LINEAR_SUFFIXES, qk_norm=True,
    gguf_layer_names=GGUF_LAYER_NAMES, gguf_transforms=GGUF_TRANSFORMS, hf_fields=_hf_fields,
    gguf_fields=_gguf_fields)
