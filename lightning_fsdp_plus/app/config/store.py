"""Registration of the structured configs in Hydra's ConfigStore."""

from __future__ import annotations

from hydra.core.config_store import ConfigStore

from lightning_fsdp_plus.app.config.schema import InstructionDataSchema, RunSchema, SyntheticDataSchema
from lightning_fsdp_plus.app.config.shipped import register_shipped_resolver

RUN_SCHEMA = "fsdp_plus_run_schema"
"""ConfigStore name of the run schema; ``conf/config.yaml`` lists it first in its defaults."""


def register_configs() -> None:
    """Store the run schema, and the data schemas that data/ presets extend; register ``${shipped:...}``
    (idempotent)."""
    register_shipped_resolver()
    store = ConfigStore.instance()
    store.store(name=RUN_SCHEMA, node=RunSchema)
    store.store(group="data_schema", name="synthetic", node=SyntheticDataSchema)
    store.store(group="data_schema", name="instruction", node=InstructionDataSchema)
