"""Structured configs (schemas) and their ConfigStore registration."""

from lightning_fsdp_plus.config.schema import (
    DataSchema,
    LoraSchema,
    ModelSchema,
    PrecisionSchema,
    RunSchema,
    StrategySchema,
    TrainerSchema,
)
from lightning_fsdp_plus.config.store import RUN_SCHEMA, register_configs

__all__ = [
    "RUN_SCHEMA",
    "DataSchema",
    "LoraSchema",
    "ModelSchema",
    "PrecisionSchema",
    "RunSchema",
    "StrategySchema",
    "TrainerSchema",
    "register_configs",
]
