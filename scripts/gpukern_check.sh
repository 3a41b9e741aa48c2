#!/usr/bin/env bash
# The gpukern branch on one GPU, in one call (~8 min on an H200; every step has its own timeout and
# a failure does not stop the rest):
#   1. its GPU tests: the fused gated-MLP and residual-norm epilogues and RoPE-in-attention (bit-equal to the kernels
#      they replace), plus the existing gemv / attention / rope tests the shared epilogue touches;
#   2. `ninfer bench --backend cuda`, before (BASE_TREE, a checkout of main) and after (this tree),
#      interleaved per model, then one compact table:
#        SMOL_GGUF (the default model's GGUF)         pp512, tg128
#        --synthetic llama-8b --weights int4          tg128 at 1 and 8 streams
#        Q4KM_GGUF (a Q4_K_M llama-8b-shaped GGUF)    tg128
# Usage: BASE_TREE=/path/to/main SMOL_GGUF=/path/smol.gguf Q4KM_GGUF=/path/8b.Q4_K_M.gguf \
#          scripts/gpukern_check.sh [all|tests|bench]
# A model whose variable is unset is skipped; without BASE_TREE only "after" runs. Logs and jsonl go
# to ${OUT:-/tmp/gpukern_check}. Routes are the built-in defaults (--device-profile off) on both sides.
set -u
cd "$(dirname "$0")/.."
HERE="$PWD"
OUT="${OUT:-/tmp/gpukern_check}"
PY="${PYTHON:-python3}"
MODE="${1:-all}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NINFER_CACHE="${NINFER_CACHE:-/tmp/ninfer-cache}"
BASE="${BASE_TREE:-}"
if [ -n "$BASE" ] && [ ! -d "$BASE/ninfer" ]; then
  echo "BASE_TREE=$BASE has no ninfer/ package: running 'after' only"
  BASE=""
fi
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | head -1
echo "after: $HERE ($(git -C "$HERE" rev-parse --short HEAD 2>/dev/null || echo no-git))"
[ -n "$BASE" ] && echo "before: $BASE ($(git -C "$BASE" rev-parse --short HEAD 2>/dev/null || echo no-git))"

if [ "$MODE" = all ] || [ "$MODE" = tests ]; then
  echo "== GPU tests: the new kernels (timeout 240 s)"
  PYTHONPATH="$HERE${PYTHONPATH:+:$PYTHONPATH}" timeout 240 "$PY" -m pytest -q -p no:cacheprovider \
    tests/gpu/test_fused_glu.py tests/gpu/test_rope_attention.py tests/gpu/test_fused_norm.py > "$OUT/tests.log" 2>&1
  echo "pytest exit $? (124: timed out)"
  grep -E "passed|failed|error" "$OUT/tests.log" | tail -2
  grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | head -20
  echo "== GPU tests: what the shared epilogue and rope rounding touch (timeout 150 s)"
  PYTHONPATH="$HERE${PYTHONPATH:+:$PYTHONPATH}" timeout 150 "$PY" -m pytest -q -p no:cacheprovider \
    tests/gpu/test_kernels.py tests/gpu/test_gemv_tiled.py tests/gpu/test_blocks_kernels.py \
    -k "rope_kv or paged_attention_decode or swiglu or gemv_mma or 576x576 or 960x576 or 576x1536 \
        or batch_invariant or model_on_the_tiled_route" > "$OUT/tests_touched.log" 2>&1
  echo "pytest exit $? (124: timed out)"
  grep -E "passed|failed|error" "$OUT/tests_touched.log" | tail -2
  grep -E "^(FAILED|ERROR)" "$OUT/tests_touched.log" | head -20
fi

[ "$MODE" = tests ] && exit 0

COMMON=(--backend cuda --device-profile off --ceilings off -o jsonl)
CASES=()  # name|timeout|args
[ -n "${SMOL_GGUF:-}" ] && CASES+=("smol|120|$SMOL_GGUF -p 512 -n 128 -r 3")
CASES+=("llama8b-int4|170|--synthetic llama-8b --weights int4 -p 0 -n 128 -r 2 -c 1,8")
[ -n "${Q4KM_GGUF:-}" ] && CASES+=("llama8b-q4km|170|$Q4KM_GGUF -p 0 -n 128 -r 2")

run_bench() {  # side tree name timeout args...
  local side="$1" tree="$2" name="$3" limit="$4"
  shift 4
  echo "-- $name $side"
  (cd "$tree" && PYTHONPATH="$tree${PYTHONPATH:+:$PYTHONPATH}" timeout "$limit" "$PY" -m ninfer.cli.main bench "$@" "${COMMON[@]}") \
    > "$OUT/$name.$side.jsonl" 2> "$OUT/$name.$side.err"
  local rc=$?
  [ $rc -ne 0 ] && { echo "   exit $rc (124: timed out); last lines:"; tail -3 "$OUT/$name.$side.err"; }
  return 0
}

for c in "${CASES[@]}"; do
  IFS='|' read -r name limit args <<< "$c"
  # shellcheck disable=SC2086
  [ -n "$BASE" ] && run_bench before "$BASE" "$name" "$limit" $args
  # shellcheck disable=SC2086
  run_bench after "$HERE" "$name" "$limit" $args
done

"$PY" - "$OUT" <<'PY' || true
import json, sys
from pathlib import Path

out = Path(sys.argv[1])
rows = {}
for f in sorted(out.glob("*.jsonl")):
    name, side = f.name.split(".")[:2]
    for line in f.read_text().splitlines():
        try:
            r = json.loads(line)
        except ValueError:
            continue
        test = f"pp{r['n_prompt']}" if r["n_prompt"] else f"tg{r['n_gen']} x{r['n_concurrency']}"
        rows.setdefault((name, test), {})[side] = (r["avg_ts"], r["stddev_ts"])
print(f"\n{'model':14} {'test':10} {'before tok/s':>16} {'after tok/s':>16} {'after/before':>12}")
for (name, test), v in rows.items():
    b, a = v.get("before"), v.get("after")
    cell = lambda x: f"{x[0]:9.1f} ± {x[1]:5.1f}" if x else f"{'-':>16}"
    ratio = f"{a[0] / b[0]:12.3f}" if a and b else f"{'-':>12}"
    print(f"{name:14} {test:10} {cell(b):>16} {cell(a):>16} {ratio}")
PY
