"""Memory: exact tensor accounting, the ``MemoryMonitor`` callback, and the per-rank estimator."""

from lightning_fsdp_plus.memory.accounting import ModelStateBytes, model_state_bytes
from lightning_fsdp_plus.memory.monitor import MemoryMonitor, MemorySample, SavedActivations

__all__ = ["MemoryMonitor", "MemorySample", "ModelStateBytes", "SavedActivations", "model_state_bytes"]
