"""Process-group helpers that also work in a single process without one (rank 0 of 1)."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist


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
    """Destroy the default process group, if any, so the process exits without tearing gloo down mid-flight.

    Left to interpreter exit, gloo's threads can be destroyed in the wrong order and abort the process
    ("terminate called without an active exception") after the work is done.
    """
    if initialized():
        dist.destroy_process_group()


def all_gather_object(obj: Any) -> list[Any]:
    """Every rank's ``obj``, in rank order."""
    if not initialized():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out
