#!/usr/bin/env bash
# ninfer and llama.cpp side by side on one GGUF (the peer numbers docs/PERF.md records):
#
#   scripts/llamacpp_peer.sh LLAMA_CPP_SRC MODEL.gguf OUTDIR [extra ninfer bench args]
#
# Builds llama.cpp's llama-bench from a source tree (CUDA for the local GPU's arch when nvcc is
# there, else CPU) into LLAMA_CPP_SRC/build-peer once, then runs pp512 / tg128 with both, writing
# OUTDIR/llamacpp.json, OUTDIR/ninfer.json and the logs. A source tree small enough to carry:
#   tar -C llama.cpp -cJf llama.cpp-src.tar.xz CMakeLists.txt cmake ggml src include common tools vendor app
# (llama.cpp's own repository, or vendor/llama.cpp of the llama-cpp-python sdist).
# A synthetic 8B-shape Q4_K_M to run it on: python scripts/synthetic_gguf.py llama-8b /tmp/llama-8b.Q4_K_M.gguf
set -euo pipefail
SRC=${1:?llama.cpp source tree}
MODEL=${2:?GGUF file}
OUT=${3:?output folder}
shift 3
mkdir -p "$OUT"
BUILD="$SRC/build-peer"
if [ ! -x "$BUILD/bin/llama-bench" ]; then
  CUDA_FLAGS=()
  if command -v nvcc >/dev/null 2>&1 || [ -x /usr/local/cuda/bin/nvcc ]; then
    ARCH=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -1 | tr -d '.')
    CUDA_FLAGS=(-DGGML_CUDA=ON "-DCMAKE_CUDA_ARCHITECTURES=${ARCH:-90}" -DCMAKE_CUDA_COMPILER="$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)")
  fi
  cmake -S "$SRC" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF "${CUDA_FLAGS[@]}" \
    >"$OUT/llamacpp-cmake.log" 2>&1
  cmake --build "$BUILD" --target llama-bench -j"$(nproc)" >"$OUT/llamacpp-build.log" 2>&1
fi
"$BUILD/bin/llama-bench" -m "$MODEL" -p 512 -n 128 -ngl 99 -r 5 -o json >"$OUT/llamacpp.json" 2>"$OUT/llamacpp.log"
ninfer bench "$MODEL" -p 512 -n 128 -r 5 -o json "$@" >"$OUT/ninfer.json" 2>"$OUT/ninfer.log"
python - "$OUT" <<'EOF'
import json, sys
from pathlib import Path

out = Path(sys.argv[1])
for name in ("llamacpp", "ninfer"):  # both write llama-bench's JSON fields
    for r in json.loads((out / f"{name}.json").read_text()):
        test = f"pp{r['n_prompt']}" if r.get("n_prompt") else f"tg{r['n_gen']}"
        print(f"{name:9s} {test:6s} {r['avg_ts']:9.1f} ± {r['stddev_ts']:.1f} t/s")
EOF
