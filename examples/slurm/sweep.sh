#!/usr/bin/env bash
# A sweep over sharding strategies, each job submitted to SLURM by Hydra's submitit launcher (pip install
# lightning-fsdp-plus[app,slurm]); run it from the repository (or give model.name_or_path an absolute path):
#   bash examples/slurm/sweep.sh [more overrides]
# Every job gets tasks_per_node tasks (one per device) and its own directory under the sweep's; the sweep summary
# (sweep_summary.{csv,md,png}) is written to the sweep directory when the last job ends.
# On GPUs: hydra.launcher.gpus_per_node=8 hydra.launcher.tasks_per_node=8 trainer.accelerator=gpu trainer.devices=8;
# several nodes: hydra.launcher.nodes=N trainer.num_nodes=N. hydra.launcher.partition=... picks the partition.
set -euo pipefail
exec scripts/run fsdp-plus-train -m hydra/launcher=submitit_slurm \
  hydra.launcher.tasks_per_node=2 hydra.launcher.timeout_min=30 \
  experiment=medical_lora trainer.devices=2 strategy=lora_int8_replicated,lora_int8_sharded "$@"
