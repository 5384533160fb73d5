#!/usr/bin/env bash
# Set up (first run) and run the main job: a LoRA fine-tune of a tiny Llama on an int8 base, fsdp_plus on
# 2 CPU processes, configured through Hydra (extra arguments are Hydra overrides, e.g. trainer.max_steps=200).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
exec .venv/bin/fsdp-plus-train experiment=tiny_lora_int8 "$@"
