"""Process-group helpers that also work in a single process without one (rank 0 of 1)."""

from __future__ import annotations

import gc
from typing import Any

import torch.distributed as dist

# These modules bind the default process group into default arguments when imported (``group=group.WORLD``).
# Imported after ``init_process_group``, they would keep the group, and its gloo threads, alive past
# ``destroy_process_group`` until interpreter exit. Importing them with this package, before a group exists,
# lets :func:`shutdown` really free it.
import torch.distributed.fsdp.sharded_grad_scaler
import torch.distributed.nn.functional
import torch.distributed.optim  # noqa: F401

from lightning_fsdp_plus._private import clear_dtensor_caches
from lightning_fsdp_plus.failures import stop_failure_watch


def initialized() -> bool:
    """True when a default process group exists."""
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    """This process's global rank (0 without a process group)."""
    return dist.get_rank() if initialized() else 0


def barrier() -> None:
    """Wait for every rank (no-op without a process group)."""
    if initialized():
        dist.barrier()


def broadcast_object(obj: Any) -> Any:
    """Rank 0's ``obj`` on every rank."""
    if not initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def shutdown() -> None:
    """Destroy every process group and free it now, while the interpreter is fully alive.

    A gloo group that is still referenced is only torn down at interpreter exit, when its worker threads can
    abort the finished process ("terminate called without an active exception"). ``destroy_process_group``
    drops torch's own references; DTensor's caches and reference cycles (trainer, strategy, model) hold the
    rest, so both are cleared here too.
    """
    stop_failure_watch()
    if initialized():
        dist.destroy_process_group()
    clear_dtensor_caches()
    gc.collect()


def all_gather_object(obj: Any) -> list[Any]:
    """Every rank's ``obj``, in rank order."""
    if not initialized():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out
