"""Count the SASS instructions of a kernel's hottest loop without a GPU: compile a kernels/*.cu module
with NVRTC for an arch (sm_90 by default), disassemble it with cuobjdump, find the loops (a backward
branch to an earlier address) and print, per loop, the instruction count by opcode. The proxy metric
for a decode gemv: instructions per weight byte of one loop iteration.

    python scripts/sass_loop.py blocks.cu gemv_blocks_tile -D BLK_FMT=0 [--bytes 4608]

cuobjdump comes from the nvidia-cuda-cuobjdump wheel and the nvdisasm it runs from nvidia-cuda-nvdisasm
(both in site-packages/nvidia/cu13/bin, put on PATH for it here)."""
from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from ninfer.kernels.compiler import HEADERS, KERNEL_DIR, nvrtc_compile  # noqa: E402


def cuobjdump() -> str:
    import nvidia

    for root in nvidia.__path__:
        for p in Path(root).glob("cu*/bin/cuobjdump"):
            return str(p)
    return "cuobjdump"


LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z0-9_.]+)([^;]*);")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("source")
    ap.add_argument("kernel")
    ap.add_argument("-D", action="append", default=[], help="NAME=VALUE")
    ap.add_argument("--arch", default="sm_90")
    ap.add_argument("--bytes", type=float, default=0.0, help="weight bytes one loop iteration reads (per warp)")
    args = ap.parse_args()
    opts = [f"--gpu-architecture={args.arch}", "--std=c++17", "-default-device", *(f"-D{d}" for d in args.D)]
    cubin = nvrtc_compile((KERNEL_DIR / args.source).read_text(), args.source, opts,
                          {h: (KERNEL_DIR / h).read_text() for h in HEADERS})
    tool = cuobjdump()
    env = {**os.environ, "PATH": f"{Path(tool).parent}{os.pathsep}{os.environ.get('PATH', '')}"}  # its nvdisasm
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run([tool, "-sass", "-fun", args.kernel, f.name], capture_output=True,
                              text=True, check=True, env=env).stdout
        res = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True).stdout
    m = re.search(rf"Function {re.escape(args.kernel)}:\s*\n\s*(REG:\d+)", res)
    instrs = [(int(a, 16), op, rest) for a, _, op, rest in LINE.findall(sass)]
    print(f"{args.kernel} {' '.join(args.D)} {args.arch}: {len(instrs)} instructions, {m.group(1) if m else '?'}")
    loops = []
    for addr, op, rest in instrs:
        if op.startswith("BRA") and (t := re.search(r"0x([0-9a-f]+)", rest)) and int(t.group(1), 16) < addr:
            loops.append((int(t.group(1), 16), addr))
    for start, end in loops:
        body = [op for a, op, _ in instrs if start <= a <= end]
        kinds = collections.Counter(op.split(".")[0] for op in body)
        line = f"  loop {start:#06x}..{end:#06x}: {len(body)} instructions"
        if args.bytes:
            line += f", {len(body) / (args.bytes / 32):.2f} per weight byte and lane"
        print(line)
        print("    " + ", ".join(f"{k} {v}" for k, v in kinds.most_common()))


if __name__ == "__main__":
    main()
