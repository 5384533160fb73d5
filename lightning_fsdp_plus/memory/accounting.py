"""Exact, tensor-accounted bytes of model state on this rank: parameters, gradients, optimizer state.

Counts what each rank really holds: the local shard of every DTensor, the unsharded copies FSDP2 keeps
alive between a unit's forward and backward (``SHARD_GRAD_OP``, the root), replicated parameters in full.
Works on any device, so CPU runs can be compared with the sharding arithmetic.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass

import torch
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule


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


def unsharded_param_bytes(module: nn.Module) -> int:
    """Bytes of all-gathered parameters FSDP2 currently holds for the units inside ``module``."""
    from torch.distributed.fsdp._fully_shard._fsdp_param import ShardedState

    total = 0
    for sub in module.modules():
        if not isinstance(sub, FSDPModule):
            continue
        group = sub._get_fsdp_state()._fsdp_param_group
        for fsdp_param in group.fsdp_params if group is not None else ():
            if fsdp_param.sharded_state is ShardedState.UNSHARDED and hasattr(fsdp_param, "_unsharded_param"):
                param = fsdp_param._unsharded_param
                total += param.numel() * param.element_size()
    return total


def model_state_bytes(module: nn.Module, optimizers: Iterable[torch.optim.Optimizer] = ()) -> ModelStateBytes:
    """Bytes of parameters, alive unsharded copies, gradients and optimizer state on this rank."""
    params = list(module.parameters())
    optimizer = sum(
        local_bytes(value)
        for opt in optimizers
        for state in opt.state.values()
        for value in state.values()
        if isinstance(value, Tensor) and value.dim() > 0  # skip scalar step counters
    )
    return ModelStateBytes(
        params=sum(local_bytes(p) for p in params),
        unsharded_params=unsharded_param_bytes(module),
        grads=sum(local_bytes(p.grad) for p in params if p.grad is not None),
        optimizer=optimizer,
    )
