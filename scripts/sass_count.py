"""Static instruction counts of a kernel, no GPU needed: compile a ninfer/kernels source with NVRTC for
sm_90 (the KernelCompiler's options), disassemble with cuobjdump, print registers per thread, blocks
and warps an SM holds, and the opcode histogram of the hottest loop (the longest backward branch).

Usage: PYTHONPATH=. python scripts/sass_count.py gemv_tiled.cu T4_FMT=3 T4_G32=1 [--bytes-per-iter 2048]
(cuobjdump from the nvidia-cuda-* wheels of the venv, or on PATH.) --bytes-per-iter: weight bytes one
trip of that loop reads per warp, to print instructions per KB."""
from __future__ import annotations

import argparse
import collections
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from ninfer.kernels.compiler import HEADERS, KERNEL_DIR, cuobjdump_path, nvrtc_compile


def cuobjdump() -> str:
    found = cuobjdump_path()
    if found is None:
        raise SystemExit("cuobjdump not found (pip install nvidia-cuda-cuobjdump, or put it on PATH)")
    return found


def hottest_loop(sass: str) -> tuple[int, collections.Counter]:
    ins = [(int(m.group(1), 16), m.group(2).strip())
           for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    loops = [(int(m.group(1), 16), a) for a, t in ins if (m := re.search(r"BRA (0x[0-9a-f]+)", t))
             and int(m.group(1), 16) < a]
    if not loops:
        return 0, collections.Counter()
    lo, hi = max(loops, key=lambda r: r[1] - r[0])
    hist = collections.Counter()
    for a, t in ins:
        if lo <= a <= hi:
            op = re.sub(r"^@!?U?P\w+\s+", "", t).split()[0]
            hist[op if op.startswith(("LDG", "HMMA", "LDS", "STS")) else op.split(".")[0]] += 1
    return sum(hist.values()), hist


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("source")
    ap.add_argument("defines", nargs="*", help="NAME=VALUE ...")
    ap.add_argument("--threads", type=int, default=256, help="threads per block")
    ap.add_argument("--bytes-per-iter", type=int, default=0)
    args = ap.parse_args()
    options = ["--gpu-architecture=sm_90", "--std=c++17", "-default-device", *(f"-D{d}" for d in args.defines)]
    cubin = nvrtc_compile((KERNEL_DIR / args.source).read_text(), args.source, options,
                          {h: (KERNEL_DIR / h).read_text() for h in HEADERS})
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "k.cubin"
        path.write_bytes(cubin)
        res = subprocess.run([cuobjdump(), "-res-usage", str(path)], capture_output=True, text=True, check=True).stdout
        sass = subprocess.run([cuobjdump(), "-sass", str(path)], capture_output=True, text=True, check=True).stdout
    regs = int(re.search(r"REG:(\d+)", res).group(1))
    alloc = -(-regs // 8) * 8  # registers are allocated in 8s per thread (256 per warp)
    blocks = min(65536 // (alloc * args.threads), 2048 // args.threads)
    n, hist = hottest_loop(sass)
    per_kb = f", {n * 1024 / args.bytes_per_iter:.0f} per KB" if args.bytes_per_iter else ""
    print(f"{args.source} {' '.join(args.defines)}: {regs} registers, {blocks} blocks / {blocks * args.threads // 32} "
          f"warps per SM; hottest loop {n} instructions{per_kb}")
    print("  " + ", ".join(f"{k} {v}" for k, v in hist.most_common()))


if __name__ == "__main__":
    main()
