#!/usr/bin/env bash
# On a CUDA machine: the kernel tests, then the kernel measurements. Logs go to ${1:-.}.
set -o pipefail
out=${1:-.}
PYTHONUNBUFFERED=1 python3 -m pytest -m gpu tests/gpu -q -p no:cacheprovider 2>&1 | tee "$out/test.log" | tail -40
PYTHONUNBUFFERED=1 PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} python3 scripts/gpu_kernels.py 2>&1 | tee "$out/bench.log"
