"""The run's data layout across attempts: the global batch a resume keeps, and each attempt's world size.

A run's global batch (examples per optimizer step) is ``data.global_batch_size``, else ``data.batch_size x ranks x
trainer.accumulate_grad_batches`` of its first attempt. Its data modules save it in every checkpoint; an attempt
that resumes on another number of ranks reads it back before it trains, keeps it (accumulating what fewer ranks
cannot hold: ``trainer.accumulate_grad_batches`` is set for it) and says once what differs. Each attempt's layout and
the step it started at are appended to ``attempts.json`` in the run directory (and reported in ``metrics.json``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_fsdp_plus.app.data import SAMPLE_INDEX_KEY
from lightning_fsdp_plus.app.requeue import pending_hpc_checkpoint
from lightning_fsdp_plus.checkpoint import META
from lightning_fsdp_plus.sampler import accumulation_for, data_parallel_ranks

ATTEMPTS_FILE = "attempts.json"
"""Each attempt's layout in the run directory: world size, global batch, micro-batch, accumulation, first step."""


def resume_path(ckpt_path: str | None, run_dir: Path) -> Path | None:
    """The checkpoint a fit with ``ckpt_path`` resumes from: a path, ``"last"`` (the newest ``last*.ckpt`` of the
    run's checkpoints, as Lightning picks it), ``"hpc"`` or nothing given (a pending SLURM checkpoint)."""
    if ckpt_path in (None, "hpc"):
        return pending_hpc_checkpoint(run_dir)
    if ckpt_path == "last":
        found = sorted((run_dir / "checkpoints").glob("last*.ckpt"), key=lambda p: p.stat().st_mtime)
        return found[-1] if found else None
    path = Path(ckpt_path)
    return path if path.exists() else None


def recorded_layout(checkpoint: Path | None) -> dict[str, int] | None:
    """The data layout a checkpoint was written with (its data module's state), or None when it holds none."""
    if checkpoint is None:
        return None
    meta = checkpoint / META if checkpoint.is_dir() else checkpoint
    if not meta.is_file():
        return None
    state = torch.load(meta, map_location="cpu", weights_only=True, mmap=not checkpoint.is_dir())
    for value in state.values():
        if isinstance(value, dict) and "global_batch_size" in value and "world_size" in value:
            return {k: int(v) for k, v in value.items()}
    return None


