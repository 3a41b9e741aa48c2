"""The record every architecture fills in once: names, name maps, weight table, layer kinds,
state spec and capabilities. Everything outside `models/` learns an architecture from it."""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ninfer.engine.rope import Rope

if TYPE_CHECKING:
    from ninfer.engine.config import ModelConfig

# Layer kinds, and the state each keeps between steps.
ATTENTION = "attention"  # paged K/V: any prefix can be resumed
LINEAR_ATTENTION = "linear_attention"  # recurrent: conv window + delta-rule state, resumable only at a checkpoint

Shapes = dict[str, tuple[int, ...]]


@dataclass(frozen=True, slots=True)
class AttentionState:
    """Paged K/V of one attention layer: per token, kv_heads x head_dim for K and for V."""

    kv_heads: int
    head_dim: int

    def bytes_per_token(self, elem: int) -> int:
        return 2 * self.kv_heads * self.head_dim * elem


@dataclass(frozen=True, slots=True)
class RecurrentState:
    """Fixed-size state of one linear-attention layer per sequence: the causal conv's last
    conv_kernel - 1 inputs ([conv_dim, conv_kernel - 1], activation dtype) and the delta-rule matrix
    per value head ([value_heads, key_dim, value_dim], float32)."""

    conv_dim: int
    conv_kernel: int
    value_heads: int
    key_dim: int
    value_dim: int

    def bytes(self, elem: int) -> int:
        return self.conv_dim * (self.conv_kernel - 1) * elem + self.value_heads * self.key_dim * self.value_dim * 4


@dataclass(frozen=True, slots=True)
class Architecture:
    """One architecture, defined once.

    weights(config) -> every tensor it needs (Hugging Face names -> logical shape; [out, in] for a
    linear weight). layer_kinds(config) -> ATTENTION or LINEAR_ATTENTION per layer. gguf_layer_names
    maps llama.cpp's per-layer tensor suffixes (after `blk.N.`) to Hugging Face suffixes (after
    `model.layers.N.`); gguf_transforms undoes what llama.cpp's converter changed (Hugging Face
    suffix -> function(tensor, config) -> tensor). model is the class holding `load` and the one
    `forward`.
    """

    name: str
    hf_architectures: tuple[str, ...]  # config.json `architectures` entries
    hf_model_types: tuple[str, ...]  # config.json `model_type` values
    gguf_architecture: str  # GGUF `general.architecture`
    weights: Callable[[ModelConfig], Shapes]
    layer_kinds: Callable[[ModelConfig], tuple[str, ...]]
    model: type
    gguf_layer_names: Mapping[str, str] = field(default_factory=dict)
    quantizable: tuple[str, ...] = ()  # name suffixes of weights that may be stored quantized
    qk_norm: bool = False  # per-head RMSNorm on q and k before RoPE
    gguf_transforms: Mapping[str, Callable] = field(default_factory=dict)
    # config.json (the text model's dict) -> ModelConfig fields this architecture reads itself
    # (sliding window layout, per-layer RoPE bases, score scale, soft-capping)
    hf_fields: Callable[[dict[str, Any]], dict[str, Any]] | None = None
    # GGUF fields, `key(name, default)` reading `{arch}.name` -> ModelConfig fields of its own
    gguf_fields: Callable[[Callable[..., Any], int], dict[str, Any]] | None = None
    mtp_head: type | None = None  # the multi-token-prediction head class (when config.mtp_layers)

    def is_quantizable(self, name: str) -> bool:
        return name.endswith(self.quantizable)

    def attention_state(self, config: ModelConfig) -> AttentionState:
        return AttentionState(config.num_key_value_heads, config.head_dim)

    def recurrent_state(self, config: ModelConfig) -> RecurrentState | None:
        """The state of its linear-attention layers, None when it has none."""
        if LINEAR_ATTENTION not in self.layer_kinds(config):
            return None
        c = config
        key_dim, value_dim = c.linear_num_key_heads * c.linear_key_head_dim, c.linear_num_value_heads * c.linear_value_head_dim
        return RecurrentState(conv_dim=2 * key_dim + value_dim, conv_kernel=c.linear_conv_kernel_dim,
                              value_heads=c.linear_num_value_heads, key_dim=c.linear_key_head_dim,
                              value_dim=c.linear_value_head_dim)


@dataclass(frozen=True, slots=True)
class LayerAttention:
    """How one attention layer attends: its RoPE, and its window (0: every earlier position; w: the
    last w positions, its own included, as transformers' sliding-window mask has it)."""

    rope: Rope
    window: int = 0


def attention_layers(c: ModelConfig) -> tuple[LayerAttention, ...]:
    """Per attention layer (attention layers counted alone, as ops.attention's `layer`): its RoPE
    and window, from layer_types ("sliding_attention": sliding_window, and the rope_local_theta
    base when the model has one; its scaling is then none, as gemma3 has it)."""
    dim = int(c.head_dim * c.partial_rotary_factor)
    full = Rope.of(dim, c.rope_theta, c.rope_scaling)
    local = Rope.of(dim, c.rope_local_theta, None) if c.rope_local_theta else full
    types = c.layer_types or ["full_attention"] * c.num_hidden_layers
    return tuple(LayerAttention(local, c.sliding_window) if t == "sliding_attention" else LayerAttention(full)
                 for t in types if t != "linear_attention")


@dataclass(frozen=True, slots=True)
class StateSpec:
    """What a model keeps per layer: the engine sizes one pool per kind from it."""

    kinds: tuple[str, ...]  # per layer
    attention: AttentionState
    recurrent: RecurrentState | None

    @property
    def num_attention_layers(self) -> int:
        return self.kinds.count(ATTENTION)

    @property
    def num_recurrent_layers(self) -> int:
        return self.kinds.count(LINEAR_ATTENTION)

    def kv_bytes_per_token(self, elem: int) -> int:
        """K and V bytes per token over all attention layers (elem: bytes per KV element)."""
        return self.num_attention_layers * self.attention.bytes_per_token(elem)

    def state_bytes_per_slot(self, elem: int) -> int:
        """Recurrent state bytes of one sequence over all linear-attention layers."""
        return self.num_recurrent_layers * self.recurrent.bytes(elem) if self.recurrent else 0
