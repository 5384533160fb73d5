"""Exact, tensor-accounted bytes of model state on this rank: parameters, gradients, optimizer state.

Counts what each rank really holds: the local shard of every DTensor, the unsharded copies FSDP2 keeps
alive between a unit's forward and backward (``SHARD_GRAD_OP``, the root), replicated parameters in full.
Works on any device, so CPU runs can be compared with the sharding arithmetic.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule

from lightning_fsdp_plus._private import fsdp_param_records, sharded_state


@dataclass(frozen=True)
class ModelStateBytes:
    """Bytes this rank holds, by category."""

    params: int
    """Sharded (local shard) and replicated parameter storage."""
    unsharded_params: int
    """All-gathered parameter copies currently alive (zero between steps)."""
    grads: int
    """Gradient storage (local shards)."""
    optimizer: int
    """Optimizer state tensors (local shards)."""

    @property
    def total(self) -> int:
        """All of the above."""
        return self.params + self.unsharded_params + self.grads + self.optimizer

    def to_dict(self) -> dict[str, int]:
        """The categories and the total as a plain dict."""
        return {**asdict(self), "total": self.total}


def local_bytes(tensor: Tensor) -> int:
    """Bytes of the part of ``tensor`` stored on this rank (the local shard of a DTensor)."""
    to_local = getattr(tensor, "to_local", None)
    local = to_local() if to_local is not None else tensor
    return local.numel() * local.element_size()


def _fsdp_params(module: nn.Module) -> Iterator[Any]:
    """FSDP2's per-parameter records (``FSDPParam``) of every unit inside ``module``."""
    for sub in module.modules():
        if isinstance(sub, FSDPModule):
            yield from fsdp_param_records(sub)


def _unsharded(fsdp_param: Any) -> Tensor | None:
    """The all-gathered parameter of ``fsdp_param`` if it is alive now, else None."""
    if fsdp_param.sharded_state is sharded_state().UNSHARDED and hasattr(fsdp_param, "_unsharded_param"):
        return fsdp_param._unsharded_param
    return None


def _nbytes(tensor: Tensor | None) -> int:
    return 0 if tensor is None else local_bytes(tensor)


def model_state_bytes(module: nn.Module, optimizers: Iterable[torch.optim.Optimizer] = ()) -> ModelStateBytes:
    """Bytes of parameters, alive unsharded copies, gradients and optimizer state on this rank.

    While a unit is unsharded its module attributes point at the all-gathered tensors; its local shards
    still exist, so FSDP-managed parameters are read from FSDP2's records (shard: ``params``, all-gathered
    copy: ``unsharded_params``), never twice. Parameters FSDP does not manage (ignored, replicated) count in full.
    """
    fsdp_params = list(_fsdp_params(module))
    unsharded = [_unsharded(fp) for fp in fsdp_params]
    managed = {id(fp.sharded_param) for fp in fsdp_params} | {id(t) for t in unsharded if t is not None}
    others = [p for p in module.parameters() if id(p) not in managed]
    optimizer = sum(
        local_bytes(value)
        for opt in optimizers
        for state in opt.state.values()
        for value in state.values()
        if isinstance(value, Tensor) and value.dim() > 0  # skip scalar step counters
    )
    grads = [fp.sharded_param.grad for fp in fsdp_params] + [t.grad for t in unsharded if t is not None]
    return ModelStateBytes(
        params=sum(local_bytes(fp.sharded_param) for fp in fsdp_params) + sum(local_bytes(p) for p in others),
        unsharded_params=sum(_nbytes(t) for t in unsharded),
        grads=sum(_nbytes(g) for g in grads) + sum(_nbytes(p.grad) for p in others),
        optimizer=optimizer,
    )
