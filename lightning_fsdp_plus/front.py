"""What the Trainer's and Fabric's strategies share as fronts over :class:`~lightning_fsdp_plus.options.
FSDPPlusOptions`: option fields read as attributes, the data-parallel sampler arguments, the repr."""

from __future__ import annotations

from typing import Any

from lightning_fsdp_plus.options import FSDPPlusOptions, option_fields
from lightning_fsdp_plus.plan import MeshLayout

OPTION_FIELDS = option_fields()
"""Every option's name: what a strategy answers as an attribute."""


class OptionsFront:
    """Mixed into both strategies (before Lightning's base class): ``options``, ``_mesh_layout`` (``None`` until
    :attr:`mesh_layout` is first read; set it to ``None`` to recompute), the world size and ranks are theirs."""

    options: FSDPPlusOptions
    _mesh_layout: MeshLayout | None
    world_size: int
    global_rank: int
    num_processes: int

    def __getattr__(self, name: str) -> Any:
        # only reached when normal lookup fails: option fields read as attributes (strategy.lora, ...)
        options = self.__dict__.get("options")
        if options is not None and name in OPTION_FIELDS:
            return getattr(options, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @property
    def mesh_layout(self) -> MeshLayout:
        """Replicate x shard (x tensor) layout for the current world size. Before the auto plan has chosen (the
        Trainer strategy's ``setup``): FULL_SHARD's 1-D mesh, rebuilt for the choice."""
        if self._mesh_layout is None:
            options = self.options.replace(sharding_strategy="FULL_SHARD") if self.options.auto else self.options
            per_node = self.num_processes or 1
            self._mesh_layout = options.mesh_layout(world_size=self.world_size, devices_per_node=per_node)
        return self._mesh_layout

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Data-parallel replicas and rank: the ranks of one tensor-parallel group (neighbours, the innermost mesh
        dimension) see the same batches."""
        tensor = self.mesh_layout.tensor
        return {"num_replicas": self.world_size // tensor, "rank": self.global_rank // tensor}

    def __repr__(self) -> str:
        strategy = self.options.sharding_strategy
        return f"{type(self).__name__}(sharding_strategy={getattr(strategy, 'value', strategy)})"
