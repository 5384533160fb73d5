"""Process-group helpers that also work in a single process without one (rank 0 of 1)."""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

# These modules bind the default process group into default arguments when imported (``group=group.WORLD``).
# Imported after ``init_process_group``, they would keep the group, and its gloo threads, alive past
# ``destroy_process_group`` until interpreter exit. Importing them with this package, before a group exists,
# lets :func:`shutdown` really free it.
import torch.distributed.fsdp.sharded_grad_scaler
import torch.distributed.nn.functional
import torch.distributed.optim  # noqa: F401


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
    if initialized():
        dist.destroy_process_group()
    _clear_dtensor_caches()
    gc.collect()


def _clear_dtensor_caches() -> None:
    """Empty DTensor's memo caches: their keys and values hold device meshes, and a mesh holds its groups.

    The caches are torch internals. One this torch version lacks is skipped; with the pinned torch,
    ``tests/test_dist.py`` fails if one that holds a group is missed.
    """
    from torch.distributed.tensor import DTensor, debug
    from torch.distributed.tensor import _redistribute as redistribute
    from torch.distributed.tensor._collective_utils import MeshTopoInfo

    def cache_clear(fn: object) -> Callable[[], object] | None:
        return getattr(fn, "cache_clear", None)

    propagator = DTensor._op_dispatcher.sharding_propagator
    clears = (
        getattr(debug, "_clear_sharding_prop_cache", None),  # op sharding decisions (Python and fast path)
        cache_clear(getattr(propagator, "_propagate_tensor_meta_cached", None)),
        getattr(redistribute, "clear_redistribute_planner_cache", None),  # weakly keyed; planners hold meshes
        cache_clear(getattr(redistribute, "_gen_transform_infos", None)),
        cache_clear(getattr(MeshTopoInfo, "build_from_mesh", None)),
    )
    for clear in clears:
        if clear is not None:
            clear()


def all_gather_object(obj: Any) -> list[Any]:
    """Every rank's ``obj``, in rank order."""
    if not initialized():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out
