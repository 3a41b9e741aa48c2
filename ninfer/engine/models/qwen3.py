"""Qwen3 (dense) in plain torch: the llama blocks plus a per-head RMSNorm on q and k before RoPE
(`self_attn.q_norm` / `self_attn.k_norm`, [head_dim] each). Tied and untied embeddings both load
through LlamaModel.from_artifact."""
from __future__ import annotations

from ninfer.engine.models.llama import LlamaModel


class Qwen3Model(LlamaModel):
    qk_norm = True
