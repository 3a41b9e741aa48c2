"""Short probes of a device's ceilings, measured in the run that uses them (`ninfer bench`):

- read bandwidth: the best of a read probe (a sum over a buffer far larger than the caches: every
  byte read once, nothing written) and a device-copy probe (bytes read + bytes written / time);
- matmul peak: torch.mm of large square matrices in the dtype the model computes in (bf16 on a
  GPU; on the CPU the torch backend's dtype).
Each figure is the best sample (the least disturbed one). On a GPU the probes take about a second,
on the CPU a few seconds.
"""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Mapping

import torch

from ninfer.kernels.timing import sample_seconds

GPU_BUFFER_BYTES = 2 << 30  # far beyond any L2 (H200: 50 MB)
CPU_BUFFER_BYTES = 256 << 20  # far beyond the last-level cache of a workstation
GPU_MATMUL_N = 8192
CPU_MATMUL_N = 1024


@dataclass(frozen=True, slots=True)
class Ceilings:
    """The device's measured limits: read bandwidth (GB/s, 1e9 bytes per second) and matmul peak
    (TFLOP/s) in `matmul_dtype`; how each was measured is in `probes`."""

    device: str
    read_gbs: float
    matmul_tflops: float
    matmul_dtype: str
    probes: Mapping[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"device": self.device, "read_gbs": self.read_gbs, "matmul_tflops": self.matmul_tflops,
                "matmul_dtype": self.matmul_dtype,
                "probes": dict(self.probes)}


def measure_ceilings(device: str | torch.device, matmul_dtype: torch.dtype) -> Ceilings:
    """Run the probes on `device` ("cpu" or "cuda:N")."""
    dev = torch.device(device)
    cuda = dev.type == "cuda"
    if cuda and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    nbytes = GPU_BUFFER_BYTES if cuda else CPU_BUFFER_BYTES
    reps = 5  # the best of them: on a shared machine the least disturbed sample
    with torch.inference_mode(), (torch.cuda.device(dev) if cuda else nullcontext()):
        src = torch.ones(nbytes // 4, dtype=torch.float32, device=dev)
        read_s = min(sample_seconds(lambda: src.sum(), dev, reps=reps))
        dst = torch.empty_like(src)
        copy_s = min(sample_seconds(lambda: dst.copy_(src), dev, reps=reps))
        del src, dst
        n = GPU_MATMUL_N if cuda else CPU_MATMUL_N
        a = torch.randn(n, n, device=dev).to(matmul_dtype)
        b = torch.randn(n, n, device=dev).to(matmul_dtype)
        c = torch.empty(n, n, dtype=matmul_dtype, device=dev)
        mm_s = min(sample_seconds(lambda: torch.mm(a, b, out=c), dev, reps=reps + 5))
        del a, b, c
        if cuda:
            torch.cuda.empty_cache()
    read_gbs, copy_gbs = nbytes / read_s / 1e9, 2 * nbytes / copy_s / 1e9
    name = torch.cuda.get_device_name(dev) if cuda else "cpu"
    dtype = str(matmul_dtype).removeprefix("torch.")
    return Ceilings(
        device=name, read_gbs=max(read_gbs, copy_gbs), matmul_tflops=2 * n ** 3 / mm_s / 1e12, matmul_dtype=dtype,
        probes={"read": f"sum over {nbytes >> 20} MiB fp32: {read_gbs:.1f} GB/s",
                "copy": f"copy of {nbytes >> 20} MiB: {copy_gbs:.1f} GB/s (read + write)",
                "matmul": f"torch.mm {n}x{n}x{n} {dtype}" + ("" if cuda else f", {torch.get_num_threads()} threads")})
