#!/usr/bin/env bash
# Set up (first run) and run the main job: the medical LoRA fine-tune of the shipped tiny Llama, LoRA on an
# int8 base, fsdp_plus on 2 CPU processes, configured through Hydra. Extra arguments are Hydra overrides,
# e.g. `bash scripts/demo.sh experiment=legal_lora` or `bash scripts/demo.sh trainer.max_steps=500`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh run  # the runtime, the Hydra app and tcmalloc: no test tooling, no browser
source scripts/malloc.sh  # tcmalloc when installed: less resident memory, faster CPU steps
exec .venv/bin/fsdp-plus-train experiment=medical_lora "$@"
