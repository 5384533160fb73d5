#!/usr/bin/env bash
# Set up (first run) and run the main job: a tiny Llama fine-tune on 2 CPU processes, fsdp_plus.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
exec .venv/bin/python examples/tiny_finetune.py "$@"
