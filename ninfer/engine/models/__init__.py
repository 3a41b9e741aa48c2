"""The architecture registry: one record per architecture (models/<arch>.py), looked up by name.

Tensor names follow Hugging Face. Shapes are logical ([out, in] for a linear weight), whatever
format the artifact stores them in.
"""
from __future__ import annotations

from ninfer.engine.config import ModelConfig
from ninfer.engine.models.gemma3 import GEMMA3
from ninfer.engine.models.llama import LLAMA
from ninfer.engine.models.qwen2 import QWEN2
from ninfer.engine.models.qwen3 import QWEN3
from ninfer.engine.models.qwen3_5 import QWEN3_5
from ninfer.engine.models.spec import Architecture, StateSpec

ARCHITECTURES: dict[str, Architecture] = {a.name: a for a in (LLAMA, QWEN2, QWEN3, QWEN3_5, GEMMA3)}


def architecture(config_or_name: ModelConfig | str) -> Architecture:
    name = config_or_name if isinstance(config_or_name, str) else config_or_name.architecture
    return ARCHITECTURES[name]


def expected_weights(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the architecture needs, name -> logical shape."""
    return architecture(config).weights(config)


def state_spec(config: ModelConfig) -> StateSpec:
    """What each layer of this model keeps between steps."""
    arch = architecture(config)
    return StateSpec(arch.layer_kinds(config), arch.attention_state(config), arch.recurrent_state(config))


def is_quantizable(name: str, config: ModelConfig | None = None) -> bool:
    """Whether a weight may be stored quantized (2-D linear weights and the embedding); without a
    config, by any architecture's rules."""
    archs = [architecture(config)] if config is not None else list(ARCHITECTURES.values())
    return any(a.is_quantizable(name) for a in archs)
