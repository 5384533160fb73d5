"""Structured configs (schemas) and their ConfigStore registration."""

from lightning_fsdp_plus.app.config.schema import (
    GenerateSchema,
    InstructionDataSchema,
    LoraSchema,
    ModelSchema,
    PrecisionSchema,
    RunSchema,
    StrategySchema,
    SyntheticDataSchema,
    TrainerSchema,
)
from lightning_fsdp_plus.app.config.store import RUN_SCHEMA, register_configs

__all__ = [
    "RUN_SCHEMA",
    "GenerateSchema",
    "InstructionDataSchema",
    "LoraSchema",
    "ModelSchema",
    "PrecisionSchema",
    "RunSchema",
    "StrategySchema",
    "SyntheticDataSchema",
    "TrainerSchema",
    "register_configs",
]
