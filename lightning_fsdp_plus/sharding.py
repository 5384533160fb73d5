"""Applying a sharding plan: the device mesh, activation checkpointing, ``fully_shard`` and prefetching.

This is the only module that calls ``fully_shard``.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator
from itertools import pairwise
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, OffloadPolicy, fully_shard

from lightning_fsdp_plus._dist import all_gather_object as _all_gather_object
from lightning_fsdp_plus._private import composable_checkpoint
from lightning_fsdp_plus.compile import compile_units
from lightning_fsdp_plus.kv_cache import drop_cache_under_grad
from lightning_fsdp_plus.plan import MeshLayout, ShardingPlan

MESH_NAMES = ("replicate", "shard", "tensor")
"""The world mesh's dimensions, outermost first."""
LIGHTNING_NAMES = {"data_parallel": ("replicate", "shard"), "tensor_parallel": ("tensor",)}
"""``ModelParallelStrategy``'s names, as flattened views of ours: ``configure_model`` code written for it indexes
``device_mesh["data_parallel"]`` and ``device_mesh["tensor_parallel"]``."""


class StrategyMesh(DeviceMesh):
    """The data-parallel mesh the strategy shards with (1-D ``("shard",)`` or 2-D ``("replicate", "shard")``, what
    ``fully_shard(mesh=self.device_mesh)`` needs) that also answers every name of the world mesh it was cut from:
    ``["tensor"]``, ``["replicate"]``, and Lightning's ``["data_parallel"]`` and ``["tensor_parallel"]``
    (:data:`LIGHTNING_NAMES`). A plain ``DeviceMesh`` slice knows only its own dimensions."""

    def __getitem__(self, mesh_dim_names: str | tuple[str, ...]) -> DeviceMesh:
        try:
            return super().__getitem__(mesh_dim_names)
        except KeyError:
            return self._get_root_mesh()[mesh_dim_names]


def init_mesh(*, layout: MeshLayout, device_type: str) -> DeviceMesh:
    """The world mesh ``(replicate, shard, tensor)`` over the default process group, with Lightning's names as
    flattened views; returns its data-parallel part as a :class:`StrategyMesh`: ``("shard",)`` or, for a 2-D
    layout, ``("replicate", "shard")``."""
    world = init_device_mesh(device_type, (layout.replicate, layout.shard, layout.tensor), mesh_dim_names=MESH_NAMES)
    for name, dims in LIGHTNING_NAMES.items():
        world[dims]._flatten(name)
    data = world["replicate", "shard"] if layout.two_d else world["shard"]
    data.__class__ = StrategyMesh  # the same object, its slicing extended to the world's names
    return data


def build_mesh(*, layout: MeshLayout, device_type: str, given: Any = None) -> DeviceMesh:
    """The mesh for ``layout``: the user's ``DeviceMesh``, one over their process group(s), or a new one."""
    if isinstance(given, DeviceMesh):
        return given
    if isinstance(given, tuple) and given and isinstance(given[0], dist.ProcessGroup):
        if len(given) == 1:
            return DeviceMesh.from_group(given[0], device_type, mesh_dim_names=("shard",))
        intra, inter = given  # FSDP1's HYBRID_SHARD pair: rows are replicas, each row one shard group's ranks
        rows = sorted({tuple(r) for r in _all_gather_object(dist.get_process_group_ranks(intra))})
        return DeviceMesh.from_group([inter, intra], device_type, mesh=torch.tensor(rows),
                                     mesh_dim_names=("replicate", "shard"))  # fmt: skip
    return init_mesh(layout=layout, device_type=device_type)


