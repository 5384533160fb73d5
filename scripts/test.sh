#!/usr/bin/env bash
# Set up (first run) and run the whole test suite: lint, the documentation site (mkdocs build --strict), then pytest
# (multi-process tests use gloo on CPU) on every core (pytest-xdist, see tests/conftest.py; extra arguments go to
# pytest, e.g. -n 0 for one process).
#   bash scripts/test.sh --quick   the quick lane for the edit-test loop (under 3 minutes of pytest on 2 cores): lint,
#                                  every module's single-process tests and one launch per major feature (no docs
#                                  build, no SLURM; tests/conftest.py says what it keeps)
# The cluster tests (tests/slurm/) need a SLURM controller: as root this starts a one-node one
# (scripts/slurm_local.sh) and stops it afterwards; otherwise start it yourself with sudo, or set
# FSDP_PLUS_SKIP_SLURM=1 to skip those tests explicitly.
set -euo pipefail
cd "$(dirname "$0")/.."
quick=0
if [ "${1:-}" = --quick ]; then
  quick=1
  shift
fi
bash scripts/setup_env.sh test  # also pytest, ruff, the docs tools and the browser check's Chromium
.venv/bin/ruff check .
if [ "$quick" = 1 ]; then
  exec .venv/bin/python -m pytest --quick "$@"
fi
NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict --quiet --site-dir site  # the docs site: broken links fail
if [ "${FSDP_PLUS_SKIP_SLURM:-0}" != 1 ] && [ "$(id -u)" = 0 ] && ! bash scripts/slurm_local.sh status >/dev/null 2>&1; then
  bash scripts/slurm_local.sh start
  trap 'bash scripts/slurm_local.sh stop >/dev/null' EXIT
fi
.venv/bin/python -m pytest "$@"
