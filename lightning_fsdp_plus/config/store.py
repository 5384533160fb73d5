"""Registration of the structured configs in Hydra's ConfigStore."""

from __future__ import annotations

from hydra.core.config_store import ConfigStore

from lightning_fsdp_plus.config.schema import RunSchema

RUN_SCHEMA = "fsdp_plus_run_schema"
"""ConfigStore name of the run schema; ``conf/config.yaml`` lists it first in its defaults."""


def register_configs() -> None:
    """Store the run schema so YAML presets are validated against it (idempotent)."""
    ConfigStore.instance().store(name=RUN_SCHEMA, node=RunSchema)
