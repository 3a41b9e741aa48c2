#!/usr/bin/env bash
# One command for a GPU machine without network access:
#   scripts/gpu_check.sh OUTDIR [WHEELDIR]
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
exit $status
