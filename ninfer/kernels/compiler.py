"""NVRTC compile of ninfer/kernels/*.cu, an on-disk cubin cache, module loading and launch.

Sources compile straight to a cubin for the device's own arch (`--gpu-architecture=sm_90`),
with `-D` defines for per-shape specializations (attention's HEAD_DIM and GQA). A cubin is
cached as `<cache_dir>/<sha256>.cubin`, the key covering the source and its headers, the
options, the GPU name and arch, and the NVRTC version, so a driver or toolkit change
recompiles. Modules load through the driver API into the context torch uses, and kernels
launch with cuLaunchKernelEx on the current torch CUDA stream; on sm_90+ with programmatic
dependent launch (every kernel starts with common.cuh's PDL_ENTRY, which waits for the kernel
before it), so a kernel's blocks are scheduled while the one before it finishes. `NINFER_PDL=0`
launches them plainly (for A/B measurements).

cuda-python (`cuda.bindings`) and a CUDA device are needed only when a kernel is built or
launched; importing this module needs neither.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch

from ninfer.errors import ConfigError, NInferError

KERNEL_DIR = Path(__file__).resolve().parent
HEADERS = ("common.cuh", "kv_codes.cuh", "attention_split.cuh")


class KernelError(NInferError, ValueError):
    """A kernel that failed to compile, load or launch, or a launch with bad arguments."""


def default_cache_dir(env: dict[str, str] | None = None) -> Path:
    """`$NINFER_CACHE/kernels`, else `~/.cache/ninfer/kernels`. Call from cli/ and pass the result down."""
    env = dict(os.environ) if env is None else env
    root = env.get("NINFER_CACHE")
    return (Path(root) if root else Path.home() / ".cache" / "ninfer") / "kernels"


# Kernel argument types: a launcher passes each argument wrapped in one of these.
Ptr = ctypes.c_void_p
I32 = ctypes.c_int32
I64 = ctypes.c_int64
F32 = ctypes.c_float


def ptr(t: torch.Tensor | None) -> ctypes.c_void_p:
    """A tensor's device address as a kernel argument (None -> a null pointer)."""
    return Ptr(0 if t is None else t.data_ptr())


def _check_driver(result: Any, what: str) -> Any:
    from cuda.bindings import driver

    err, *rest = result if isinstance(result, tuple) else (result,)
    if err != driver.CUresult.CUDA_SUCCESS:
        _, name = driver.cuGetErrorName(err)
        raise KernelError(f"{what} failed: {name.decode() if isinstance(name, bytes) else name}")
    if not rest:
        return None
    return rest[0] if len(rest) == 1 else tuple(rest)


@dataclass(slots=True, frozen=True)
class Kernel:
    """A loaded kernel function, launched on the current torch stream of its device.

    The launch runs in the calling thread's current context: on a machine with several GPUs,
    launch under `torch.cuda.device(kernel.device)`."""

    name: str
    handle: Any  # CUfunction
    device: int
    config: Any  # CUlaunchConfig, its attributes set once (programmatic serialization or none)

    def launch(self, grid: tuple[int, int, int], block: tuple[int, int, int], args: Sequence[ctypes._SimpleCData],
               shared_mem: int = 0) -> None:
        """Launch with `args` (ctypes values in the kernel's parameter order)."""
        from cuda.bindings import driver

        # kernelParams is a void*[] of addresses of the argument values; `args` stays alive
        # across the call, which is all the launch needs (it copies the values).
        addrs = (ctypes.c_void_p * len(args))(*map(ctypes.addressof, args))
        c = self.config
        c.gridDimX, c.gridDimY, c.gridDimZ = grid
        c.blockDimX, c.blockDimY, c.blockDimZ = block
        c.sharedMemBytes = shared_mem
        c.hStream = current_stream(self.device)
        result = driver.cuLaunchKernelEx(c, self.handle, ctypes.addressof(addrs), 0)
        if result[0] != driver.CUresult.CUDA_SUCCESS:
            _check_driver(result, f"cuLaunchKernelEx({self.name})")

    def blocks_per_sm(self, threads: int) -> int:
        """How many blocks of `threads` threads (no dynamic shared memory) one SM holds at once (the
        driver's occupancy calculator)."""
        from cuda.bindings import driver

        return _check_driver(driver.cuOccupancyMaxActiveBlocksPerMultiprocessor(self.handle, threads, 0),
                             f"cuOccupancyMaxActiveBlocksPerMultiprocessor({self.name})")


