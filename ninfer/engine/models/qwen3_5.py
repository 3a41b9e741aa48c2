"""Qwen3.5 (text): a hybrid of Gated DeltaNet linear-attention layers and gated full attention.

Per layer, `layer_types` picks the token mixer; both are followed by the llama MLP:
- linear_attention: in_proj_qkv/z/b/a (fused into one projection) -> causal depthwise conv + SiLU
  over q|k|v -> the gated delta rule per value head (q/k l2-normalized; decay g = -exp(A_log) *
  softplus(a + dt_bias), write strength beta = sigmoid(b)) -> RMSNorm gated by silu(z) -> out_proj.
  Its state between steps is the conv window and the delta-rule matrix (RecurrentState).
- full_attention: q_proj yields each head's query and an output gate side by side; q/k RMSNorm,
  RoPE over the first partial_rotary_factor of each head, paged attention, output * sigmoid(gate).
RMSNorms other than the gated one scale by (1 + w) (Hugging Face stores w around 0); the loader
adds the 1 once.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ninfer.engine.config import ModelConfig
from ninfer.engine.models.llama import MLP, global_weights, mlp_weights, with_lm_head
from ninfer.engine.models.spec import ATTENTION, LINEAR_ATTENTION, Architecture, Shapes
from ninfer.engine.models.weights import WeightReader

LINEAR_SUFFIXES = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight",
                   "gate_proj.weight", "up_proj.weight", "down_proj.weight",
                   "in_proj_qkv.weight", "in_proj_z.weight", "in_proj_b.weight", "in_proj_a.weight",
                   "out_proj.weight", "embed_tokens.weight", "lm_head.weight")


def layer_kinds(c: ModelConfig) -> tuple[str, ...]:
    types = c.layer_types or ["full_attention"] * c.num_hidden_layers
    return tuple(LINEAR_ATTENTION if t == "linear_attention" else ATTENTION for t in types)


def _dims(c: ModelConfig) -> tuple[int, int, int]:
    """(key_dim, value_dim, conv_dim) of a linear-attention layer."""
    key_dim = c.linear_num_key_heads * c.linear_key_head_dim
    value_dim = c.linear_num_value_heads * c.linear_value_head_dim
    return key_dim, value_dim, 2 * key_dim + value_dim


def weights(c: ModelConfig) -> Shapes:
    shapes = global_weights(c)
    key_dim, value_dim, conv_dim = _dims(c)
    H, nv, q = c.hidden_size, c.linear_num_value_heads, c.num_attention_heads * c.head_dim
    kv = c.num_key_value_heads * c.head_dim
    linear = {
        "linear_attn.in_proj_qkv.weight": (conv_dim, H),
        "linear_attn.in_proj_z.weight": (value_dim, H),
        "linear_attn.in_proj_b.weight": (nv, H),
        "linear_attn.in_proj_a.weight": (nv, H),
        "linear_attn.conv1d.weight": (conv_dim, 1, c.linear_conv_kernel_dim),
        "linear_attn.dt_bias": (nv,),
        "linear_attn.A_log": (nv,),
        "linear_attn.norm.weight": (c.linear_value_head_dim,),
        "linear_attn.out_proj.weight": (H, value_dim),
    }
    full = {
        "self_attn.q_proj.weight": (2 * q, H),  # per head: query rows, then gate rows
        "self_attn.k_proj.weight": (kv, H),
        "self_attn.v_proj.weight": (kv, H),
        "self_attn.o_proj.weight": (H, q),
        "self_attn.q_norm.weight": (c.head_dim,),
        "self_attn.k_norm.weight": (c.head_dim,),
    }
    norm = {"input_layernorm.weight": (c.hidden_size,)}
    for i, kind in enumerate(layer_kinds(c)):
        per_layer = norm | (linear if kind == LINEAR_ATTENTION else full) | mlp_weights(c)
        shapes |= {f"model.layers.{i}.{sfx}": shape for sfx, shape in per_layer.items()}
    if c.mtp_layers:  # the multi-token-prediction head (speculative drafts): fc over [embedding | hidden], one layer
        shapes |= {"mtp.fc.weight": (H, 2 * H), "mtp.pre_fc_norm_embedding.weight": (H,),
                   "mtp.pre_fc_norm_hidden.weight": (H,), "mtp.norm.weight": (H,)}
        shapes |= {f"mtp.layers.0.{sfx}": shape for sfx, shape in (norm | full | mlp_weights(c)).items()}
    return with_lm_head(shapes, c)


@dataclass(slots=True)
class GatedAttention:
    qkvg: Any  # [(2 * heads + 2 * kv_heads) * head_dim, hidden]: q | k | v | gate
    o_proj: Any
    q_norm: Any  # [head_dim], 1 + w
    k_norm: Any

    @classmethod
    def load(cls, w: WeightReader, p: str, c: ModelConfig) -> GatedAttention:
        a = p + "self_attn."
        # q_proj rows are [head][query d | gate d]: split into all queries and all gates
        rows = torch.arange(2 * c.num_attention_heads * c.head_dim).view(c.num_attention_heads, 2, c.head_dim)
        query = w.select_rows(a + "q_proj.weight", rows[:, 0].reshape(-1), a + "q_proj.weight:query")
        gate = w.select_rows(a + "q_proj.weight", rows[:, 1].reshape(-1), a + "q_proj.weight:gate")
        return cls(w.linear([query, a + "k_proj.weight", a + "v_proj.weight", gate]),
                   w.linear([a + "o_proj.weight"]), w.vector(a + "q_norm.weight", 1.0),
                   w.vector(a + "k_norm.weight", 1.0))

    def __call__(self, ops: Any, layer: int, x: torch.Tensor, c: ModelConfig) -> torch.Tensor:
        qkv_size = (c.num_attention_heads + 2 * c.num_key_value_heads) * c.head_dim
        y = ops.linear(x, self.qkvg)
        out = ops.attention(layer, y[:, :qkv_size], self.q_norm, self.k_norm)
        return ops.linear(ops.sigmoid_gate(out, y[:, qkv_size:]), self.o_proj)


@dataclass(slots=True)
class GatedDeltaNet:
    in_proj: Any  # [conv_dim + value_dim + 2 * value_heads, hidden]: q|k|v, z, b, a
    conv: Any  # [conv_dim, conv_kernel] depthwise taps
    A_log: Any  # [value_heads]
    dt_bias: Any  # [value_heads]
    norm: Any  # [value_head_dim]
    out_proj: Any  # [hidden, value_dim]

    @classmethod
    def load(cls, w: WeightReader, p: str) -> GatedDeltaNet:
        a = p + "linear_attn."
        conv = w.float32(a + "conv1d.weight")
        return cls(w.linear([a + f"in_proj_{x}.weight" for x in ("qkv", "z", "b", "a")]),
                   w.ops.vector(conv.reshape(conv.shape[0], -1)), w.parameter(a + "A_log"), w.parameter(a + "dt_bias"),
                   w.vector(a + "norm.weight"), w.linear([a + "out_proj.weight"]))

    def __call__(self, ops: Any, layer: int, x: torch.Tensor, c: ModelConfig) -> torch.Tensor:
        key_dim, value_dim, conv_dim = _dims(c)
        T, nk, nv = x.shape[0], c.linear_num_key_heads, c.linear_num_value_heads
        dk, dv = c.linear_key_head_dim, c.linear_value_head_dim
        y = ops.linear(x, self.in_proj)
        z = y[:, conv_dim:conv_dim + value_dim]
        b, a = y[:, conv_dim + value_dim:conv_dim + value_dim + nv], y[:, conv_dim + value_dim + nv:]
        mixed = ops.short_conv(layer, y[:, :conv_dim], self.conv)  # [T, conv_dim]
        q = mixed[:, :key_dim].view(T, nk, dk)
        k = mixed[:, key_dim:2 * key_dim].view(T, nk, dk)
        v = mixed[:, 2 * key_dim:].view(T, nv, dv)
        out = ops.gated_delta_rule(layer, q, k, v, a, b, self.A_log, self.dt_bias)  # [T, nv, dv]
        out = ops.gated_rms_norm(out, z.view(T, nv, dv), self.norm, c.rms_norm_eps)  # [T, nv, dv]
        return ops.linear(out.reshape(T, value_dim), self.out_proj)


@dataclass(slots=True)
class HybridLayer:
    input_norm: Any  # [hidden], 1 + w
    mixer: GatedAttention | GatedDeltaNet
    index: int  # among the layers of its kind (attention layers and linear-attention layers count apart)
    post_norm: Any
    mlp: MLP


class Qwen3_5Model:
    """forward(ops, input_ids [T]) -> final normed hidden [T, hidden]; compute_logits."""

    def __init__(self, config: ModelConfig, embed: Any, layers: list[HybridLayer], norm: Any, lm_head: Any) -> None:
        self.config = config
        self.embed = embed
        self.layers = layers
        self.norm = norm
        self.lm_head = lm_head

    @classmethod
    def load(cls, w: WeightReader, config: ModelConfig) -> Qwen3_5Model:
        c = config
        layers, counts = [], {ATTENTION: 0, LINEAR_ATTENTION: 0}
        for i, kind in enumerate(layer_kinds(c)):
            p = f"model.layers.{i}."
            mixer = GatedDeltaNet.load(w, p) if kind == LINEAR_ATTENTION else GatedAttention.load(w, p, c)
            layers.append(HybridLayer(w.vector(p + "input_layernorm.weight", 1.0), mixer, counts[kind],
                                      w.vector(p + "post_attention_layernorm.weight", 1.0), MLP.load(w, p)))
            counts[kind] += 1
            w.release(p)
        embed = w.embedding("model.embed_tokens.weight", lm_head=c.tie_word_embeddings)
        lm_head = embed if c.tie_word_embeddings else w.linear(["lm_head.weight"], logits=True)
        return cls(c, embed, layers, w.vector("model.norm.weight", 1.0), lm_head)

    def forward(self, ops: Any, input_ids: torch.Tensor) -> torch.Tensor:
        eps, layers = self.config.rms_norm_eps, self.layers
        h = ops.embed(input_ids, self.embed)
        x = ops.rms_norm(h, layers[0].input_norm, eps)
        for i, layer in enumerate(layers):
            x = ops.add_rms_norm(layer.mixer(ops, layer.index, x, self.config), h, layer.post_norm, eps)
            nxt = layers[i + 1].input_norm if i + 1 < len(layers) else self.norm
            x = layer.mlp.add_norm(ops, x, h, nxt, eps)
        return x

    def compute_logits(self, ops: Any, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        return ops.logits(hidden, self.lm_head, out)


class MtpHead:
    """Qwen3.5's multi-token-prediction head (`mtp.*`): from the target's final normed hidden h_p
    at position p and the embedding of token p + 1, one full-attention layer with its own K/V
    predicts token p + 2 through the shared lm_head:
        x = fc([norm_e(embed(t_{p+1})) | norm_h(h_p)]); x = layer(x at position p); out = norm(x).
    Drafting chains it: its normed output stands in for h at the next position. Its attention layer
    is attention layer 0 of a K/V cache of its own (the runner's), addressed by the sequence's pages.
    """

    def __init__(self, config: ModelConfig, embed_norm: Any, hidden_norm: Any, fc: Any, layer: HybridLayer,
                 norm: Any) -> None:
        self.config, self.embed_norm, self.hidden_norm, self.fc = config, embed_norm, hidden_norm, fc
        self.layer, self.norm = layer, norm

    @classmethod
    def load(cls, w: WeightReader, config: ModelConfig) -> MtpHead:
        p = "mtp.layers.0."
        layer = HybridLayer(w.vector(p + "input_layernorm.weight", 1.0), GatedAttention.load(w, p, config), 0,
                            w.vector(p + "post_attention_layernorm.weight", 1.0), MLP.load(w, p))
        head = cls(config, w.vector("mtp.pre_fc_norm_embedding.weight", 1.0),
                   w.vector("mtp.pre_fc_norm_hidden.weight", 1.0), w.linear(["mtp.fc.weight"]), layer,
                   w.vector("mtp.norm.weight", 1.0))
        w.release("mtp.")
        return head

    def forward(self, ops: Any, model: Qwen3_5Model, hidden: torch.Tensor, next_ids: torch.Tensor) -> torch.Tensor:
        """hidden [T, hidden] (the target's final normed hidden, or the head's own output when
        chaining), next_ids [T] -> the head's normed output [T, hidden] (logits: model.compute_logits)."""
        eps, layer = self.config.rms_norm_eps, self.layer
        emb = ops.embed(next_ids, model.embed)  # in the backend's residual dtype
        e = ops.rms_norm(emb, self.embed_norm, eps)
        h = ops.rms_norm(hidden, self.hidden_norm, eps)
        res = ops.linear(torch.cat([e, h], dim=-1), self.fc).to(emb.dtype)  # [T, hidden] residual
        x = ops.rms_norm(res, layer.input_norm, eps)
        x = ops.add_rms_norm(layer.mixer(ops, 0, x, self.config), res, layer.post_norm, eps)
        return layer.mlp.add_norm(ops, x, res, self.norm, eps)


# ---- llama.cpp GGUF (`qwen35`) ------------------------------------------------------------------
# As convert_hf_to_gguf.py writes it (Qwen3_5TextModel on Qwen3NextModel): per-layer names from
# gguf-py's tensor map for MODEL_ARCH.QWEN35; the 1 + w norms stored with the 1 added; A_log
# stored as A = -exp(A_log) (`ssm_a`, no .weight suffix); dt_bias renamed `ssm_dt.bias`; conv1d
# taps squeezed to [conv_dim, kernel]; and, when there are more value heads than key heads
# (_LinearAttentionVReorderBase), every value-head axis reordered from grouped by key head
# (k0: v0..v{r-1}, k1: ...) to tiled (v0 of every k, then v1 of every k, ...).
GGUF_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "attn_q.weight": "self_attn.q_proj.weight",  # per head [query | gate], as Hugging Face has it
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "attn_qkv.weight": "linear_attn.in_proj_qkv.weight",
    "attn_gate.weight": "linear_attn.in_proj_z.weight",
    "ssm_beta.weight": "linear_attn.in_proj_b.weight",
    "ssm_alpha.weight": "linear_attn.in_proj_a.weight",
    "ssm_conv1d.weight": "linear_attn.conv1d.weight",
    "ssm_a": "linear_attn.A_log",
    "ssm_dt.bias": "linear_attn.dt_bias",
    "ssm_norm.weight": "linear_attn.norm.weight",
    "ssm_out.weight": "linear_attn.out_proj.weight",
}


