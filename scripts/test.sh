#!/usr/bin/env bash
# Install (idempotent) with the dev extra and run the whole test suite: scripts/test.sh [pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install.sh dev
exec "${NINFER_VENV:-.venv}/bin/python" -m pytest -q "$@"
