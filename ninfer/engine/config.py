"""Small config dataclasses grouped by concern, validated on construction."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from ninfer.engine.rope import check_scaling
from ninfer.errors import ConfigError

LAYER_TYPES = ("full_attention", "sliding_attention", "linear_attention")


def _architectures():  # the registry imports this module, so it is looked up on use
    from ninfer.engine.models import ARCHITECTURES

    return ARCHITECTURES


@dataclass(slots=True)
class ModelConfig:
    """Shape and numerics of a decoder-only transformer; field names follow Hugging Face."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    partial_rotary_factor: float = 1.0  # RoPE rotates the first head_dim * this dims of each head
    # sliding-window attention: layer_types "sliding_attention" layers see the last sliding_window
    # positions (their own included); their RoPE base is rope_local_theta when set (gemma3), else rope_theta
    sliding_window: int = 0
    rope_local_theta: float = 0.0
    query_pre_attn_scalar: float = 0.0  # attention scores scaled by this ** -0.5 (0: head_dim)
    attn_logit_softcapping: float = 0.0  # scores -> cap * tanh(score / cap) (0: none)
    final_logit_softcapping: float = 0.0  # logits -> cap * tanh(logit / cap) (0: none)
    # hybrid models (qwen3_5): per-layer "full_attention" / "linear_attention", and the Gated DeltaNet shape
    layer_types: list[str] | None = None
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 0
    mtp_layers: int = 0  # qwen3_5: multi-token-prediction layers the artifact carries (mtp.*; 0 or 1)

    def __post_init__(self) -> None:
        archs = _architectures()
        if self.architecture not in archs:
            raise ConfigError(f"unknown architecture {self.architecture!r} (supported: {', '.join(archs)})")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"model config field {name} must be a positive integer, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError("num_attention_heads must be a multiple of num_key_value_heads")
        check_scaling(self.rope_scaling)
        for name in ("sliding_window", "rope_local_theta", "query_pre_attn_scalar", "attn_logit_softcapping",
                     "final_logit_softcapping"):
            if getattr(self, name) < 0:
                raise ConfigError(f"model config field {name} must be >= 0, got {getattr(self, name)!r}")
        if not 0.0 < self.partial_rotary_factor <= 1.0 or int(self.head_dim * self.partial_rotary_factor) % 2:
            raise ConfigError(f"partial_rotary_factor {self.partial_rotary_factor} must give an even number "
                              f"of rotary dims in 2..{self.head_dim}")
        if self.mtp_layers not in (0, 1):
            raise ConfigError(f"mtp_layers must be 0 or 1 (one MTP layer is supported), got {self.mtp_layers!r}")
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_hidden_layers or any(t not in LAYER_TYPES for t in self.layer_types):
                raise ConfigError(f"layer_types must list {', '.join(LAYER_TYPES)} for each of the "
                                  f"{self.num_hidden_layers} layers")
            if "sliding_attention" in self.layer_types and self.sliding_window <= 0:
                raise ConfigError("sliding_attention layers need a positive sliding_window")
            if "linear_attention" in self.layer_types:
                for name in ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                             "linear_value_head_dim", "linear_conv_kernel_dim"):
                    value = getattr(self, name)
                    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                        raise ConfigError(f"model config field {name} must be a positive integer, got {value!r}")
                if self.linear_num_value_heads % self.linear_num_key_heads:
                    raise ConfigError("linear_num_value_heads must be a multiple of linear_num_key_heads")

    @property
    def qk_norm(self) -> bool:
        return _architectures()[self.architecture].qk_norm

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        missing = [f.name for f in dataclasses.fields(cls)
                   if f.name not in data and f.default is dataclasses.MISSING]
        if missing:
            raise ConfigError(f"model config is missing {', '.join(missing)}")
        return cls(**{k: v for k, v in data.items() if k in names})

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> ModelConfig:
        """Build from a Hugging Face `config.json` dict."""
        archs = hf.get("architectures") or []
        known = _architectures().values()
        record = next((r for a in archs for r in known if a in r.hf_architectures), None)
        if record is None:
            record = next((r for r in known if hf.get("model_type") in r.hf_model_types), None)
        if record is None:
            raise ConfigError(f"unknown architecture {archs or hf.get('model_type')!r} (supported: "
                              + ", ".join(n for r in known for n in r.hf_architectures) + ")")
        if isinstance(hf.get("text_config"), dict):  # a multimodal checkpoint: its language model
            outer = {k: hf[k] for k in ("tie_word_embeddings",) if k in hf}
            hf = {**outer, **hf["text_config"], "architectures": archs}
        layer_types = hf.get("layer_types")
        if not layer_types and hf.get("linear_num_value_heads"):
            # transformers' rule when a hybrid config lists no layer_types: every
            # full_attention_interval-th layer (default 4) is full attention
            interval = int(hf.get("full_attention_interval") or 4)
            layer_types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                           for i in range(hf["num_hidden_layers"])]
        heads = hf["num_attention_heads"]
        rope_scaling = hf.get("rope_scaling")
        rope_theta = hf.get("rope_theta")
        rope_parameters = hf.get("rope_parameters")  # transformers >= 5 folds theta in here
        if isinstance(rope_parameters, dict):
            rope_theta = rope_parameters.get("rope_theta", rope_theta)
            if rope_parameters.get("rope_type", "default") != "default":
                rope_scaling = {k: v for k, v in rope_parameters.items()
                                if k not in ("rope_theta", "partial_rotary_factor", "mrope_section",
                                             "mrope_interleaved")}
        partial = (rope_parameters or {}).get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
        if isinstance(rope_scaling, dict) and rope_scaling.get("rope_type", rope_scaling.get("type")) == "default":
            rope_scaling = None
        max_positions = hf.get("max_position_embeddings", 4096)
        if isinstance(rope_scaling, dict) and rope_scaling.get("rope_type", rope_scaling.get("type")) in ("yarn", "llama3"):
            # transformers' defaults: the pretraining window is max_position_embeddings unless given;
            # a yarn factor left out is the ratio of the two windows
            rope_scaling = {"original_max_position_embeddings": max_positions, **rope_scaling}
            if rope_scaling.get("factor") is None:
                rope_scaling["factor"] = max_positions / rope_scaling["original_max_position_embeddings"]
        extra = record.hf_fields(hf) if record.hf_fields else {}
        return cls(**{**dict(
            architecture=record.name,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_hidden_layers=hf["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta if rope_theta is not None else 10000.0),
            rope_scaling=rope_scaling,
            max_position_embeddings=max_positions,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=bool(hf.get("attention_bias", False)),
            partial_rotary_factor=float(partial),
            layer_types=list(layer_types) if layer_types else None,
            **{k: int(hf.get(k) or 0) for k in ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                                                "linear_value_head_dim", "linear_conv_kernel_dim")},
        ), **extra})