def plan_layout(*, trainer: Trainer, datamodule: Any, recorded: dict[str, int] | None) -> dict[str, int]:
    """Set the global batch and the trainer's accumulation for this attempt; return its layout.

    The global batch: ``datamodule.global_batch_size`` when set, else the checkpoint's, else this attempt's
    ``batch_size x ranks x accumulate_grad_batches``. A micro-batch that does not divide it over the ranks is lowered
    to the largest that does, with a warning (4 ranks resuming a run of 2 x 8 take 4 each); when none does (3 ranks
    for 16), :class:`~lightning_fsdp_plus.sampler.LayoutError`, before anything trains. A resume on another world
    size warns once: the samples and global batches stay, each rank's random streams (dropout) do not. An integer
    ``val_check_interval`` (the app's, in optimizer steps) is scaled to the micro-batches Lightning counts.
    """
    (world, _), micro = data_parallel_ranks(trainer), datamodule.batch_size
    given = getattr(datamodule, "global_batch_size", None)
    total = given or (recorded or {}).get("global_batch_size") or micro * world * trainer.accumulate_grad_batches
    fits = [m for m in range(min(micro, total // world), 0, -1) if total % (world * m) == 0]
    if fits and fits[0] != micro:
        rank_zero_warn(f"data.batch_size={micro} is lowered to {fits[0]}: the global batch of {total} on {world}"
                       f" ranks needs a micro-batch that divides it (valid up to {micro}: {sorted(fits)})")  # fmt: skip
        micro = datamodule.batch_size = fits[0]
    accumulate = accumulation_for(global_batch_size=total, world_size=world, micro_batch_size=micro)
    if accumulate != trainer.accumulate_grad_batches and trainer.accumulate_grad_batches != 1:
        rank_zero_warn(
            f"trainer.accumulate_grad_batches={trainer.accumulate_grad_batches} is replaced by"
            f" {accumulate}: the global batch of {total} on {world} ranks x micro-batch {micro} needs it"
        )
    trainer.accumulate_grad_batches = accumulate
    datamodule.global_batch_size = total
    if isinstance(trainer.val_check_interval, int) and trainer.check_val_every_n_epoch is None:
        # the app's interval counts optimizer steps; Lightning's counts micro-batches: validation, and the checkpoint
        # saved after it, must fall between optimizer steps, not inside one's accumulation
        trainer.val_check_interval *= accumulate
    if recorded is not None and recorded.get("world_size") != world:
        rank_zero_warn(
            f"resuming on {world} ranks (micro-batch {micro}, accumulating {accumulate}) a run"
            f" checkpointed on {recorded['world_size']} (micro-batch {recorded['micro_batch_size']},"
            f" accumulating {recorded['accumulate_grad_batches']}): the same samples in the same global"
            f" batches of {total}; per-rank random streams (dropout) differ from the uninterrupted run's"
        )
    return {"world_size": world, "global_batch_size": total, "micro_batch_size": micro,
            "accumulate_grad_batches": accumulate}  # fmt: skip


def rescale_progress(checkpoint: dict[str, Any], *, old_accumulate: int, new_accumulate: int) -> None:
    """Lightning's training progress in ``checkpoint`` re-counted for another accumulation, in place.

    Lightning counts a rank's micro-batches (in the epoch and in all), so after a resume on another layout it would
    place the optimizer steps wrongly and end the epoch early or late; the optimizer steps, the epochs and the
    loader's global position stay as they are. Checkpoints are written after an optimizer step, so the counts are
    whole steps (``completed`` lags ``processed`` by the batch being finished, a micro-batch on any layout).
    """
    if old_accumulate == new_accumulate:
        return
    loop = checkpoint.get("loops", {}).get("fit_loop", {})
    progress = loop.get("epoch_loop.batch_progress")
    if progress is None:
        return

    def scale(value: int) -> int:
        return value // old_accumulate * new_accumulate

    for counts in (progress["total"], progress["current"]):
        lag = counts["processed"] - counts["completed"]
        for key in ("ready", "started", "processed"):
            counts[key] = scale(counts[key])
        counts["completed"] = counts["processed"] - lag
    for state in loop.get("state_dict", {}).get("combined_loader", []):
        for key in ("_num_yielded", "_sampler_iter_yielded"):
            if isinstance(state.get(key), int):
                state[key] = scale(state[key])


class AttemptLog(Callback):
    """Appends this attempt's layout and first step to ``run_dir/attempts.json`` (rank 0) when training starts, and
    logs the training-set indices of each rank's micro-batches with their optimizer step to
    ``run_dir/samples.rank<R>.jsonl`` (one line ``{"step", "ids"}`` a micro-batch; a fresh run starts it anew)."""

    def __init__(self, run_dir: Path, layout: dict[str, int], *, resuming: bool) -> None:
        self.path, self.layout, self.resuming = Path(run_dir) / ATTEMPTS_FILE, dict(layout), resuming
        self.attempts: list[dict[str, Any]] = []
        """Every attempt of the run so far, this one last (on rank 0)."""
        self._samples: Any = None

    def on_load_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        """Re-count the checkpoint's training progress for this attempt's accumulation (before it is restored)."""
        recorded = next((v for v in checkpoint.values() if isinstance(v, dict) and "accumulate_grad_batches" in v),
                        None)  # fmt: skip
        if recorded is not None:
            rescale_progress(checkpoint, old_accumulate=int(recorded["accumulate_grad_batches"]),
                             new_accumulate=self.layout["accumulate_grad_batches"])  # fmt: skip

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Record the attempt (its first step is the checkpoint's, 0 for a fresh run, which starts the list anew).
        Rank 0 reads and writes the file (atomically); the other ranks only log their samples."""
        if trainer.is_global_zero:
            earlier = json.loads(self.path.read_text()) if self.resuming and self.path.is_file() else []
            self.attempts = [*earlier, {"attempt": len(earlier) + 1, "start_step": trainer.global_step, **self.layout}]
            partial = self.path.with_name(f".{self.path.name}.tmp")
            partial.write_text(json.dumps(self.attempts, indent=1))
            os.replace(partial, self.path)
        samples = self.path.parent / f"samples.rank{trainer.global_rank}.jsonl"
        if not self.resuming:
            samples.unlink(missing_ok=True)
        self._samples = samples.open("a")

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        """Log the micro-batch's sample indices (batches that carry them)."""
        if self._samples is not None and isinstance(batch, dict) and SAMPLE_INDEX_KEY in batch:
            ids = batch[SAMPLE_INDEX_KEY].tolist()
            self._samples.write(json.dumps({"step": trainer.global_step, "ids": ids}) + "\n")
            self._samples.flush()

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Close the sample log."""
        if self._samples is not None:
            self._samples.close()
            self._samples = None
