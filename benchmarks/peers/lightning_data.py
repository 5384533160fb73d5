"""The plan's micro-batches as a Lightning dataloader and a callback that records them (the Lightning systems')."""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch import Callback
from torch.utils.data import DataLoader, Dataset

from benchmarks.peers.plan import micro_batch, rank_rows, target_tokens
from benchmarks.peers.record import Recorder


class PlanSteps(Dataset):
    """Item ``i`` is ``rank``'s whole micro-batch of step ``i`` (a DataLoader with ``batch_size=None``), with the
    global batch's target tokens under ``global_key`` when given (what the loss is normalised by)."""

    def __init__(self, plan: dict[str, Any], *, rank: int, steps: int, global_key: str | None = None) -> None:
        self.plan, self.rank, self.steps, self.global_key = plan, rank, steps, global_key

    def __len__(self) -> int:
        return self.steps

    def __getitem__(self, step: int) -> dict[str, torch.Tensor]:
        batch = micro_batch(rank_rows(self.plan, step=step, rank=self.rank), pad_id=self.plan["pad_id"])
        if self.global_key:
            total = sum(
                target_tokens(micro_batch(rank_rows(self.plan, step=step, rank=r), pad_id=0)["labels"])
                for r in range(len(self.plan["steps"][step]))
            )
            batch[self.global_key] = torch.full((batch["input_ids"].shape[0],), total, dtype=torch.long)
        return batch


def plan_loader(plan: dict[str, Any], *, rank: int, steps: int, global_key: str | None = None) -> DataLoader:
    """The DataLoader of :class:`PlanSteps` (no shuffling, no sampler: the plan is the order)."""
    return DataLoader(PlanSteps(plan, rank=rank, steps=steps, global_key=global_key), batch_size=None, shuffle=False)


class Recording(Callback):
    """Feeds the :class:`Recorder` each batch the model gets and each optimizer step's end."""

    def __init__(self, recorder: Recorder) -> None:
        self.recorder = recorder

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        """Digest and tokens of the batch."""
        self.recorder.batch(batch)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        """One optimizer step done (no accumulation here)."""
        self.recorder.step_end()