def apply_sharding_plan(model: nn.Module, plan: ShardingPlan, *, mesh: DeviceMesh) -> list[FSDPModule]:
    """Shard ``model`` in place as the plan says; returns the FSDP modules in plan order (root last).

    The plan's replicated parameters are FSDP2 ``ignored_params`` of the unit that holds them.
    """
    apply_activation_checkpointing(model, plan.activation_checkpointing, mode=plan.checkpointing_mode)
    if plan.compile is not None:  # torchtitan's order: checkpointing -> compile -> fully_shard
        compile_units(model, plan.compiled, spec=plan.compile)
    offload = CPUOffloadPolicy() if plan.cpu_offload else OffloadPolicy()
    replicated = {p.name for p in plan.replicated}
    ignored = {id(p) for name, p in model.named_parameters(remove_duplicate=False) if name in replicated}
    sharded: list[FSDPModule] = []
    for unit in plan.units:
        module = model.get_submodule(unit.path) if unit.path else model
        unit_ignored = {p for p in module.parameters() if id(p) in ignored}
        fully_shard(
            module,
            mesh=mesh,
            reshard_after_forward=unit.reshard_after_forward,
            mp_policy=plan.mp_policy,
            offload_policy=offload,
            ignored_params=unit_ignored or None,
        )
        sharded.append(module)  # type: ignore[arg-type]
    if plan.forward_prefetch:
        order = {id(m): i for i, m in enumerate(model.modules())}
        set_explicit_prefetch(sorted(sharded[:-1], key=lambda m: order[id(m)]))
    return sharded


def selective_saved_ops() -> frozenset[Any]:
    """The operators whose outputs selective checkpointing keeps (torchtitan's "op" policy): matmuls and
    attention, the expensive ones to recompute; everything else (norms, activations, casts) is recomputed."""
    aten = torch.ops.aten
    names = ("mm", "addmm", "bmm", "baddbmm", "_scaled_dot_product_flash_attention",
             "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
             "_scaled_dot_product_flash_attention_for_cpu")  # fmt: skip
    return frozenset(getattr(aten, n).default for n in names if hasattr(aten, n))


def selective_checkpoint_context() -> Any:
    """torch's selective-checkpoint contexts that keep :func:`selective_saved_ops`' outputs."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    saved = selective_saved_ops()

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        return CheckpointPolicy.MUST_SAVE if op in saved else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def apply_activation_checkpointing(model: nn.Module, paths: Collection[str], *, mode: str = "full") -> None:
    """Checkpoint the submodules at ``paths`` (torch's composable, non-reentrant ``checkpoint``); ``mode="selective"``
    keeps the matmul and attention outputs (:func:`selective_saved_ops`) and recomputes the rest.

    A checkpointed layer runs its forward twice: once in forward, again in backward. A layer that writes a
    key/value cache (a transformers decoder layer under ``use_cache=True``, the config's default) would append its
    keys a second time and attend over twice the sequence, so while gradients are computed it runs without a cache,
    as transformers' own gradient checkpointing does (generation, under ``no_grad``, keeps its cache). The model's
    own checkpointing (``gradient_checkpointing_enable()``) is switched off on these layers: they are recomputed
    once, not twice.
    """
    checkpoint = composable_checkpoint()
    for path in paths:
        module = model.get_submodule(path)
        if transformers_checkpointing(module):
            module.gradient_checkpointing = False
        drop_cache_under_grad(module, why="activation checkpointing recomputes its forward in backward")
        if mode == "selective":
            checkpoint(module, context_fn=selective_checkpoint_context)
        else:
            checkpoint(module)


def transformers_checkpointing(module: nn.Module) -> bool:
    """True for a transformers layer (``GradientCheckpointingLayer``) whose own checkpointing is switched on
    (``model.gradient_checkpointing_enable()``)."""
    layer = any(c.__name__ == "GradientCheckpointingLayer" for c in type(module).__mro__)
    return layer and getattr(module, "gradient_checkpointing", False) is True


def model_checkpointed_layers(model: nn.Module) -> Iterator[str]:
    """Paths of the layers the model's own ``gradient_checkpointing_enable()`` checkpoints (see
    :func:`transformers_checkpointing`): the plan checkpoints them itself."""
    return (path for path, module in model.named_modules() if transformers_checkpointing(module))


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
