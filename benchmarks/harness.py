"""Measurement pieces shared by the benchmarks: collective byte counting on top of the app's RunMetrics.

Collectives are counted, not guessed: the torch.distributed functions FSDP2 calls are wrapped while a
``CommCounter`` is active, and the bytes each rank sends into (reduce-scatter, all-reduce) or receives
from (all-gather) a collective are summed per step.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from contextlib import contextmanager

import torch
import torch.distributed as dist

from lightning_fsdp_plus.memory import MemoryMonitor
from lightning_fsdp_plus.memory.accounting import local_bytes
from lightning_fsdp_plus.metrics import RunMetrics

_COUNTED = {
    # name: (kind, index of the tensor whose size is counted)
    "all_gather_single": ("all_gather", 0),
    "all_gather_into_tensor": ("all_gather", 0),
    "reduce_scatter_single": ("reduce_scatter", 1),
    "reduce_scatter_tensor": ("reduce_scatter", 1),
    "all_reduce": ("all_reduce", 0),
}


class CommCounter:
    """Counts bytes and calls of FSDP's collectives on this rank while installed."""

    def __init__(self) -> None:
        self.bytes: dict[str, int] = defaultdict(int)
        self.calls: dict[str, int] = defaultdict(int)

    def reset(self) -> None:
        """Start counting from zero."""
        self.bytes.clear()
        self.calls.clear()

    @contextmanager
    def installed(self):
        """Wrap the torch.distributed collectives for the duration of the block."""
        originals = {name: getattr(dist, name) for name in _COUNTED if hasattr(dist, name)}

        def wrap(name, fn):
            kind, index = _COUNTED[name]

            def counted(*args, **kwargs):
                tensor = args[index] if len(args) > index else next(iter(kwargs.values()))
                self.bytes[kind] += tensor.numel() * tensor.element_size()
                self.calls[kind] += 1
                return fn(*args, **kwargs)

            return counted

        for name, fn in originals.items():
            setattr(dist, name, wrap(name, fn))
        try:
            yield self
        finally:
            for name, fn in originals.items():
                setattr(dist, name, fn)


class BenchmarkRecorder(RunMetrics):
    """The app's ``RunMetrics`` (step time after warm-up) plus collective bytes and calls.

    Memory comes from ``self.monitor``, a ``MemoryMonitor`` that must be passed to the Trainer as well.
    """

    def __init__(self, *, warmup: int, counter: CommCounter) -> None:
        super().__init__(warmup_steps=warmup)
        self.counter = counter
        self.monitor = MemoryMonitor(log_every_n_steps=0)
        self.comm: list[dict[str, int]] = []
        self.calls: list[dict[str, int]] = []

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        self.counter.reset()
        super().on_train_batch_start(trainer, module, batch, batch_idx)

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        timed = len(self.step_times)
        super().on_train_batch_end(trainer, module, outputs, batch, batch_idx)
        if len(self.step_times) > timed:  # a measured (post-warm-up) step
            self.comm.append(dict(self.counter.bytes))
            self.calls.append(dict(self.counter.calls))

    def benchmark_summary(self, module: torch.nn.Module, *, world_size: int) -> dict:
        """Median and spread of the step time, tokens/s, collective bytes per step, bytes per rank."""
        quartiles = statistics.quantiles(self.step_times, n=4)
        median = statistics.median(self.step_times)
        per_step = {k: statistics.median(s.get(k, 0) for s in self.comm) for k in ("all_gather", "reduce_scatter")}
        calls = {k: round(statistics.median(s.get(k, 0) for s in self.calls)) for k in ("all_gather", "reduce_scatter")}
        return {
            "step_time_s_median": median,
            "step_time_s_iqr": quartiles[2] - quartiles[0],
            "tokens_per_s": statistics.median(self.tokens_per_step) * world_size / median,
            "all_gather_bytes_per_step": per_step["all_gather"],
            "reduce_scatter_bytes_per_step": per_step["reduce_scatter"],
            "all_gather_calls_per_step": calls["all_gather"],
            "frozen_bytes_per_rank": sum(local_bytes(p) for p in module.parameters() if not p.requires_grad),
            "model_state_peak_bytes_per_rank": self.monitor.peak.model_state if self.monitor.peak else 0,
        }
