"""Memory accounting (tensor-level, any device)."""

from lightning_fsdp_plus.memory.accounting import ModelStateBytes, model_state_bytes

__all__ = ["ModelStateBytes", "model_state_bytes"]
