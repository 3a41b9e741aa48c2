"""RoPE frequencies and their scalings, defined once for both backends.

A `Rope` is one rotary embedding: rotary dims, base, and a scaling (a model's own `rope_scaling`, or
one the serve options impose). It yields inverse frequencies, the attention factor that scales cos
and sin, and the position each token rotates at; the backends only build tables from these.

Scaling types, as transformers' `modeling_rope_utils` computes them (the fidelity reference):
  linear       every inverse frequency divided by `factor`
  llama3       long wavelengths divided by `factor`, short ones kept, the band between interpolated
  yarn         YaRN: frequencies blended between interpolated and kept by a ramp over the dims
               (beta_fast / beta_slow), cos and sin scaled by the attention factor (0.1 ln(factor) + 1
               unless the config gives `attention_factor` or `mscale` / `mscale_all_dim`)
and one of ours, for `--rope-scaling-factor` (the spec's linear interpolation):
  interpolate  a position p past `original_max_position_embeddings` (o) rotates at o + (p - o) / factor;
               positions up to o keep their exact angles
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ninfer.errors import ConfigError

if TYPE_CHECKING:
    import torch

SCALING_TYPES = ("linear", "llama3", "yarn", "interpolate")
_REQUIRED = {"linear": ("factor",), "llama3": ("factor", "low_freq_factor", "high_freq_factor",
                                               "original_max_position_embeddings"),
             "yarn": ("factor", "original_max_position_embeddings"),
             "interpolate": ("factor", "original_max_position_embeddings")}


def scaling_type(scaling: dict[str, Any] | None) -> str:
    """The type of a `rope_scaling` dict ('default' for none); `type` is its older spelling."""
    if not scaling:
        return "default"
    return scaling.get("rope_type", scaling.get("type")) or "default"


def check_scaling(scaling: dict[str, Any] | None) -> None:
    """A ConfigError naming the type or the missing field, for a scaling we cannot compute."""
    kind = scaling_type(scaling)
    if kind == "default":
        return
    if kind not in SCALING_TYPES:
        raise ConfigError(f"unsupported rope scaling type {kind!r} (supported: {', '.join(SCALING_TYPES)})")
    missing = [k for k in _REQUIRED[kind] if scaling.get(k) is None]
    if missing:
        raise ConfigError(f"rope scaling {kind!r} needs {', '.join(missing)}")
    factor = scaling.get("factor")
    if factor is not None and (not isinstance(factor, (int, float)) or factor < 1.0):
        raise ConfigError(f"rope scaling factor must be a number >= 1, got {factor!r}")


@dataclass(frozen=True, slots=True)
class Rope:
    """One rotary embedding: `dim` rotary dims of base `theta`, scaled by `scaling` (items of a
    rope_scaling dict, hashable; () for plain RoPE)."""

    dim: int
    theta: float
    scaling: tuple[tuple[str, Any], ...] = ()

    @classmethod
    def of(cls, dim: int, theta: float, scaling: dict[str, Any] | None) -> Rope:
        check_scaling(scaling)
        items = () if scaling_type(scaling) == "default" else tuple(sorted(scaling.items()))
        return cls(dim, float(theta), items)

    @property
    def kind(self) -> str:
        return scaling_type(dict(self.scaling))

    def _base_inv_freq(self) -> torch.Tensor:
        import torch

        # transformers' exact expression (float32 exponent over int64 arange)
        return 1.0 / (self.theta ** (torch.arange(0, self.dim, 2, dtype=torch.int64).to(torch.float) / self.dim))

    def inv_freq(self) -> torch.Tensor:
        """[dim / 2] float32 inverse frequencies."""
        s, kind = dict(self.scaling), self.kind
        if kind == "linear":
            return self._base_inv_freq() / s["factor"]
        if kind == "llama3":
            return _llama3(self._base_inv_freq(), s)
        if kind == "yarn":
            return _yarn(self.dim, self.theta, s)[0]
        return self._base_inv_freq()  # default; interpolate moves positions instead

    def attention_factor(self) -> float:
        """The factor cos and sin are multiplied by (1 but for yarn)."""
        return _yarn(self.dim, self.theta, dict(self.scaling))[1] if self.kind == "yarn" else 1.0

    def positions(self, n: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        """[n] the position each of 0..n-1 rotates at (float32 unless `dtype`)."""
        import torch

        dtype = dtype or torch.float32
        pos = torch.arange(n, dtype=dtype)
        if self.kind != "interpolate":
            return pos
        s = dict(self.scaling)
        o = float(s["original_max_position_embeddings"])
        return torch.where(pos > o, o + (pos - o) / float(s["factor"]), pos)

    def angles(self, n: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        """[n, dim / 2] position x inverse frequency, in `dtype` (default float32: transformers' product)."""
        pos = self.positions(n, dtype)
        return pos[:, None] * self.inv_freq().to(pos.dtype)[None, :]


def _llama3(inv_freq: torch.Tensor, s: dict[str, Any]) -> torch.Tensor:
    import torch

    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old = s["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old / low, old / high
    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * inv_freq_llama / factor + smooth * inv_freq_llama
    is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, inv_freq_llama)


def _yarn(dim: int, base: float, s: dict[str, Any]) -> tuple[torch.Tensor, float]:
    import torch

    original = s["original_max_position_embeddings"]
    factor = s["factor"]

    def get_mscale(scale: float, mscale: float = 1) -> float:
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    attention_factor = s.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = s.get("mscale"), s.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = float(get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim))
        else:
            attention_factor = get_mscale(factor)
    beta_fast, beta_slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # a singular ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp  # the share of each dim's original frequency
    return interpolation * (1 - keep) + extrapolation * keep, float(attention_factor)


