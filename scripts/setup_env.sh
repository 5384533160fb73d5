#!/usr/bin/env bash
# Create .venv (once) with the CPU build of torch and the package in editable mode. Idempotent and quick
# when nothing changed: it reinstalls only when pyproject.toml or constraints.txt differ from the last run.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
stamp=.venv/.fsdp-plus-installed
want=$(cat pyproject.toml constraints.txt | sha256sum | cut -d' ' -f1)
if [ -x .venv/bin/python ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
# tcmalloc for CPU runs (scripts/malloc.sh preloads it), from Debian's packages where we may install them; optional
if ! ls /usr/lib/*/libtcmalloc_minimal.so.4 /usr/lib*/libtcmalloc_minimal.so.4 >/dev/null 2>&1 \
   && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  (apt-get install -y -q libtcmalloc-minimal4 >/dev/null 2>&1 \
   || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q libtcmalloc-minimal4 >/dev/null 2>&1; }) \
   || echo "setup_env: libtcmalloc-minimal4 not installed (optional: runs use glibc's malloc)" >&2
fi
# headless Chromium for the docs' browser check (tests/docs/test_site.py), from Debian's packages; optional elsewhere
if ! command -v chromium-headless-shell >/dev/null 2>&1 && ! command -v chromium >/dev/null 2>&1 \
   && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  (apt-get install -y -q chromium-headless-shell >/dev/null 2>&1 \
   || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q chromium-headless-shell >/dev/null 2>&1; }) \
   || echo "setup_env: chromium-headless-shell not installed (the docs' browser check needs it)" >&2
fi
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# torch first and pinned: it must be the CPU build, not a CUDA one pulled in by another package's range
.venv/bin/python -m pip install -q -c constraints.txt torch==2.13.0
.venv/bin/python -m pip install -q -c constraints.txt -e ".[dev]"
echo "$want" > "$stamp"