@dataclass(slots=True)
class CacheConfig:
    """Paged KV cache geometry."""

    page_size: int = 64
    num_pages: int = 0  # 0: derive from kv capacity

    def __post_init__(self) -> None:
        if self.page_size <= 0:
            raise ConfigError("page_size must be positive")


@dataclass(slots=True)
class SchedulerConfig:
    """Admission and batching knobs; names and defaults follow the spec's server options."""

    max_concurrency: int = 1
    max_pending_requests: int = 16
    pending_timeout_ms: int = 600_000  # 0: wait forever
    prefill_chunk: int = 1024
    decode_rounds_per_prefill: int | None = None  # None: prefill_chunk // 64
    concurrent_prefill: bool = False
    max_context: int = 0  # 0: the spec's default, 8192, or the model's native context if smaller
    default_max_tokens: int | None = None
    prefix_reuse: bool = True
    max_private_continuations: int | None = None  # None: 2 * max_concurrency
    # Engine._decode_ahead where the runner has launch / collect (the cuda runner; the torch runner
    # has none and steps one at a time)
    decode_ahead: bool = True
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not 1 <= self.max_concurrency <= 8:
            raise ConfigError("--max-concurrency must be in 1..8")
        if self.max_pending_requests < 0:
            raise ConfigError("--max-pending-requests must be >= 0")
        if self.pending_timeout_ms < 0:
            raise ConfigError("--pending-timeout-ms must be >= 0")
        if self.prefill_chunk < 1:
            raise ConfigError("--prefill-chunk must be >= 1")
        if self.decode_rounds_per_prefill is not None and self.decode_rounds_per_prefill < 0:
            raise ConfigError("--decode-rounds-per-prefill must be >= 0")


SPEC_METHODS = ("lookup", "mtp")


@dataclass(slots=True)
class SpecConfig:
    """Speculative decoding (--spec, --draft-tokens, --spec-ngram-min/max). method None: off.
    lookup drafts the continuation of the longest recent match of the last n tokens
    (ngram_min <= n <= ngram_max) inside the request's own prompt and output."""

    method: str | None = None
    draft_tokens: int = 3
    ngram_min: int = 2
    ngram_max: int = 4

    def __post_init__(self) -> None:
        if self.method is not None and self.method not in SPEC_METHODS:
            raise ConfigError(f"--spec must be one of {', '.join(SPEC_METHODS)} (got {self.method!r})")
        if not 1 <= self.draft_tokens <= 15:
            raise ConfigError(f"--draft-tokens must be in 1..15 (got {self.draft_tokens})")
        if not 1 <= self.ngram_min <= self.ngram_max <= 64:
            raise ConfigError(f"--spec-ngram-min/--spec-ngram-max must satisfy 1 <= min <= max <= 64 "
                              f"(got {self.ngram_min}, {self.ngram_max})")

    @property
    def enabled(self) -> bool:
        return self.method is not None


@dataclass(slots=True)
class MemoryConfig:
    """The context-cache tiers below the device pool and the session files (spec: Slots, Disk
    tier, --host-kv-mib / --host-cache-mib, --prefix-cache-file). Bytes, resolved by the CLI."""

    host_kv_bytes: int = 0  # host tier budget; 0: no host tier (evicted entries are dropped)
    disk_path: str | None = None  # --disk-kv-path: the disk tier under the host tier
    disk_bytes: int = 64 << 30  # --disk-kv-gib
    disk_restore: bool = False  # --disk-kv-restore: seed a matching prompt from the disk tier
    slot_save_path: str | None = None  # --slot-save-path: slot files (the server reads and writes them)
    auto_save_evicted: bool = False  # write an evicted session bound to a slot file back to it
    prefix_cache_file: str | None = None  # saved from the host tier at stop, restored at start

    def __post_init__(self) -> None:
        if self.host_kv_bytes < 0:
            raise ConfigError("--host-kv-mib must be >= 0")
        if self.disk_bytes <= 0:
            raise ConfigError("--disk-kv-gib must be positive")
        if self.auto_save_evicted and not self.slot_save_path:
            raise ConfigError("--auto-save-evicted requires --slot-save-path")
        if self.disk_restore and not self.disk_path:
            raise ConfigError("--disk-kv-restore requires --disk-kv-path")
        if self.prefix_cache_file and self.host_kv_bytes == 0:
            raise ConfigError("--prefix-cache-file needs a host tier (not --host-cache-mib 0 / --host-kv-mib 0)")
