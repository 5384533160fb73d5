#!/usr/bin/env bash
# Set up (first run) and run the whole test suite: lint, then pytest (multi-process tests use gloo on CPU).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
.venv/bin/ruff check .
exec .venv/bin/python -m pytest "$@"
