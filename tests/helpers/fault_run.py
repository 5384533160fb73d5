"""A plain Lightning script that fails on one rank: ``python tests/helpers/fault_run.py --where backward --out DIR``.

Lightning's own launcher starts rank 1 (as ``python script.py`` with ``devices=2`` does for users). A small Llama
fine-tuned on the shipped medical instruction data (padding, masks, prompt masking) with ``CausalLMModule``, a
``MemoryMonitor``, norm clipping, a CSV logger, validation and a checkpoint every 2 steps — the pieces whose
exception paths once ran collectives. ``--where resumed`` first trains 2 steps and saves, then resumes and fails
in the first step after the resume.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from lightning.pytorch import Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger

from lightning_fsdp_plus import FSDPPlusStrategy
from lightning_fsdp_plus.app.data import InstructionDataModule
from lightning_fsdp_plus.app.lm import CausalLMModule, build_causal_lm
from lightning_fsdp_plus.memory import MemoryMonitor
from tests.helpers.faults import POINTS, FailOnRank

TOKENIZER = "examples/assets/tiny-llama"
DATA = "examples/medical_lora/data"


def trainer(out: Path, *, steps: int, callbacks: list) -> Trainer:
    return Trainer(
        strategy=FSDPPlusStrategy(),
        accelerator="cpu",
        devices=2,
        max_steps=steps,
        val_check_interval=2,
        check_val_every_n_epoch=None,
        limit_val_batches=2,
        num_sanity_val_steps=0,
        gradient_clip_val=1.0,
        log_every_n_steps=1,
        logger=CSVLogger(out),
        default_root_dir=out,
        enable_progress_bar=False,
        callbacks=[
            MemoryMonitor(log_every_n_steps=1),
            ModelCheckpoint(out / "ckpt", save_last=True, every_n_train_steps=2),
            *callbacks,
        ],
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--where", choices=POINTS, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--rank", type=int, default=1, help="the rank that fails")
    parser.add_argument("--stall", type=float, default=0.0, help="with --where batch_start: the other rank sleeps")
    args = parser.parse_args()
    seed_everything(0)
    data = InstructionDataModule(tokenizer=TOKENIZER, train_files=[f"{DATA}/train.jsonl"],
                                 val_files=[f"{DATA}/val.jsonl"], batch_size=4, max_seq_len=96)  # fmt: skip
    config = {"model_type": "llama", "vocab_size": len(data.tokenizer), "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 4, "num_attention_heads": 4}  # fmt: skip
    module = CausalLMModule(build_causal_lm(config=config))
    step = 0 if args.where == "checkpoint" else 1
    fault = FailOnRank(where=args.where, rank=args.rank, out=str(args.out), step=step, stall_s=args.stall)
    if args.where == "resumed":
        trainer(args.out, steps=2, callbacks=[]).fit(module, datamodule=data)
        module = CausalLMModule(build_causal_lm(config=config))
        trainer(args.out, steps=4, callbacks=[fault]).fit(module, datamodule=data, ckpt_path="last")
    else:
        trainer(args.out, steps=4, callbacks=[fault]).fit(module, datamodule=data)


if __name__ == "__main__":
    main()
