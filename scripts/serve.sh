#!/usr/bin/env bash
# Install (idempotent) and serve the default model: scripts/serve.sh [ninfer serve options]
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install.sh
exec "${NINFER_VENV:-.venv}/bin/ninfer" serve "$@"