_STREAMS: dict[int, Any] = {}  # raw stream handle -> its CUstream (a launch's host time matters: prompts)
_RAW_STREAM = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # absent from CPU builds


def current_stream(device: int) -> Any:
    """torch's current stream on `device` as a CUstream (cached per handle; the raw handle without
    building a torch Stream object where this torch offers it)."""
    raw = _RAW_STREAM(device) if _RAW_STREAM is not None else torch.cuda.current_stream(device).cuda_stream
    stream = _STREAMS.get(raw)
    if stream is None:
        from cuda.bindings import driver

        if len(_STREAMS) >= 64:  # streams come and go (side streams): keep the table small
            _STREAMS.clear()
        stream = _STREAMS[raw] = driver.CUstream(raw)
    return stream


def launch_config(pdl: bool) -> Any:
    """A CUlaunchConfig for Kernel.launch: with programmatic stream serialization when `pdl`."""
    from cuda.bindings import driver

    config = driver.CUlaunchConfig()
    if pdl:
        attr = driver.CUlaunchAttribute()
        attr.id = driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
        attr.value.programmaticStreamSerializationAllowed = 1
        config.attrs = [attr]
        config.numAttrs = 1
    return config


class KernelCompiler:
    """Compiles, caches and loads kernel modules for one CUDA device.

    cache_dir: where cubins are kept (see `default_cache_dir`); None disables the disk cache.
    """

    def __init__(self, cache_dir: Path | None, device: int = 0, kernel_dir: Path = KERNEL_DIR,
                 pdl: bool | None = None) -> None:
        if not torch.cuda.is_available():
            raise ConfigError("the cuda backend needs a CUDA device, and torch sees none")
        self.cache_dir = cache_dir
        self.device = device
        self.kernel_dir = kernel_dir
        props = torch.cuda.get_device_properties(device)
        self.gpu_name = props.name
        self.arch = f"sm_{props.major}{props.minor}"
        self.sm_count = props.multi_processor_count
        # programmatic dependent launch: sm_90+ (griddepcontrol), unless NINFER_PDL=0
        self.pdl = (props.major >= 9 and os.environ.get("NINFER_PDL", "1") != "0") if pdl is None else pdl
        self._modules: dict[tuple[str, tuple[tuple[str, int], ...]], tuple[Any, dict[str, Kernel]]] = {}
        self._context: Any = None  # CUcontext, the device's primary context
        self.compiled = 0  # NVRTC compiles done (cache misses), for tests and logs
        self.cache_hits = 0

    # -- compile ---------------------------------------------------------------------------

    def _options(self, defines: tuple[tuple[str, int], ...]) -> list[str]:
        return [f"--gpu-architecture={self.arch}", "--std=c++17", "-default-device"] + [
            f"-D{k}={v}" for k, v in defines]

    def _nvrtc_version(self) -> str:
        from cuda.bindings import nvrtc

        err, major, minor = nvrtc.nvrtcVersion()
        if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise KernelError(f"nvrtcVersion failed: {err}")
        return f"{major}.{minor}"

    def cache_key(self, source: str, options: Sequence[str]) -> str:
        """sha256 over the source and headers, options, GPU name/arch and NVRTC version."""
        h = hashlib.sha256()
        for name in (source, *HEADERS):
            h.update(name.encode() + b"\0" + (self.kernel_dir / name).read_bytes() + b"\0")
        for part in (*options, self.gpu_name, self.arch, self._nvrtc_version()):
            h.update(part.encode() + b"\0")
        return h.hexdigest()

    def compile_cubin(self, source: str, defines: dict[str, int] | None = None) -> bytes:
        """The cubin for `source` (a file name in kernel_dir), from the disk cache or NVRTC."""
        defs = tuple(sorted((defines or {}).items()))
        options = self._options(defs)
        key = self.cache_key(source, options)
        path = self.cache_dir / f"{key}.cubin" if self.cache_dir is not None else None
        if path is not None and path.is_file():
            self.cache_hits += 1
            return path.read_bytes()
        cubin = nvrtc_compile((self.kernel_dir / source).read_text(), source, options,
                              {name: (self.kernel_dir / name).read_text() for name in HEADERS})
        self.compiled += 1
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            # write-then-rename: a concurrent reader never sees half a cubin
            fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
            with os.fdopen(fd, "wb") as f:
                f.write(cubin)
            os.replace(tmp, path)
        return cubin

    # -- load ------------------------------------------------------------------------------

    def _ensure_context(self) -> Any:
        # torch's runtime uses the device's primary context; load our modules into that same
        # context (retained here, pushed around each load) so they share torch's memory.
        if self._context is None:
            from cuda.bindings import driver

            torch.cuda.init()
            with torch.cuda.device(self.device):
                torch.empty(1, device=f"cuda:{self.device}")  # makes torch create the context
            _check_driver(driver.cuInit(0), "cuInit")
            dev = _check_driver(driver.cuDeviceGet(self.device), "cuDeviceGet")
            self._context = _check_driver(driver.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
        return self._context

    def kernel(self, source: str, name: str, defines: dict[str, int] | None = None) -> Kernel:
        """The kernel `name` of `source` compiled with `defines`, loaded once per compiler."""
        defs = tuple(sorted((defines or {}).items()))
        key = (source, defs)
        entry = self._modules.get(key)
        if entry is None:
            from cuda.bindings import driver

            cubin = self.compile_cubin(source, dict(defs))
            _check_driver(driver.cuCtxPushCurrent(self._ensure_context()), "cuCtxPushCurrent")
            try:
                module = _check_driver(driver.cuModuleLoadData(cubin), f"cuModuleLoadData({source})")
            finally:
                _check_driver(driver.cuCtxPopCurrent(), "cuCtxPopCurrent")
            entry = (module, {})
            self._modules[key] = entry
        module, functions = entry
        fn = functions.get(name)
        if fn is None:
            from cuda.bindings import driver

            handle = _check_driver(driver.cuModuleGetFunction(module, name.encode()),
                                   f"cuModuleGetFunction({source}:{name})")
            fn = functions[name] = Kernel(name, handle, self.device, launch_config(self.pdl))
        return fn


def cuobjdump_path() -> str | None:
    """cuobjdump (SASS of a cubin; tests and tuning scripts): on PATH, else from a CUDA or triton wheel."""
    import shutil
    import sys

    found = shutil.which("cuobjdump")
    if found:
        return found
    for pattern in ("nvidia/*/bin/cuobjdump", "triton/backends/nvidia/bin/cuobjdump"):  # CUDA wheels
        for p in Path(sys.prefix).glob(f"lib/python*/site-packages/{pattern}"):
            return str(p)
    return None


def nvrtc_compile(text: str, name: str, options: Sequence[str], headers: dict[str, str]) -> bytes:
    """Compile CUDA C++ `text` with NVRTC to a cubin; raises KernelError with the log on failure."""
    from cuda.bindings import nvrtc

    def check(result: Any, what: str) -> Any:
        err, *rest = result if isinstance(result, tuple) else (result,)
        if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise KernelError(f"{what} failed for {name}: {err}")
        return rest[0] if rest else None

    hdr_names = list(headers)
    prog = check(nvrtc.nvrtcCreateProgram(text.encode(), name.encode(), len(hdr_names),
                                          [headers[h].encode() for h in hdr_names],
                                          [h.encode() for h in hdr_names]), "nvrtcCreateProgram")
    try:
        opts = [o.encode() for o in options]
        (err,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
        if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            size = check(nvrtc.nvrtcGetProgramLogSize(prog), "nvrtcGetProgramLogSize")
            log = b" " * size
            check(nvrtc.nvrtcGetProgramLog(prog, log), "nvrtcGetProgramLog")
            raise KernelError(f"NVRTC could not compile {name} ({' '.join(options)}):\n"
                              f"{log.decode(errors='replace').rstrip(chr(0))}")
        size = check(nvrtc.nvrtcGetCUBINSize(prog), "nvrtcGetCUBINSize")
        cubin = b" " * size
        check(nvrtc.nvrtcGetCUBIN(prog, cubin), "nvrtcGetCUBIN")
        return cubin
    finally:
        nvrtc.nvrtcDestroyProgram(prog)
