"""lightning-fsdp-plus: FSDP2 made practical for PyTorch Lightning.

``import lightning_fsdp_plus`` registers ``Trainer(strategy="fsdp_plus")`` (and ``"fsdp_plus_spawn"``) and
``Fabric(strategy="fsdp_plus")``.
"""

from lightning.fabric.strategies import STRATEGY_REGISTRY as FABRIC_STRATEGIES
from lightning.pytorch.strategies import StrategyRegistry

from lightning_fsdp_plus import _bnb_notice  # noqa: F401  (first of ours: before peft imports bitsandbytes)
from lightning_fsdp_plus._warnings import silence_unactionable
from lightning_fsdp_plus.clipping import clip_grad_norm_across_shards, grad_norm_across_shards
from lightning_fsdp_plus.fabric import FSDPPlusFabricStrategy
from lightning_fsdp_plus.plan import (
    FSDPUnit,
    MeshLayout,
    ParamInfo,
    ShardingPlan,
    ShardingStrategy,
    TiedGroup,
    build_sharding_plan,
)
from lightning_fsdp_plus.precision import FSDPPlusPrecision
from lightning_fsdp_plus.strategy import FSDPPlusStrategy

__version__ = "0.1.0"

__all__ = [
    "FSDPPlusFabricStrategy",
    "FSDPPlusPrecision",
    "FSDPPlusStrategy",
    "FSDPUnit",
    "MeshLayout",
    "ParamInfo",
    "ShardingPlan",
    "ShardingStrategy",
    "TiedGroup",
    "build_sharding_plan",
    "clip_grad_norm_across_shards",
    "grad_norm_across_shards",
]

silence_unactionable()

if FSDPPlusStrategy.strategy_name not in StrategyRegistry:
    # Not FSDPStrategy.register_strategies: its class-level list would trigger Lightning's GPU-only check.
    FSDPPlusStrategy.register_strategies(StrategyRegistry)
if FSDPPlusFabricStrategy.strategy_name not in FABRIC_STRATEGIES:
    FSDPPlusFabricStrategy.register_strategies(FABRIC_STRATEGIES)
