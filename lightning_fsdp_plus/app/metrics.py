"""``RunMetrics``: the timing figures a run reports in ``metrics.json`` (step time, throughput).

Memory figures come from :class:`~lightning_fsdp_plus.memory.MemoryMonitor`.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Mapping
from typing import Any

from lightning.pytorch import Callback
from torch import Tensor

from lightning_fsdp_plus._dist import all_gather_object


def count_tokens(batch: Any) -> int:
    """Tokens in a batch: a token tensor, or a mapping with ``input_ids``."""
    if isinstance(batch, Tensor):
        return batch.numel()
    if isinstance(batch, Mapping) and "input_ids" in batch:
        return batch["input_ids"].numel()
    return 0


class RunMetrics(Callback):
    """Times every training step and counts its tokens.

    Arguments:
        warmup_steps: First steps left out of the step-time median (allocation, lazy init).
    """

    def __init__(self, *, warmup_steps: int = 2) -> None:
        self.warmup_steps = warmup_steps
        self.step_times: list[float] = []
        self.tokens_per_step: list[int] = []
        self.first_step_s = float("nan")
        self._start = 0.0

    def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, batch_idx: int) -> None:
        """Start the step clock."""
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        """Stop the clock and count this step's tokens."""
        elapsed = time.perf_counter() - self._start
        if math.isnan(self.first_step_s):  # the first step this process ran (compiles, allocates)
            self.first_step_s = elapsed
        if trainer.global_step > self.warmup_steps:
            self.step_times.append(elapsed)
            self.tokens_per_step.append(count_tokens(batch))

    def local_summary(self) -> dict[str, float]:
        """This rank's figures."""
        median = statistics.median(self.step_times) if self.step_times else float("nan")
        tokens = statistics.median(self.tokens_per_step) if self.tokens_per_step else 0
        return {
            "step_time_s_median": median,
            "tokens_per_s_rank": tokens / median if self.step_times else float("nan"),
            "first_step_s": self.first_step_s,
        }

    def summary(self, trainer: Any) -> dict[str, float]:
        """Figures over all ranks (a collective: call on every rank): maxima, and total tokens/s."""
        ranks = all_gather_object(self.local_summary())
        return {
            "step_time_s_median": max(r["step_time_s_median"] for r in ranks),
            "tokens_per_s": sum(r["tokens_per_s_rank"] for r in ranks),
            "first_step_s": max(r["first_step_s"] for r in ranks),
        }
