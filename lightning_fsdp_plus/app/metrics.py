"""``RunMetrics``: the timing figures a run reports in ``metrics.json`` (step time, throughput, padding share, useful
tokens per second).

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
from lightning_fsdp_plus.app.data import PADDING_KEY, TARGETS_KEY


def count_tokens(batch: Any) -> int:
    """Tokens in a batch: a token tensor, or a mapping with ``input_ids``."""
    if isinstance(batch, Tensor):
        return batch.numel()
    if isinstance(batch, Mapping) and "input_ids" in batch:
        return batch["input_ids"].numel()
    return 0


def token_counts(batch: Any) -> tuple[int, int, int]:
    """``(tokens, padding, useful)`` of a training batch: every position, the padding among them, and the tokens
    in the loss (next-token targets not masked with -100). The app's batches count their padding and loss tokens
    (``padding_tokens``, ``target_tokens``, on the CPU); a plain token tensor has no padding and every next token
    as a target; another mapping counts from its ``attention_mask`` and ``labels``."""
    tokens = count_tokens(batch)
    if isinstance(batch, Tensor):
        rows, length = (batch.shape[0], batch.shape[-1]) if batch.dim() == 2 else (1, batch.numel())
        return tokens, 0, rows * max(length - 1, 0)
    if not isinstance(batch, Mapping) or not tokens:
        return 0, 0, 0
    if PADDING_KEY in batch and TARGETS_KEY in batch:
        return tokens, int(batch[PADDING_KEY].sum()), int(batch[TARGETS_KEY].sum())
    mask = batch.get("attention_mask")
    padding = 0 if mask is None or mask.dim() != 2 else int((mask == 0).sum())
    labels = batch.get("labels", batch["input_ids"])
    return tokens, padding, int((labels[:, 1:] != -100).sum())


class RunMetrics(Callback):
    """Times every training step and counts its tokens: all of them, the padding, and the useful ones (in the loss).

    Arguments:
        warmup_steps: First steps left out of the step-time median (allocation, lazy init).
    """

    def __init__(self, *, warmup_steps: int = 2) -> None:
        self.warmup_steps = warmup_steps
        self.step_times: list[float] = []
        self.step_cpu_times: list[float] = []
        self.tokens_per_step: list[int] = []
        self.padding_tokens = 0
        self.useful_tokens = 0
        self.first_step_s = float("nan")
        self._start = 0.0
        self._cpu_start = 0.0

    def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, batch_idx: int) -> None:
        """Start the step clocks (wall, and this process's CPU time)."""
        self._start, self._cpu_start = time.perf_counter(), time.process_time()

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        """Stop the clock and count this step's tokens."""
        elapsed, cpu = time.perf_counter() - self._start, time.process_time() - self._cpu_start
        if math.isnan(self.first_step_s):  # the first step this process ran (compiles, allocates)
            self.first_step_s = elapsed
        if trainer.global_step > self.warmup_steps:
            tokens, padding, useful = token_counts(batch)
            self.step_times.append(elapsed)
            self.step_cpu_times.append(cpu)
            self.tokens_per_step.append(tokens)
            self.padding_tokens += padding
            self.useful_tokens += useful

    def local_summary(self) -> dict[str, float]:
        """This rank's figures."""
        median = statistics.median(self.step_times) if self.step_times else float("nan")
        cpu = statistics.median(self.step_cpu_times) if self.step_cpu_times else float("nan")
        tokens = statistics.median(self.tokens_per_step) if self.tokens_per_step else 0
        steps = len(self.step_times)
        return {
            "step_time_s_median": median,
            "tokens_per_s_rank": tokens / median if steps else float("nan"),
            "useful_tokens_per_s_rank": self.useful_tokens / steps / median if steps else float("nan"),
            "useful_tokens_per_cpu_s_rank": self.useful_tokens / steps / cpu if steps and cpu > 0 else float("nan"),
            "step_cpu_s_median": cpu,
            "tokens_rank": sum(self.tokens_per_step),
            "padding_tokens_rank": self.padding_tokens,
            "first_step_s": self.first_step_s,
        }

    def summary(self, trainer: Any) -> dict[str, float]:
        """Figures over all ranks (a collective: call on every rank): maxima, total tokens/s (all and useful: in
        the loss), useful tokens per CPU-second of a rank (this process's CPU time: on a shared machine, time the
        hypervisor gives other guests does not count), and the padding share of the timed steps' tokens."""
        ranks = all_gather_object(self.local_summary())
        tokens = sum(r["tokens_rank"] for r in ranks)
        return {
            "step_time_s_median": max(r["step_time_s_median"] for r in ranks),
            "tokens_per_s": sum(r["tokens_per_s_rank"] for r in ranks),
            "useful_tokens_per_s": sum(r["useful_tokens_per_s_rank"] for r in ranks),
            "step_cpu_s_median": max(r["step_cpu_s_median"] for r in ranks),
            "useful_tokens_per_cpu_s": sum(r["useful_tokens_per_cpu_s_rank"] for r in ranks) / len(ranks),
            "padding_share": sum(r["padding_tokens_rank"] for r in ranks) / tokens if tokens else float("nan"),
            "first_step_s": max(r["first_step_s"] for r in ranks),
        }
