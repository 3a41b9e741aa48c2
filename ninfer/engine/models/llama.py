"""Llama (SmolLM2, Llama 3) in plain torch, over a flat token batch and a paged KV cache.

Weights come from a .ninfer artifact in Hugging Face layout. At load, q/k/v and gate/up are
fused into one matmul each; quantized weights are expanded to the compute dtype (and, for int4
on CPU in bf16, also kept packed for the decode kernel, see layers.Linear).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ninfer.engine.artifact import Artifact
from ninfer.engine.config import ModelConfig
from ninfer.engine.models.layers import (AttentionMetadata, KVCache, Linear, RotaryEmbedding, apply_rotary,
                                         packable, paged_attention, rms_norm)
from ninfer.engine.quant import TensorFormat, dequantize


class DecoderLayer:
    __slots__ = ("input_norm", "qkv", "qk_norm", "o_proj", "post_norm", "gate_up", "down")

    def __init__(self, input_norm: torch.Tensor, qkv: Linear, o_proj: Linear, post_norm: torch.Tensor,
                 gate_up: Linear, down: Linear, qk_norm: torch.Tensor | None = None) -> None:
        self.input_norm = input_norm  # [hidden] float32 (as are all norm weights)
        self.qkv = qkv  # [(heads + 2 * kv_heads) * head_dim, hidden]
        self.qk_norm = qk_norm  # [heads + kv_heads, head_dim]: q_norm per q head, then k_norm per k head (qwen3)
        self.o_proj = o_proj  # [hidden, heads * head_dim]
        self.post_norm = post_norm
        self.gate_up = gate_up  # [2 * intermediate, hidden]
        self.down = down  # [hidden, intermediate]


class _WeightLoader:
    """Reads an artifact's stored parts and builds compute-dtype tensors and Linears."""

    def __init__(self, artifact: Artifact, dtype: torch.dtype, device: torch.device, pack: bool) -> None:
        self.parts = artifact.load_parts(device)  # expand on the target device (fast on a GPU)
        self.formats = artifact.meta.tensor_formats
        self.dtype = dtype
        self.device = device
        self.pack = pack

    def tensor(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        return dequantize(self.formats[name], self.parts[name], dtype or self.dtype)

    def linear(self, names: list[str], bias_names: list[str] | None = None) -> Linear:
        """One Linear whose rows are the named weights stacked in order (a fused projection)."""
        weight = torch.cat([dequantize(self.formats[n], self.parts[n], self.dtype) for n in names])
        bias = None
        if bias_names:
            bias = torch.cat([self.tensor(n) for n in bias_names])
        lin = Linear(weight.contiguous(), bias)
        fmts = {self.formats[n] for n in names}
        if self.pack and len(fmts) == 1:
            fmt: TensorFormat = next(iter(fmts))
            if packable(fmt, tuple(weight.shape)):
                if fmt.format == "int4":
                    lin.attach_int4(fmt, [self.parts[n] for n in names])
                else:
                    lin.attach_int8(fmt, [self.parts[n] for n in names])
        return lin


class LlamaModel:
    """forward(input_ids [T], positions [T], meta, kv) -> hidden [T, hidden]; compute_logits."""

    qk_norm = False  # qwen3 adds per-head RMSNorm on q and k before RoPE

    def __init__(self, config: ModelConfig, embed: torch.Tensor, layers: list[DecoderLayer],
                 norm: torch.Tensor, lm_head: Linear, dtype: torch.dtype, device: torch.device,
                 attn_dtype: torch.dtype | None = None) -> None:
        self.config = config
        self.embed = embed  # [vocab, hidden]
        self.layers = layers
        self.norm = norm
        self.lm_head = lm_head  # [vocab, hidden]; shares `embed` when tied
        self.dtype = dtype  # weights and matmul inputs
        self.attn_dtype = attn_dtype or dtype  # q/k/v, RoPE and the KV cache
        self.device = device
        self.rope = RotaryEmbedding(config, self.attn_dtype, device)

    @classmethod
    def from_artifact(cls, artifact: Artifact, dtype: torch.dtype, device: torch.device,
                      attn_dtype: torch.dtype | None = None, pack: bool = False) -> LlamaModel:
        """Build from a validated artifact. dtype: weights and matmuls; attn_dtype (default dtype):
        attention and KV; pack keeps int4/int8 weights packed too, for the decode kernel (CPU, bf16)."""
        c = artifact.meta.config
        w = _WeightLoader(artifact, dtype, device, pack)
        f32 = torch.float32
        layers = []
        for i in range(c.num_hidden_layers):
            p = f"model.layers.{i}."
            attn = [p + f"self_attn.{x}_proj.weight" for x in "qkv"]
            bias = [p + f"self_attn.{x}_proj.bias" for x in "qkv"] if c.attention_bias else None
            qk_norm = None
            if cls.qk_norm:
                qk_norm = torch.cat((w.tensor(p + "self_attn.q_norm.weight", f32).expand(c.num_attention_heads, -1),
                                     w.tensor(p + "self_attn.k_norm.weight", f32).expand(c.num_key_value_heads, -1)))
            layers.append(DecoderLayer(
                input_norm=w.tensor(p + "input_layernorm.weight", f32),
                qkv=w.linear(attn, bias),
                o_proj=w.linear([p + "self_attn.o_proj.weight"]),
                post_norm=w.tensor(p + "post_attention_layernorm.weight", f32),
                gate_up=w.linear([p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"]),
                down=w.linear([p + "mlp.down_proj.weight"]),
                qk_norm=qk_norm,
            ))
        lm_head = w.linear(["model.embed_tokens.weight" if c.tie_word_embeddings else "lm_head.weight"])
        embed = lm_head.weight if c.tie_word_embeddings else w.tensor("model.embed_tokens.weight")
        return cls(c, embed, layers, w.tensor("model.norm.weight", f32), lm_head, dtype, device, attn_dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv: KVCache) -> torch.Tensor:
        """Run all layers over the flat batch, writing its K/V into the cache. -> [T, hidden] in the
        compute dtype. The residual stream stays float32 whatever the compute dtype (matmul inputs
        are cast), which keeps bf16 runs close to the float32 reference for a few casts."""
        c = self.config
        eps, dtype, attn_dtype = c.rms_norm_eps, self.dtype, self.attn_dtype
        num_tokens = input_ids.shape[0]
        heads, kv_heads, head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        cos, sin = self.rope.lookup(positions, meta.max_pos)  # [T, 1, head_dim]
        h = F.embedding(input_ids, self.embed).float()  # [T, hidden] residual
        for i, layer in enumerate(self.layers):
            qkv = layer.qkv(rms_norm(h, layer.input_norm, eps).to(dtype)).to(attn_dtype)
            # q and k side by side as [T, heads + kv_heads, head_dim]: one norm and one RoPE for both
            qk = qkv[:, :(heads + kv_heads) * head_dim].view(num_tokens, heads + kv_heads, head_dim)
            v = qkv[:, (heads + kv_heads) * head_dim:].view(num_tokens, kv_heads, head_dim)
            if layer.qk_norm is not None:
                qk = (rms_norm(qk, None, eps) * layer.qk_norm).to(attn_dtype)
            qk = apply_rotary(qk, cos, sin)
            attn = paged_attention(qk[:, :heads], qk[:, heads:], v, kv.k[i], kv.v[i], meta)  # [T, heads * d]
            h = h + layer.o_proj(attn.to(dtype))
            gate, up = layer.gate_up(rms_norm(h, layer.post_norm, eps).to(dtype)).split(c.intermediate_size, dim=-1)
            h = h + layer.down(F.silu(gate) * up)
        return rms_norm(h, self.norm, eps).to(dtype)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [n, hidden] -> logits [n, vocab] float32."""
        return self.lm_head(hidden, torch.float32)
