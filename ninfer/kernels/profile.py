"""Device profiles: the cuda backend's route choices for one GPU, measured by `ninfer calibrate`
and kept as YAML in the user cache, one file per (GPU name, compute capability, driver, ninfer
version).

What a profile chooses, and why each choice keeps results batch-invariant:
- gemv: per weight format, the decode matmul route for every row count 1..8: a gemv kernel variant
  (launchers.GEMV_ROUTES) or, for unquantized weights, "cublas" (torch.mm with the rows padded to
  MAX_GEMV_ROWS, one shape always). A weight the route does not take (its width, the activation
  dtype) runs the warp kernel (an int4 weight the tiled route does not take: the mma route where
  it takes it). One route per weight, never per row count: routes differ in
  summation order, so a row's bits would otherwise depend on how many rows share its step.
- attention_partition: the least keys a split-K partition of decode attention holds (a context of
  n > 256 keys is cut into min(32, ceil(n / partition)) partitions). A sequence's split depends only on
  its own length and this constant, fixed for the whole run.
- decode_attention: the decode attention route (launchers.ATTN_DECODE_ROUTES) where it takes the
  layer (bf16 caches, head_dim 64 / 128, at most 8 query heads per kv head for "mma"; else "warp"),
  one route for the whole run.
- mma_pipe: bf16 gemv_mma's iterations in flight a warp (launchers.MMA_PIPES) for every bf16 weight on
  the mma route, or None: launchers.mma_variant's rule by shape. Speed only: every value gives the same
  bits.
- prompt_rows: the row block of every prompt matmul (cuBLAS sees only [prompt_rows, K] blocks),
  fixed for the whole run.
- graph_rows: the decode row counts that get their own CUDA graph; a step of n rows runs the graph
  of the smallest listed count >= n, padded rows computing nothing any real row reads.
The defaults: DEFAULT_GEMV_ROUTES, mma_pipe None, DEFAULT_PARTITION (64), DEFAULT_DECODE_ATTENTION ("mma"),
DEFAULT_PROMPT_ROWS (128), graph rows 1..8. A profile is passed explicitly (CudaOps, the cuda runner); nothing reads it from a module
global.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from ninfer.errors import ConfigError
from ninfer.formats import TensorFormat
from ninfer.kernels.launchers import ATTN_DECODE_ROUTES, GEMV_FORMATS, GEMV_ROUTES, MAX_GEMV_ROWS, MMA_PIPES

PROFILE_VERSION = 1
CUBLAS = "cublas"  # the decode route through torch.mm (unquantized weights only)
DENSE_FORMATS = ("bf16", "f32")
# decode gemv route per weight format, from H200 / H100 timings (docs/PERF.md): tensor cores win bf16,
# int4 and int8 on tiles (int4: llama-8b tg128 195.5 -> 305.8 tok/s over the mma route on the H200;
# int8: see the int8 tiles section; its mma route lost a third to warp at one row)
DEFAULT_GEMV_ROUTES = {"bf16": "mma", "int8": "tiled", "int4_sym": "tiled", "int4_asym": "tiled", "f32": "warp"}
DEFAULT_PARTITION = 64
DEFAULT_DECODE_ATTENTION = "mma"  # tensor cores for Q K^T and P V (docs/PERF.md, decode attention on tensor cores)
DEFAULT_PROMPT_ROWS = 128
ALL_ROWS = tuple(range(1, MAX_GEMV_ROWS + 1))


def gemv_key(fmt: TensorFormat) -> str:
    """The gemv format key of a weight format: bf16, f32, int8, int4_sym or int4_asym."""
    if fmt.format == "int4":
        return "int4_sym" if fmt.symmetric else "int4_asym"
    return fmt.format


@dataclass(frozen=True, slots=True)
class DeviceKey:
    """What a profile is valid for."""

    gpu: str
    compute_capability: str  # "9.0"
    driver: str  # "12.8"
    ninfer: str  # the ninfer release (ninfer/VERSION)

    def slug(self) -> str:
        text = f"{self.gpu}-sm{self.compute_capability}-driver{self.driver}-ninfer{self.ninfer}"
        return re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("_")

    def to_dict(self) -> dict[str, str]:
        return {"gpu": self.gpu, "compute_capability": self.compute_capability, "driver": self.driver,
                "ninfer": self.ninfer}


@dataclass(frozen=True, slots=True)
class DeviceProfile:
    """Route choices of the cuda backend (see the module docstring). `source` says where it came
    from for the log ("defaults", or the file); `device`, `calibrated_on` and `measured` (the
    timings behind the choices, seconds) are kept for the record."""

    gemv: Mapping[str, str] = field(default_factory=lambda: dict(DEFAULT_GEMV_ROUTES))
    mma_pipe: int | None = None
    attention_partition: int = DEFAULT_PARTITION
    decode_attention: str = DEFAULT_DECODE_ATTENTION
    prompt_rows: int = DEFAULT_PROMPT_ROWS
    graph_rows: tuple[int, ...] = ALL_ROWS
    device: DeviceKey | None = None
    calibrated_on: str = ""
    measured: Mapping[str, Any] = field(default_factory=dict)
    source: str = "defaults"

    def __post_init__(self) -> None:
        unknown = set(self.gemv) - set(GEMV_FORMATS)
        if unknown:
            raise ConfigError(f"device profile: unknown gemv formats {sorted(unknown)} (known: {', '.join(GEMV_FORMATS)})")
        for key, route in self.gemv.items():
            if route == CUBLAS and key not in DENSE_FORMATS:
                raise ConfigError(f"device profile: gemv route cublas takes unquantized weights, not {key}")
            if route != CUBLAS and route not in GEMV_ROUTES:
                raise ConfigError(f"device profile: gemv route {route!r} for {key} is not one of this build's "
                                  f"routes ({', '.join(GEMV_ROUTES + (CUBLAS,))}); recalibrate")
        object.__setattr__(self, "gemv", {**DEFAULT_GEMV_ROUTES, **self.gemv})
        if self.mma_pipe is not None and (isinstance(self.mma_pipe, bool) or self.mma_pipe not in MMA_PIPES):
            raise ConfigError(f"device profile: mma_pipe must be null or one of {', '.join(map(str, MMA_PIPES))}, "
                              f"got {self.mma_pipe!r}")
        if self.decode_attention not in ATTN_DECODE_ROUTES:
            raise ConfigError(f"device profile: decode_attention must be one of {', '.join(ATTN_DECODE_ROUTES)}, "
                              f"got {self.decode_attention!r}")
        for name in ("attention_partition", "prompt_rows"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0 or value % 16:
                raise ConfigError(f"device profile: {name} must be a positive multiple of 16, got {value!r}")
        rows = tuple(self.graph_rows)
        if not rows or list(rows) != sorted(set(rows)) or rows[-1] != MAX_GEMV_ROWS or rows[0] < 1:
            raise ConfigError(f"device profile: graph_rows must be increasing counts in 1..{MAX_GEMV_ROWS} "
                              f"ending at {MAX_GEMV_ROWS}, got {list(rows)}")
        object.__setattr__(self, "graph_rows", rows)

    def gemv_route(self, fmt: TensorFormat) -> str:
        """The route for weights of `fmt` (warp for a format the gemv kernels do not name)."""
        return self.gemv.get(gemv_key(fmt), "warp")

    def graph_size(self, n: int) -> int:
        """The captured row count a decode step of n rows runs in."""
        return next(r for r in self.graph_rows if r >= n)

    def describe(self) -> str:
        """One line for the log: where it came from and what it chose."""
        routes = ", ".join(f"{k} {v}" for k, v in self.gemv.items())
        pipe = "by shape" if self.mma_pipe is None else self.mma_pipe
        return (f"device profile {self.source}: gemv [{routes}], bf16 mma pipe {pipe}, attention partition {self.attention_partition}, "
                f"decode attention {self.decode_attention}, prompt rows {self.prompt_rows}, graph rows {list(self.graph_rows)}")

    def to_dict(self) -> dict:
        return {"version": PROFILE_VERSION, "device": self.device.to_dict() if self.device else None,
                "calibrated_on": self.calibrated_on, "gemv": dict(self.gemv), "mma_pipe": self.mma_pipe,
                "attention_partition": self.attention_partition, "decode_attention": self.decode_attention,
                "prompt_rows": self.prompt_rows,
                "graph_rows": list(self.graph_rows), "measured": _plain(self.measured)}

    @classmethod
    def from_dict(cls, d: Any, source: str) -> DeviceProfile:
        """A profile from its YAML mapping; fields it leaves out take the defaults."""
        if not isinstance(d, dict) or d.get("version") != PROFILE_VERSION:
            raise ConfigError(f"device profile {source}: not a version {PROFILE_VERSION} profile")
        try:
            dev = d.get("device")
            return cls(gemv=dict(d.get("gemv") or {}), mma_pipe=d.get("mma_pipe"),
                       attention_partition=d.get("attention_partition", DEFAULT_PARTITION),
                       decode_attention=d.get("decode_attention", DEFAULT_DECODE_ATTENTION),
                       prompt_rows=d.get("prompt_rows", DEFAULT_PROMPT_ROWS),
                       graph_rows=tuple(d.get("graph_rows", ALL_ROWS)),
                       device=DeviceKey(**dev) if dev else None, calibrated_on=str(d.get("calibrated_on") or ""),
                       measured=d.get("measured") or {}, source=source)
        except ConfigError as e:
            raise ConfigError(f"{e} ({source})") from None
        except (TypeError, ValueError, AttributeError) as e:
            raise ConfigError(f"device profile {source}: {e}") from None

    def save(self, path: Path) -> Path:
        import yaml

        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(yaml.safe_dump(self.to_dict(), sort_keys=False))
        tmp.replace(path)
        return path

    @classmethod
    def load(cls, path: Path) -> DeviceProfile:
        import yaml

        try:
            data = yaml.safe_load(Path(path).read_text())
        except OSError as e:
            raise ConfigError(f"device profile {path}: {e.strerror or e}") from None
        except yaml.YAMLError as e:
            raise ConfigError(f"device profile {path}: not YAML ({e})") from None
        return cls.from_dict(data, str(path))


def _plain(value: Any) -> Any:
    """Measurements as plain YAML types (tuples to lists, numbers rounded to 4 significant digits;
    int and str keys kept)."""
    if isinstance(value, Mapping):
        return {(k if isinstance(k, (int, str)) else str(k)): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, float):
        return float(f"{value:.4g}")
    return value


def profile_path(cache_dir: Path, key: DeviceKey) -> Path:
    """Where the profile of `key` lives in the user cache."""
    return cache_dir / "device-profiles" / f"{key.slug()}.yaml"


def device_key(device: int) -> DeviceKey:
    """The key of CUDA device `device` (needs torch with CUDA and cuda-python)."""
    import torch

    from ninfer.version import __version__

    major, minor = torch.cuda.get_device_capability(device)
    return DeviceKey(gpu=torch.cuda.get_device_name(device), compute_capability=f"{major}.{minor}",
                     driver=_driver_version(), ninfer=__version__)


def _driver_version() -> str:
    try:
        from cuda.bindings import driver

        err, v = driver.cuDriverGetVersion()
        if err == driver.CUresult.CUDA_SUCCESS:
            return f"{v // 1000}.{v % 1000 // 10}"
    except ImportError:
        pass
    return "unknown"


PROFILE_MODES = ("auto", "off", "calibrate")


@dataclass(frozen=True, slots=True)
class ProfileRequest:
    """--device-profile and --device-profile-path: auto (the stored profile; calibrate a device that
    has none), off (the built-in defaults), calibrate (measure anew), or a profile file to use.
    path: where auto and calibrate read and write instead of the user cache."""

    mode: str = "auto"
    path: Path | None = None

    def __post_init__(self) -> None:
        if self.mode not in PROFILE_MODES:
            raise ConfigError(f"--device-profile must be auto, off, calibrate or a profile file, got {self.mode!r}")

    @classmethod
    def from_flags(cls, value: str, path: str | None = None) -> ProfileRequest:
        """A value that is not a mode is a profile file (it must exist)."""
        if value in PROFILE_MODES:
            return cls(value, Path(path).expanduser() if path else None)
        if path:
            raise ConfigError("give a profile file either as --device-profile FILE or --device-profile-path FILE")
        file = Path(value).expanduser()
        if not file.is_file():
            raise ConfigError(f"--device-profile must be auto, off, calibrate or a profile file; "
                              f"{value!r}: no such file")
        return cls("auto", file)