def untile_value_heads(t: torch.Tensor, dim: int, c: ModelConfig, head_dim: int) -> torch.Tensor:
    """Undo llama.cpp's value-head reorder along `dim` (units of head_dim): tiled [r, key_heads]
    back to grouped [key_heads, r], r = value heads per key head."""
    nk, r = c.linear_num_key_heads, c.linear_num_value_heads // c.linear_num_key_heads
    if r == 1:
        return t
    dim %= t.dim()
    shape = t.shape
    return t.reshape(*shape[:dim], r, nk, head_dim, *shape[dim + 1:]).transpose(dim, dim + 1).reshape(shape)


def _untile_v_rows(t: torch.Tensor, c: ModelConfig) -> torch.Tensor:
    # q|k|v rows (or conv channels): only the v part is per value head
    qk = 2 * c.linear_num_key_heads * c.linear_key_head_dim
    return torch.cat([t[:qk], untile_value_heads(t[qk:], 0, c, c.linear_value_head_dim)])


def _minus_one(t: torch.Tensor, c: ModelConfig) -> torch.Tensor:
    return t - 1.0


# HF name (after `model.layers.N.`, or whole for global tensors) -> f(tensor as the GGUF holds it
# (float32, or an index tensor standing for a quantized weight's elements), config) -> HF tensor.
GGUF_TRANSFORMS = {
    "model.norm.weight": _minus_one,
    "input_layernorm.weight": _minus_one,
    "post_attention_layernorm.weight": _minus_one,
    "self_attn.q_norm.weight": _minus_one,
    "self_attn.k_norm.weight": _minus_one,
    "linear_attn.in_proj_qkv.weight": _untile_v_rows,
    "linear_attn.in_proj_z.weight": lambda t, c: untile_value_heads(t, 0, c, c.linear_value_head_dim),
    "linear_attn.in_proj_b.weight": lambda t, c: untile_value_heads(t, 0, c, 1),
    "linear_attn.in_proj_a.weight": lambda t, c: untile_value_heads(t, 0, c, 1),
    "linear_attn.A_log": lambda t, c: torch.log(-untile_value_heads(t, 0, c, 1)),
    "linear_attn.dt_bias": lambda t, c: untile_value_heads(t, 0, c, 1),
    "linear_attn.conv1d.weight": lambda t, c: _untile_v_rows(t, c).unsqueeze(1),  # [conv_dim, 1, kernel]
    "linear_attn.out_proj.weight": lambda t, c: untile_value_heads(t, 1, c, c.linear_value_head_dim),
}


QWEN3_5 = Architecture(
    name="qwen3_5", hf_architectures=("Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration"),
    hf_model_types=("qwen3_5", "qwen3_5_text"), gguf_architecture="qwen35",
    weights=weights, layer_kinds=layer_kinds, model=Qwen3_5Model, quantizable=LINEAR_SUFFIXES, qk_norm=True,
    gguf_layer_names=GGUF_LAYER_NAMES, gguf_transforms=GGUF_TRANSFORMS, mtp_head=MtpHead)
