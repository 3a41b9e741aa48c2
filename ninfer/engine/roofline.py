"""What a model must move and compute per token, and how close a measured rate comes to the
hardware's ceilings (the roofline columns of `ninfer bench`).

The accounting is the minimum any implementation must do, from the model's own record:
- bytes: every stored weight is read once per forward step (its size from its weight format's
  stored parts, as the artifact holds it), except the embedding table, of which a step reads one
  row per token (a tied lm_head reads the whole table once more). Each decoded token also reads
  the K/V of its context (attention layers) and reads and writes its recurrent state (linear-
  attention layers: conv window + delta-rule matrix).
- FLOPs: 2 per weight element of every matrix applied to a token (linear projections, the conv1d,
  the lm_head for sampled rows), causal attention 4 * heads * head_dim per (query, visible key)
  pair (QK^T and PV), and the delta rule 7 * key_dim * value_dim per value head and token (decay,
  S^T k, the rank-1 update, S^T q).
Pure: no torch, no device. The probes that measure the ceilings live in ninfer/kernels/probes.py.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping

from ninfer.engine.config import ModelConfig
from ninfer.engine.models import expected_weights, state_spec
from ninfer.formats import TensorFormat

if TYPE_CHECKING:
    from ninfer.kernels.probes import Ceilings

EMBEDDING = "model.embed_tokens.weight"
DELTA_RULE_FLOPS = 7  # per key_dim x value_dim element, per value head and token (see the docstring)


def stored_bytes(fmt: TensorFormat, shape: tuple[int, ...]) -> int:
    """Bytes of a weight of logical `shape` stored in `fmt` (all its stored parts)."""
    dtypes = fmt.stored_dtypes()
    return sum(math.prod(s) * dtypes[sfx].itemsize for sfx, s in fmt.stored_shapes(shape).items())


@dataclass(frozen=True, slots=True)
class ModelCost:
    """Per-model constants of the accounting (see the module docstring).

    step_weight_bytes: weights one forward step reads, whatever its token count (the embedding
    table excluded, a tied lm_head's full table included). embed_row_bytes: one embedding row.
    matmul_flops_per_token: 2 x elements of every matrix a token goes through, the lm_head
    excluded. head_flops: the lm_head for one sampled row. attention_flops_per_key: per query
    token and visible key, all attention layers. kv_bytes_per_token: K and V of one context token,
    all attention layers. state_bytes: one sequence's recurrent state, all layers (0 without).
    """

    step_weight_bytes: int
    embed_row_bytes: int
    matmul_flops_per_token: int
    head_flops: int
    attention_flops_per_key: int
    recurrent_flops_per_token: int
    kv_bytes_per_token: int
    state_bytes: int

    def decode_bytes_per_token(self, context: float, concurrency: int = 1) -> float:
        """Bytes per generated token when `concurrency` sequences decode together (one weight read
        per step, shared), each attending `context` keys on average."""
        return (self.step_weight_bytes / concurrency + self.embed_row_bytes + self.kv_bytes_per_token * context
                + 2 * self.state_bytes)

    def decode_flops_per_token(self, context: float) -> float:
        return (self.matmul_flops_per_token + self.head_flops + self.attention_flops_per_key * context
                + self.recurrent_flops_per_token)

    def prompt_flops(self, tokens: int, start: int = 0) -> float:
        """FLOPs of prefilling `tokens` tokens after `start` cached ones, sampling the last one."""
        keys = tokens * start + tokens * (tokens + 1) / 2  # token i (0-based) sees start + i + 1 keys
        return (tokens * (self.matmul_flops_per_token + self.recurrent_flops_per_token)
                + self.attention_flops_per_key * keys + self.head_flops)

    def prompt_bytes(self, tokens: int) -> float:
        """Bytes of prefilling `tokens` tokens: the weights once, a row, a K/V write per token, the
        state read and written once."""
        return (self.step_weight_bytes + tokens * (self.embed_row_bytes + self.kv_bytes_per_token)
                + 2 * self.state_bytes)


def model_cost(config: ModelConfig, formats: Mapping[str, TensorFormat], kv_elem: int,
               state_elem: int | None = None) -> ModelCost:
    """The accounting of a model whose weights are stored in `formats` (name -> format, as the
    artifact's tensor_formats), with K/V elements of `kv_elem` bytes and conv windows of
    `state_elem` bytes (default kv_elem; delta-rule matrices are fp32)."""
    shapes = expected_weights(config)
    spec = state_spec(config)
    weight_bytes = embed_row = matmul = 0
    for name, shape in shapes.items():
        size = stored_bytes(formats[name], shape)
        if name == EMBEDDING:
            embed_row = math.ceil(size / shape[0])
            if config.tie_word_embeddings:
                weight_bytes += size  # the lm_head reads the whole table
            continue
        weight_bytes += size
        if len(shape) >= 2 and name != "lm_head.weight":
            matmul += 2 * math.prod(shape)
    a = spec.attention
    heads = config.num_attention_heads
    r = spec.recurrent
    return ModelCost(
        step_weight_bytes=weight_bytes,
        embed_row_bytes=embed_row,
        matmul_flops_per_token=matmul,
        head_flops=2 * config.vocab_size * config.hidden_size,
        attention_flops_per_key=spec.num_attention_layers * 4 * heads * a.head_dim,
        recurrent_flops_per_token=(spec.num_recurrent_layers * DELTA_RULE_FLOPS * r.value_heads * r.key_dim
                                   * r.value_dim) if r else 0,
        kv_bytes_per_token=spec.kv_bytes_per_token(kv_elem),
        state_bytes=spec.state_bytes_per_slot(state_elem if state_elem is not None else kv_elem),
    )


def decode_context(prompt_tokens: int, n_gen: int) -> float:
    """Mean context of the timed decode steps of a tg test: after a prompt of P tokens the first
    token comes from the prefill, then steps at positions P .. P + n_gen - 2 attend P + 1 ..
    P + n_gen - 1 keys."""
    if n_gen < 2:
        return float(prompt_tokens)
    return prompt_tokens + n_gen / 2


def roofline_fields(cost: ModelCost, *, n_prompt: int, n_gen: int, n_depth: int, concurrency: int,
                    tokens_per_s: float, ceilings: Ceilings | None) -> dict:
    """The roofline columns of one bench row: bytes and FLOPs per token, the achieved GB/s and
    TFLOP/s, and (with ceilings) their ratios to the read bandwidth and the matmul peak."""
    if n_prompt:
        flops = cost.prompt_flops(n_prompt, n_depth) / n_prompt
        nbytes = cost.prompt_bytes(n_prompt) / n_prompt
    else:
        context = decode_context(max(n_depth, 1), n_gen)
        flops = cost.decode_flops_per_token(context)
        nbytes = cost.decode_bytes_per_token(context, concurrency)
    gbs, tflops = nbytes * tokens_per_s / 1e9, flops * tokens_per_s / 1e12
    fields = {"bytes_per_token": int(round(nbytes)), "flops_per_token": int(round(flops)),
              "achieved_gbs": gbs, "achieved_tflops": tflops}
    if ceilings is not None:
        fields |= {"bandwidth_ratio": gbs / ceilings.read_gbs if ceilings.read_gbs > 0 else None,
                   "matmul_ratio": tflops / ceilings.matmul_tflops if ceilings.matmul_tflops > 0 else None,
                   "ceilings": ceilings.to_dict()}
    return fields
