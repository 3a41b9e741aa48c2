#!/usr/bin/env bash
# A/B of the int4 decode gemv routes (mma vs tiled) on a CUDA machine, in two short calls:
#   scripts/int4_ab.sh kernels   the tiled route's GPU tests, then scripts/gpu_int4_ab.py --quick
#                                (llama-8b shapes, asym g32, rows 1 and 8; tuning variants)   ~2-3 min
#   scripts/int4_ab.sh bench     ninfer bench, llama-8b int4 tg128 at 1 and 8 streams, the route forced
#                                by a profile file: mma, then tiled                           ~3 min
#   scripts/int4_ab.sh final     the tiled route's tests + model-level batch invariance on int4, then the
#                                bench on the built-in defaults (int4 on tiles)               ~4-5 min
# Logs go to ${OUT:-/tmp/int4_ab}.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/int4_ab}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
case "${1:-}" in
  kernels)
    python3 -m pytest -q -p no:cacheprovider tests/gpu/test_gemv_tiled.py 2>&1 | tee "$OUT/tests.log" | tail -15
    python3 scripts/gpu_int4_ab.py --quick 2>&1 | tee "$OUT/ab.log"
    ;;
  bench)
    for route in mma tiled; do
      printf 'version: 1\ngemv: {int4_sym: %s, int4_asym: %s}\n' "$route" "$route" > "$OUT/$route.yaml"
      echo "== int4 on the $route route"
      python3 -m ninfer.cli.main bench --synthetic llama-8b --backend cuda --weights int4 -p 0 -n 128 -r 2 -c 1,8 \
        --device-profile "$OUT/$route.yaml" 2>&1 | tee "$OUT/bench_$route.log" | grep -v "^\s*$" | tail -8
    done
    ;;
  final)
    # the route's GPU tests, model-level batch invariance on int4 (defaults = tiled, and each route
    # forced), then tg128 at 1 and 8 streams on the built-in defaults (int4: tiled, per-shape variants)
    python3 -m pytest -q -p no:cacheprovider tests/gpu/test_gemv_tiled.py \
      "tests/gpu/test_batch_invariance.py::test_batch_and_prefix_invariance[int4-defaults]" \
      "tests/gpu/test_batch_invariance.py::test_batch_and_prefix_invariance[int4-gemv-tiled]" \
      2>&1 | tee "$OUT/final_tests.log" | tail -8
    python3 -m ninfer.cli.main bench --synthetic llama-8b --backend cuda --weights int4 -p 0 -n 128 -r 2 -c 1,8 \
      --device-profile off 2>&1 | tee "$OUT/bench_final.log" | grep -v "^\s*$" | tail -8
    ;;
  *) echo "usage: scripts/int4_ab.sh kernels|bench|final"; exit 2 ;;
esac
