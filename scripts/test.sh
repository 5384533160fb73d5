#!/usr/bin/env bash
# Set up (first run) and run the whole test suite: lint, the documentation site (mkdocs build --strict), then pytest
# (multi-process tests use gloo on CPU) on every core (pytest-xdist, see tests/conftest.py; extra arguments go to
# pytest, e.g. -n 0 for one process).
# The cluster tests (tests/slurm/) need a SLURM controller: as root this starts a one-node one
# (scripts/slurm_local.sh) and stops it afterwards; otherwise start it yourself with sudo, or set
# FSDP_PLUS_SKIP_SLURM=1 to skip those tests explicitly.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
.venv/bin/ruff check .
NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict --quiet --site-dir site  # the docs site: broken links fail
if [ "${FSDP_PLUS_SKIP_SLURM:-0}" != 1 ] && [ "$(id -u)" = 0 ] && ! bash scripts/slurm_local.sh status >/dev/null 2>&1; then
  bash scripts/slurm_local.sh start
  trap 'bash scripts/slurm_local.sh stop >/dev/null' EXIT
fi
.venv/bin/python -m pytest "$@"
