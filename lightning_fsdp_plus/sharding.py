"""Applying a sharding plan: the device mesh, activation checkpointing, ``fully_shard`` and prefetching.

This is the only module that calls ``fully_shard``.
"""

from __future__ import annotations

from collections.abc import Collection
from itertools import pairwise

from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from lightning_fsdp_plus.plan import MeshLayout, ShardingPlan


def init_mesh(*, layout: MeshLayout, device_type: str) -> DeviceMesh:
    """A 1-D ``("shard",)`` or 2-D ``("replicate", "shard")`` mesh over the default process group."""
    if layout.two_d:
        return init_device_mesh(device_type, (layout.replicate, layout.shard), mesh_dim_names=("replicate", "shard"))
    return init_device_mesh(device_type, (layout.shard,), mesh_dim_names=("shard",))


def offload_policy(*, cpu_offload: bool, device_type: str) -> OffloadPolicy:
    """FSDP2's CPU offload when asked for on an accelerator; on CPU the parameters already live there."""
    return CPUOffloadPolicy() if cpu_offload and device_type != "cpu" else OffloadPolicy()


def apply_sharding_plan(
    model: nn.Module,
    plan: ShardingPlan,
    *,
    mesh: DeviceMesh,
    mp_policy: MixedPrecisionPolicy | None = None,
    offload: OffloadPolicy | None = None,
    ignored_params: Collection[nn.Parameter] = (),
    forward_prefetch: bool = False,
) -> list[FSDPModule]:
    """Shard ``model`` in place as the plan says; returns the FSDP modules in plan order (root last)."""
    apply_activation_checkpointing(model, plan.activation_checkpointing)
    kwargs = {
        "mesh": mesh,
        "mp_policy": mp_policy or MixedPrecisionPolicy(),
        "offload_policy": offload or OffloadPolicy(),
    }
    ignored = {id(p) for p in ignored_params}
    sharded: list[FSDPModule] = []
    for unit in plan.units:
        module = model.get_submodule(unit.path) if unit.path else model
        unit_ignored = {p for p in module.parameters() if id(p) in ignored}
        fully_shard(
            module,
            reshard_after_forward=unit.reshard_after_forward,
            ignored_params=unit_ignored or None,
            **kwargs,
        )
        sharded.append(module)  # type: ignore[arg-type]
    if forward_prefetch:
        order = {id(m): i for i, m in enumerate(model.modules())}
        set_explicit_prefetch(sorted(sharded[:-1], key=lambda m: order[id(m)]))
    return sharded


def apply_activation_checkpointing(model: nn.Module, paths: Collection[str]) -> None:
    """Checkpoint the submodules at ``paths`` (torch's composable, non-reentrant ``checkpoint``)."""
    from torch.distributed._composable import checkpoint

    for path in paths:
        checkpoint(model.get_submodule(path))


def set_explicit_prefetch(units: list[FSDPModule]) -> None:
    """Prefetch the next unit's all-gather in forward and the previous one's in backward.

    ``units`` are the non-root units in execution order (module registration order for sequential blocks).
    """
    for current, following in pairwise(units):
        current.set_modules_to_forward_prefetch([following])
        following.set_modules_to_backward_prefetch([current])


def is_sharded(model: nn.Module) -> bool:
    """True when ``fully_shard`` was already applied somewhere in ``model`` (e.g. in ``configure_model``)."""
    return any(isinstance(m, FSDPModule) for m in model.modules())