# ---- the serve options (--rope-yarn, --rope-yarn-factor, --rope-scaling-factor) -----------------

MAX_WINDOW_MULTIPLE = 4  # a scaled context reaches at most four times the native window


@dataclass(frozen=True, slots=True)
class RopeOverride:
    """What the serve options ask for: YaRN by context (`yarn`), YaRN at a fixed factor
    (`yarn_factor` > 1), or linear interpolation past `original_context` (`scaling_factor` > 1)."""

    yarn: bool = False
    yarn_factor: float = 1.0
    scaling_factor: float = 1.0
    original_context: int | None = None

    def __post_init__(self) -> None:
        if not 1.0 <= self.yarn_factor <= 4.0:
            raise ConfigError(f"--rope-yarn-factor must be in [1, 4], got {self.yarn_factor}")
        if not 1.0 <= self.scaling_factor <= 32.0:
            raise ConfigError(f"--rope-scaling-factor must be in [1, 32], got {self.scaling_factor}")
        if self.scaling_factor > 1.0 and (self.yarn or self.yarn_factor > 1.0):
            raise ConfigError("--rope-scaling-factor excludes --rope-yarn and --rope-yarn-factor")
        if self.original_context is not None and self.original_context < 1:
            raise ConfigError("--rope-scaling-original-context must be >= 1")
        if self.original_context is not None and self.scaling_factor == 1.0:
            raise ConfigError("--rope-scaling-original-context needs --rope-scaling-factor")

    @property
    def active(self) -> bool:
        return self.yarn or self.yarn_factor > 1.0 or self.scaling_factor > 1.0

    def scaling(self, native: int, max_context: int | None) -> dict[str, Any] | None:
        """The rope_scaling these options give a model whose native window is `native`, served with
        --max-context `max_context` (None: not given). None: plain RoPE (--rope-yarn within the window)."""
        if self.scaling_factor > 1.0:
            return {"rope_type": "interpolate", "factor": self.scaling_factor,
                    "original_max_position_embeddings": self.original_context or native}
        factor = self.yarn_factor
        if self.yarn and factor == 1.0 and max_context is not None and max_context > native:
            factor = max_context / native
        if factor <= 1.0:
            return None
        return {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": native}

    def apply(self, config: Any, max_context: int | None) -> Any:
        """`config` (a ModelConfig) with these options' scaling in place of its own, and a window of
        at most four times the native one; unchanged when no option is on."""
        import dataclasses

        if not self.active:
            return config
        native = config.max_position_embeddings
        limit = MAX_WINDOW_MULTIPLE * native
        if max_context is not None and max_context > limit:
            raise ConfigError(f"--max-context {max_context} is past four times the model's native window "
                              f"({native}): at most {limit} with RoPE scaling")
        scaling = self.scaling(native, max_context)
        if scaling is None:
            return config
        return dataclasses.replace(config, rope_scaling=scaling, max_position_embeddings=limit)
