"""Checkpoint scenarios on CPU processes, run as a script (see tests/test_checkpoint_distributed.py).

    python tests/helpers/ckpt_cases.py --out DIR --scenario NAME [--devices 2] [--kind full_ft|lora_int8|lora_nf4]
        [--state-dict-type sharded|full] [--max-steps N] [--resume last|PATH] [--sharding FULL_SHARD]
        [--step-sleep S] [--crash-on-commit N]  # N: SIGKILL rank 0 at its Nth checkpoint commit

Training: 3 epochs x 4 steps of SGD+momentum on fixed data (same order every epoch); a checkpoint
("last") every 4 steps, in DIR/ckpt. Each rank writes DIR/<scenario>.rank<r>.json (per-step global
losses); rank 0 writes DIR/<scenario>.pt (the full final state dict).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from pathlib import Path

import torch
from lightning.pytorch import Callback, Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

import lightning_fsdp_plus.checkpoint as checkpoint_module
from lightning_fsdp_plus import FSDPPlusStrategy
from tests.helpers.models import StridedSampler, TokenDataset, lora_llama, sgd_causal_lm, tiny_llama

STEPS_PER_EPOCH, BATCH = 4, 4


class Record(Callback):
    def __init__(self, out: Path, name: str, step_sleep: float) -> None:
        self.out, self.name, self.step_sleep = out, name, step_sleep
        self.losses: dict[int, float] = {}

    def on_train_start(self, trainer, module) -> None:
        (self.out / f"{self.name}.rank{trainer.global_rank}.pid").write_text(str(os.getpid()))

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        loss = trainer.strategy.reduce(outputs["loss"].detach().float(), reduce_op="mean").item()
        self.losses[trainer.global_step] = loss
        (self.out / f"{self.name}.rank{trainer.global_rank}.progress").write_text(str(trainer.global_step))
        time.sleep(self.step_sleep)

    def on_train_end(self, trainer, module) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        full = get_model_state_dict(
            trainer.strategy.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
        (self.out / f"{self.name}.rank{trainer.global_rank}.json").write_text(json.dumps({"losses": self.losses}))
        if trainer.global_rank == 0:
            torch.save({k: v.float() for k, v in full.items()}, self.out / f"{self.name}.pt")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--scenario", required=True)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--kind", default="full_ft")
    parser.add_argument("--state-dict-type", default="sharded")
    parser.add_argument("--sharding", default="FULL_SHARD")
    parser.add_argument("--max-steps", type=int, default=3 * STEPS_PER_EPOCH)
    parser.add_argument("--resume", default=None)
    parser.add_argument("--step-sleep", type=float, default=0.0)
    parser.add_argument("--crash-on-commit", type=int, default=0, help="SIGKILL rank 0 at the Nth checkpoint commit")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.crash_on_commit:
        original, calls = checkpoint_module.commit, []

        def crashing_commit(tmp, path):
            calls.append(path)
            if len(calls) == args.crash_on_commit:
                os.kill(os.getpid(), signal.SIGKILL)  # the new checkpoint is fully written but not yet in place
            original(tmp, path)

        checkpoint_module.commit = crashing_commit
    seed_everything(0)
    model = lora_llama(0, r=16) if args.kind.startswith("lora") else tiny_llama(0)
    strategy_kwargs = {
        "lora_int8": {"quantize_base": "int8", "lora_only": True},
        "lora_nf4": {"quantize_base": "nf4", "quantize_double": True},  # sharded 4-bit base, nested statistics
    }.get(args.kind, {})
    trainer = Trainer(
        strategy=FSDPPlusStrategy(args.sharding, state_dict_type=args.state_dict_type, **strategy_kwargs),
        accelerator="cpu",
        devices=args.devices,
        max_steps=args.max_steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        use_distributed_sampler=False,
        callbacks=[
            Record(args.out, args.scenario, args.step_sleep),
            ModelCheckpoint(
                dirpath=args.out / "ckpt", save_last=True, save_top_k=0, every_n_train_steps=STEPS_PER_EPOCH
            ),
        ],
    )
    dataset = TokenDataset(n=STEPS_PER_EPOCH * BATCH * 2)  # 2 ranks' worth; 1 rank takes all of it in 2x steps
    data = DataLoader(dataset, batch_size=BATCH * (2 // args.devices), sampler=StridedSampler(len(dataset)))
    trainer.fit(sgd_causal_lm(model, lr=0.05 if args.kind == "full_ft" else 0.5), data, ckpt_path=args.resume)


if __name__ == "__main__":
    main()  # FSDPPlusStrategy frees the process group at exit
