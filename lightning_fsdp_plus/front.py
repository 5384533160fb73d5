"""What the Trainer's and Fabric's strategies share as fronts over :class:`~lightning_fsdp_plus.options.
FSDPPlusOptions`: option fields read as attributes, the data-parallel sampler arguments, the repr."""

from __future__ import annotations

from typing import Any

from lightning_fsdp_plus.options import FSDPPlusOptions, option_fields
from lightning_fsdp_plus.plan import MeshLayout

OPTION_FIELDS = option_fields()
"""Every option's name: what a strategy answers as an attribute."""


class OptionsFront:
    """Mixed into both strategies (before Lightning's base class): ``options`` and ``mesh_layout`` are theirs."""

    options: FSDPPlusOptions
    mesh_layout: MeshLayout
    world_size: int
    global_rank: int

    def __getattr__(self, name: str) -> Any:
        # only reached when normal lookup fails: option fields read as attributes (strategy.lora, ...)
        options = self.__dict__.get("options")
        if options is not None and name in OPTION_FIELDS:
            return getattr(options, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Data-parallel replicas and rank: the ranks of one tensor-parallel group (neighbours, the innermost mesh
        dimension) see the same batches."""
        tensor = self.mesh_layout.tensor
        return {"num_replicas": self.world_size // tensor, "rank": self.global_rank // tensor}

    def __repr__(self) -> str:
        strategy = self.options.sharding_strategy
        return f"{type(self).__name__}(sharding_strategy={getattr(strategy, 'value', strategy)})"
