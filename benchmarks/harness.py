"""Measurement pieces shared by every benchmark case: collective bytes, step phases, memory.

Collectives are counted, not guessed: the ``torch.distributed`` functions FSDP2 calls are wrapped while a
``CommCounter`` is installed, and DDP's C++ reducer is observed through a communication hook
(:func:`counting_allreduce_hook`). Bytes are what each rank sends into (reduce-scatter, all-reduce) or
receives from (all-gather) a collective, summed per step.

A step is split into phases — forward, backward, optimizer (step and zero-grad) and the rest (framework
work between them) — with the same clock for Lightning (:class:`LightningRecorder`, from its hooks) and
the hand-written loop (:class:`StepClock`), so a ratio above 1 says where the time goes.
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import Callback
from torch import nn

from lightning_fsdp_plus.app.metrics import count_tokens
from lightning_fsdp_plus.memory import MemoryMonitor
from lightning_fsdp_plus.memory.monitor import MemoryPeaks, sample_memory

_COUNTED = {
    # name: (kind, index of the tensor whose size is counted)
    "all_gather_single": ("all_gather", 0),
    "all_gather_into_tensor": ("all_gather", 0),
    "reduce_scatter_single": ("reduce_scatter", 1),
    "reduce_scatter_tensor": ("reduce_scatter", 1),
    "all_reduce": ("all_reduce", 0),
}
PHASES = ("forward", "backward", "optimizer", "other")
"""Phases of a training step, in order; ``other`` is the step time the first three do not cover."""


class CommCounter:
    """Counts bytes and calls of collectives on this rank while installed."""

    def __init__(self) -> None:
        self.bytes: dict[str, int] = defaultdict(int)
        self.calls: dict[str, int] = defaultdict(int)

    def reset(self) -> None:
        """Start counting from zero."""
        self.bytes.clear()
        self.calls.clear()

    def add(self, kind: str, tensor: torch.Tensor) -> None:
        """Count one collective of ``kind`` on ``tensor``."""
        self.bytes[kind] += tensor.numel() * tensor.element_size()
        self.calls[kind] += 1

    @contextmanager
    def installed(self) -> Iterator[CommCounter]:
        """Wrap the torch.distributed collectives for the duration of the block."""
        originals = {name: getattr(dist, name) for name in _COUNTED if hasattr(dist, name)}

        def wrap(name, fn):
            kind, index = _COUNTED[name]

            def counted(*args, **kwargs):
                self.add(kind, args[index] if len(args) > index else next(iter(kwargs.values())))
                return fn(*args, **kwargs)

            return counted

        for name, fn in originals.items():
            setattr(dist, name, wrap(name, fn))
        try:
            yield self
        finally:
            for name, fn in originals.items():
                setattr(dist, name, fn)


@contextmanager
def all_gathers_by_kind(counter: CommCounter, kind_of: Callable[[nn.Module, str], str]) -> Iterator[None]:
    """Also count FSDP2's all-gather bytes per kind of parameter (``all_gather:<kind>``).

    FSDP2 packs a unit's parameters into one buffer (bytes when dtypes differ), so the collective's size
    alone cannot say what travelled; each unit's inputs can: ``kind_of(owning module, param name)`` names
    each parameter's kind, and its all-gather inputs (shard, in the dtype it travels in) times the group
    size are added to that kind.
    """
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group

    original = _fsdp_param_group.foreach_all_gather

    def counted(fsdp_params, group, *args, **kwargs):
        for fsdp_param in fsdp_params:
            info = fsdp_param._module_info
            kind = kind_of(info.module, info.param_name)
            nbytes = sum(t.numel() * t.element_size() for t in fsdp_param.all_gather_inputs) * group.size()
            counter.bytes[f"all_gather:{kind}"] += nbytes
        return original(fsdp_params, group, *args, **kwargs)

    _fsdp_param_group.foreach_all_gather = counted
    try:
        yield
    finally:
        _fsdp_param_group.foreach_all_gather = original


class PythonAllReduce(Callback):
    """Route DDP's gradient all-reduce through ``torch.distributed.all_reduce`` (DDP's default hook in Python).

    DDP's C++ reducer calls the process group directly, out of ``CommCounter``'s sight; Lightning registers
    communication hooks only on CUDA, so this callback registers torch's ``allreduce_hook`` itself.
    """

    def on_train_start(self, trainer, module) -> None:
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        trainer.strategy.model.register_comm_hook(None, allreduce_hook)


class StepClock:
    """Per-step phase times and collective bytes; Lightning hooks or a hand-written loop drive it."""

    def __init__(self, *, warmup: int, counter: CommCounter) -> None:
        self.warmup, self.counter = warmup, counter
        self.steps: list[dict[str, float]] = []
        self.comm: list[dict[str, int]] = []
        self.tokens: list[int] = []
        self._marks: dict[str, float] = {}
        self._seen = 0

    def mark(self, name: str) -> None:
        """Record the time of ``name``: ``start``, ``forward``, ``backward``, ``optimizer_start``, ``end``."""
        if name == "start":
            self.counter.reset()
            self._marks = {}
        self._marks[name] = time.perf_counter()

    def end(self, tokens: int) -> None:
        """Close a step (kept if past warm-up)."""
        self.mark("end")
        self._seen += 1
        if self._seen <= self.warmup:
            return
        m = self._marks
        total = m["end"] - m["start"]
        phases = {
            "forward": m["forward"] - m["start"],
            "backward": m["backward"] - m["forward"],
            "optimizer": m["end"] - m.get("optimizer_start", m["backward"]),
        }
        phases["other"] = total - sum(phases.values())
        self.steps.append({"step": total, **phases})
        self.comm.append(dict(self.counter.bytes) | {f"{k}_calls": v for k, v in self.counter.calls.items()})
        self.tokens.append(tokens)

    def summary(self) -> dict[str, Any]:
        """Medians over measured steps: step time, phases, tokens, collective bytes and calls per step."""
        keys = {k for c in self.comm for k in c}
        return {
            "step_time_s": statistics.median(s["step"] for s in self.steps),
            "phases_s": {p: statistics.median(s[p] for s in self.steps) for p in PHASES},
            "tokens_per_step": statistics.median(self.tokens),
            "comm_per_step": {k: statistics.median(c.get(k, 0) for c in self.comm) for k in sorted(keys)},
        }


class LightningRecorder(Callback):
    """Drives a :class:`StepClock` from Lightning's hooks; memory from a ``MemoryMonitor`` (add both)."""

    def __init__(self, *, warmup: int, counter: CommCounter) -> None:
        self.clock = StepClock(warmup=warmup, counter=counter)
        self.monitor = MemoryMonitor(log_every_n_steps=0)

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        self.clock.mark("start")

    def on_before_backward(self, trainer, module, loss) -> None:
        self.clock.mark("forward")

    def on_after_backward(self, trainer, module) -> None:
        self.clock.mark("backward")

    def on_before_optimizer_step(self, trainer, module, optimizer) -> None:
        self.clock.mark("optimizer_start")

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        self.clock.end(count_tokens(batch))

    def memory(self) -> dict[str, int]:
        """Tensor-accounted peaks of this rank."""
        return self.monitor.peaks.figures()


class LoopMemory:
    """What ``MemoryMonitor`` samples, for a hand-written loop: after forward, after backward, after the step."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, device: torch.device) -> None:
        self.model, self.optimizer, self.device = model, optimizer, device
        self.peaks = MemoryPeaks()

    def sample(self, activations: int = 0) -> None:
        """Measure now (pass the saved-activation bytes right after forward)."""
        self.peaks.update(
            sample_memory(self.model, optimizers=[self.optimizer], activations=activations, device=self.device)
        )

    def memory(self) -> dict[str, int]:
        """Tensor-accounted peaks of this rank."""
        return self.peaks.figures()
