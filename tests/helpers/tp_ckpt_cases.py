"""A checkpoint of a tensor-parallel run loads on another layout exactly (issue 48).

    torchrun --nproc_per_node=4 tests/helpers/tp_ckpt_cases.py --out DIR --phase save   # dp 2 x tp 2, then dp 4
    python tests/helpers/tp_ckpt_cases.py --out DIR --phase one                          # one process

``save``: the GQA Llama of ``tp_cases`` trained ``2 x STEPS`` steps on (dp 2, tp 2), its checkpoint (sharded DCP,
then full: :data:`KINDS`) written with ``trainer.save_checkpoint`` after ``STEPS``: the uninterrupted run. Then, in
the same launch, the checkpoint resumed on (dp 4, tp 1) for the last ``STEPS`` (Lightning resumes mid-epoch from the
loader's first batch: the resumed run is given the batches after the checkpoint). ``one``: resumed on one process.
Each resume records the state it starts from and its losses; every run sees the same global batches. Rank 0 writes
``DIR/<phase>.json``: per format, the losses and the largest difference between the resumed start and the saved
state.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
from lightning.pytorch import Callback, Trainer, seed_everything
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.utils.data import DataLoader

from lightning_fsdp_plus import FSDPPlusStrategy
from lightning_fsdp_plus._dist import barrier, rank
from tests.helpers.ac_cases import UserLM
from tests.helpers.tp_cases import _FULL, build, global_batches

STEPS, SIZE = 3, 4
KINDS = ("sharded", "full")
"""Checkpoint formats (``state_dict_type``): a DCP directory, and one consolidated file written by rank 0."""
ARCH = "gqa"


class Saver(Callback):
    """Writes the checkpoint after ``STEPS`` steps and keeps the full state it holds (rank 0)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        self.losses.append(trainer.strategy.reduce(outputs["loss"].detach(), reduce_op="mean").item())
        if trainer.global_step == STEPS:
            trainer.save_checkpoint(self.path)
            self.saved = {k: v.clone() for k, v in get_model_state_dict(trainer.strategy.model, options=_FULL).items()}


class Resumed(Callback):
    """The state a resumed run starts from (rank 0) and its losses."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_start(self, trainer, module) -> None:
        self.start = {k: v.clone() for k, v in get_model_state_dict(trainer.strategy.model, options=_FULL).items()}

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        self.losses.append(trainer.strategy.reduce(outputs["loss"].detach(), reduce_op="mean").item())


def fit(*, tp: int, devices: int, callback: Callback, kind: str, ckpt_path: Path | None = None) -> None:
    seed_everything(0)
    data_parallel = devices // tp
    steps = global_batches(data_parallel=data_parallel, steps=2 * STEPS, size=SIZE)
    data_rank = int(os.environ.get("RANK", 0)) // tp
    batches = [step[data_rank] for step in steps][STEPS if ckpt_path else 0 :]
    strategy = FSDPPlusStrategy(tensor_parallel_size=tp, state_dict_type=kind)
    trainer = Trainer(strategy=strategy, accelerator="cpu", devices=devices,
                      max_steps=2 * STEPS, gradient_clip_val=0.5, gradient_clip_algorithm="norm",
                      limit_val_batches=0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, use_distributed_sampler=False, callbacks=[callback])  # fmt: skip
    trainer.fit(UserLM(build(ARCH)), train_dataloaders=DataLoader(batches, batch_size=None), ckpt_path=ckpt_path)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--phase", choices=("save", "one"), required=True)
    args = parser.parse_args()
    results: dict[str, dict] = {}
    for kind in KINDS:
        path = args.out / f"tp2-{kind}.ckpt"
        if args.phase == "save":
            saver = Saver(path)
            fit(tp=2, devices=4, callback=saver, kind=kind)
            resumed = Resumed()
            fit(tp=1, devices=4, callback=resumed, kind=kind, ckpt_path=path)
            if rank() == 0:
                torch.save(saver.saved, args.out / f"saved-{kind}.pt")
                results[kind] = {"uninterrupted": saver.losses, "dp4": resumed.losses,
                                 "dp4_start": _diff(resumed, saver.saved)}  # fmt: skip
        else:
            resumed = Resumed()
            fit(tp=1, devices=1, callback=resumed, kind=kind, ckpt_path=path)
            saved = torch.load(args.out / f"saved-{kind}.pt")
            results[kind] = {"one": resumed.losses, "one_start": _diff(resumed, saved)}
    if rank() == 0:
        (args.out / f"{args.phase}.json").write_text(json.dumps(results, indent=1))


def _diff(resumed: Resumed, saved: dict) -> float:
    assert resumed.start.keys() == saved.keys(), sorted(set(resumed.start) ^ set(saved))
    return max((resumed.start[k] - v).abs().max().item() for k, v in saved.items())


if __name__ == "__main__":
    main()
    barrier()
