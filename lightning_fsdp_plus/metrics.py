"""``RunMetrics``: the figures a run reports in ``metrics.json`` (step time, throughput, memory per rank)."""

from __future__ import annotations

import resource
import statistics
import time
from collections.abc import Mapping
from typing import Any

import torch
from lightning.pytorch import Callback
from torch import Tensor

from lightning_fsdp_plus._dist import all_gather_object
from lightning_fsdp_plus.memory import model_state_bytes


def count_tokens(batch: Any) -> int:
    """Tokens in a batch: a token tensor, or a mapping with ``input_ids``."""
    if isinstance(batch, Tensor):
        return batch.numel()
    if isinstance(batch, Mapping) and "input_ids" in batch:
        return batch["input_ids"].numel()
    return 0


def peak_process_bytes(device: torch.device) -> int:
    """Peak memory of this rank: CUDA allocator peak on GPU, the process's peak resident set on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


class RunMetrics(Callback):
    """Times every training step and samples tensor-accounted model-state bytes per rank.

    Arguments:
        warmup_steps: First steps left out of the step-time median (allocation, lazy init).
    """

    def __init__(self, *, warmup_steps: int = 2) -> None:
        self.warmup_steps = warmup_steps
        self.step_times: list[float] = []
        self.tokens_per_step: list[int] = []
        self.model_state_peak = 0
        self._start = 0.0

    def _sample(self, trainer: Any, module: Any) -> None:
        self.model_state_peak = max(self.model_state_peak, model_state_bytes(module, trainer.optimizers).total)

    def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, batch_idx: int) -> None:
        """Start the step clock."""
        self._start = time.perf_counter()

    def on_before_backward(self, trainer: Any, module: Any, loss: Tensor) -> None:
        """Sample after forward: unsharded parameters and activations' owners are alive."""
        self._sample(trainer, module)

    def on_before_optimizer_step(self, trainer: Any, module: Any, optimizer: Any) -> None:
        """Sample with gradients present."""
        self._sample(trainer, module)

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        """Stop the clock and count this step's tokens."""
        elapsed = time.perf_counter() - self._start
        self._sample(trainer, module)
        if trainer.global_step > self.warmup_steps:
            self.step_times.append(elapsed)
            self.tokens_per_step.append(count_tokens(batch))

    def local_summary(self, device: torch.device) -> dict[str, float]:
        """This rank's figures."""
        median = statistics.median(self.step_times) if self.step_times else float("nan")
        tokens = statistics.median(self.tokens_per_step) if self.tokens_per_step else 0
        return {
            "step_time_s_median": median,
            "tokens_per_s_rank": tokens / median if self.step_times else float("nan"),
            "model_state_bytes_per_rank": self.model_state_peak,
            "peak_bytes_per_rank": peak_process_bytes(device),
        }

    def summary(self, trainer: Any) -> dict[str, float]:
        """Figures over all ranks (a collective: call on every rank): maxima, and total tokens/s."""
        ranks = all_gather_object(self.local_summary(trainer.strategy.root_device))
        return {
            "step_time_s_median": max(r["step_time_s_median"] for r in ranks),
            "tokens_per_s": sum(r["tokens_per_s_rank"] for r in ranks),
            "model_state_bytes_per_rank": max(r["model_state_bytes_per_rank"] for r in ranks),
            "peak_bytes_per_rank": max(r["peak_bytes_per_rank"] for r in ranks),
        }
