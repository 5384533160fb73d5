"""An exception on one rank only, at a chosen point of a run (for the plain Trainer script and the Hydra app).

    FailOnRank(where="backward", rank=1)
    fsdp-plus-train ... +callbacks.fault._target_=tests.helpers.faults.FailOnRank +callbacks.fault.where=backward

Every rank writes ``<out>/pid.rank<r>`` (its process id) when training starts, and the failing rank
``<out>/injected.json`` (time and message) just before it raises, so a test can check that every rank is gone
within seconds of the failure and that the message reached the user.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from lightning.pytorch import Callback
from torch.distributed.fsdp import FSDPModule

POINTS = ("forward", "backward", "optimizer", "validation", "checkpoint", "resumed", "batch_start")
"""Where the failure can be injected: inside a unit's forward, inside a unit's backward (the other rank is then in
its reduce-scatter), before the optimizer step, in a validation batch, while a checkpoint is saved, in the first
step after a resume, at the start of a batch (before any collective of the step)."""


class InjectedFailure(RuntimeError):
    """The injected error (its message names the point and the rank)."""


class FailOnRank(Callback):
    """Raise :class:`InjectedFailure` on ``rank`` at ``where`` (one of :data:`POINTS`) during step ``step`` (or the
    first validation batch after it, or the first checkpoint save)."""

    def __init__(
        self, *, where: str, rank: int = 1, step: int = 1, out: str | None = None, stall_s: float = 0.0
    ) -> None:
        if where not in POINTS:
            raise ValueError(f"where={where!r} is not one of {', '.join(POINTS)}")
        self.where, self.rank, self.step, self.stall_s = where, rank, step, stall_s
        self.out = Path(out or os.environ.get("FAULT_OUT", "."))
        self.armed = False
        self._resumed_at: int | None = None

    def message(self) -> str:
        return f"injected failure at {self.where} on rank {self.rank}"

    def _fail(self, trainer) -> None:
        if trainer.global_rank != self.rank:
            return
        (self.out / "injected.json").write_text(json.dumps({"time": time.time(), "message": self.message()}))
        raise InjectedFailure(self.message())

    def _unit(self, module):
        units = [m for m in module.modules() if isinstance(m, FSDPModule) and m is not module]
        return units[len(units) // 2]

    def on_train_start(self, trainer, module) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / f"pid.rank{trainer.global_rank}").write_text(str(os.getpid()))
        if self.where == "resumed":
            self._resumed_at = trainer.global_step if trainer.ckpt_path else None
        if self.where in ("forward", "backward", "resumed"):
            unit = self._unit(module)

            def hook(mod, args, output):
                if not self.armed:
                    return output
                if self.where == "backward":
                    tensor = output[0] if isinstance(output, tuple) else output
                    tensor.register_hook(lambda grad: self._fail(trainer))
                    return output
                self._fail(trainer)

            unit.register_forward_hook(hook)

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        if self.where == "batch_start" and trainer.global_step == self.step:
            if trainer.global_rank != self.rank:
                time.sleep(self.stall_s)  # a rank busy outside any collective (slow I/O, a hang): only a watch ends it
            self._fail(trainer)
        if self.where == "resumed":
            self.armed = self._resumed_at is not None and trainer.global_step == self._resumed_at
        else:
            self.armed = trainer.global_step == self.step

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        self.armed = False

    def on_before_optimizer_step(self, trainer, module, optimizer) -> None:
        if self.where == "optimizer" and trainer.global_step == self.step:
            self._fail(trainer)

    def on_validation_batch_start(self, trainer, module, batch, batch_idx, dataloader_idx=0) -> None:
        if self.where == "validation" and trainer.global_step >= self.step and not trainer.sanity_checking:
            self._fail(trainer)

    def on_save_checkpoint(self, trainer, module, checkpoint) -> None:
        if self.where == "checkpoint":
            self._fail(trainer)
