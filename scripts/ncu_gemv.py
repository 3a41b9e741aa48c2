"""Hardware counters of the decode gemvs on a GPU (Nsight Compute), llama-8b's shapes at one row: the
default route and variant of each weight format (bf16: gemv_mma, int8 / int4: gemv_tiled; gate_up with its
SiLU epilogue, as a decode step runs it), one launch each, L2 flushed before each (ncu's default).

  python3 scripts/ncu_gemv.py profile OUTDIR [--formats bf16,int8,int4]   # ncu over `run`, then `table`
  python3 scripts/ncu_gemv.py table OUTDIR/gemv.ncu-rep [--formats ...]

`table` prints one line a kernel: time, DRAM GB/s and % of peak, warp instructions a KB of weights, issue
slots busy, achieved occupancy, registers, and the stall reasons' cycles per issued instruction (the
largest first), from `ncu --import ... --csv --page raw`.
"""
from __future__ import annotations

import csv
import io
import re
import subprocess
import sys
import tempfile
from pathlib import Path

SHAPES = [("qkv", 6144, 4096), ("o_proj", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336),
          ("lm_head", 128256, 4096)]
SECTIONS = ["SpeedOfLight", "Occupancy", "LaunchStats", "SchedulerStats", "WarpStateStats", "MemoryWorkloadAnalysis"]


def run(formats: list[str]) -> None:
    import torch

    from ninfer.engine.quant import TensorFormat, quantize
    from ninfer.kernels import launchers as L
    from ninfer.kernels.compiler import KernelCompiler

    dev = torch.device("cuda")
    kc = KernelCompiler(Path(tempfile.mkdtemp()) / "kernels", device=0)
    known = {"bf16": TensorFormat("bf16"), "int8": TensorFormat("int8", 32), "int4": TensorFormat("int4", 32, False)}
    for name in formats:
        fmt = known[name]
        route = "mma" if name == "bf16" else "tiled"
        for label, N, K in SHAPES:
            g = torch.Generator(device=dev).manual_seed(N + K)
            w = torch.randn(N, K, generator=g, device=dev) * 0.02
            parts = {"": w.to(torch.bfloat16)} if name == "bf16" else quantize(w, fmt)
            packed = L.gemv_pack(route, fmt, parts)
            x = torch.randn(1, K, generator=g, device=dev).to(torch.bfloat16)
            glu = "silu" if label == "gate_up" else ""
            out = torch.empty(1, N // 2 if glu else N, device=dev, dtype=torch.bfloat16 if glu else torch.float32)
            L.gemv(kc, x, fmt, packed, out, route, glu=glu)
            torch.cuda.synchronize()
            nbytes = sum(p.numel() * p.element_size() for p in packed.values())
            print(f"{name} {label} {N}x{K} weight bytes {nbytes}", flush=True)
            del w, parts, packed
            torch.cuda.empty_cache()


METRICS = ["gpu__time_duration.sum", "dram__bytes_read.sum", "dram__throughput.avg.pct_of_peak_sustained_elapsed",
           "smsp__inst_executed.sum", "smsp__issue_active.avg.pct_of_peak_sustained_active",
           "sm__warps_active.avg.pct_of_peak_sustained_active", "launch__registers_per_thread", "launch__grid_size"]


def ncu() -> str:
    found = sorted(Path("/opt/nvidia").glob("nsight-compute/*/ncu")) + sorted(Path("/usr/local").glob("cuda*/bin/ncu"))
    return "ncu" if subprocess.run(["which", "ncu"], capture_output=True).returncode == 0 else str(found[-1])


def profile(out: Path, formats: list[str]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    cmd = [ncu(), "--clock-control", "none", "-k", "regex:gemv", "-f", "-o", str(out / "gemv"),
           *[a for s in SECTIONS for a in ("--section", s)], "--metrics", ",".join(METRICS),
           sys.executable, __file__, "run", "--formats", ",".join(formats)]
    subprocess.run(cmd, check=True)
    table(str(out / "gemv.ncu-rep"), formats)


def wbytes(fmt: str, N: int, K: int) -> float:
    """weight, scale and min bytes (int8 g32: f16 scale; int4 asym g32: f16 scale and min)"""
    return {"bf16": 2 * N * K, "int8": N * K * (1 + 2 / 32), "int4": N * K / 2 * 1.25}[fmt]


def table(report: str, formats: list[str]) -> None:
    raw = subprocess.run(["ncu", "--import", report, "--csv", "--page", "raw", "--print-units", "base"],
                         capture_output=True, text=True, check=True).stdout
    rows = list(csv.DictReader(io.StringIO(raw[raw.index('"ID"'):])))[1:]  # the first row holds the units
    order = [(f, s) for f in formats for s in SHAPES]
    stall = re.compile(r"smsp__average_warps?_issue_stalled_(\w+?)_per_issue_active\.ratio")
    if rows and not any(stall.fullmatch(k) for k in rows[0]):
        print("no stall columns; those naming 'stalled':", [k for k in rows[0] if "stalled" in k][:40])
    for i, r in enumerate(rows):
        f, (label, N, K) = order[i] if i < len(order) else ("?", ("?", 1, 1))
        kb = wbytes(f, N, K) / 1024 if f in ("bf16", "int8", "int4") else float("nan")

        def num(key: str) -> float:
            try:
                return float(r.get(key, "nan").replace(",", ""))
            except ValueError:
                return float("nan")
        t = num("gpu__time_duration.sum") * 1e-9
        stalls = sorted(((num(k), m.group(1)) for k in r if (m := stall.fullmatch(k))), reverse=True)
        print(f"{f:4s} {label:8s} {r.get('Kernel Name', '')[:10]:10s} {t * 1e6:7.2f} us  "
              f"dram {num('dram__bytes_read.sum') / t / 1e9 if t else 0:6.0f} GB/s "
              f"({num('dram__throughput.avg.pct_of_peak_sustained_elapsed'):4.1f} %)  "
              f"instr/KB {num('smsp__inst_executed.sum') / kb:5.0f}  "
              f"issue {num('smsp__issue_active.avg.pct_of_peak_sustained_active'):4.1f} %  "
              f"occ {num('sm__warps_active.avg.pct_of_peak_sustained_active'):4.1f} %  "
              f"regs {num('launch__registers_per_thread'):3.0f}  grid {num('launch__grid_size'):6.0f}  "
              f"stalls/issue: " + " ".join(f"{n} {v:.2f}" for v, n in stalls[:6] if v == v))


def main() -> None:
    mode = sys.argv[1] if len(sys.argv) > 1 else ""
    formats = sys.argv[sys.argv.index("--formats") + 1].split(",") if "--formats" in sys.argv else ["bf16", "int8", "int4"]
    if mode == "run":
        run(formats)
    elif mode == "profile" and len(sys.argv) > 2:
        profile(Path(sys.argv[2]), formats)
    elif mode == "table" and len(sys.argv) > 2:
        table(sys.argv[2], formats)
    else:
        raise SystemExit(__doc__)


if __name__ == "__main__":
    main()
