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


PYTHON = "(outside any op: Python, framework)"
"""The profile's name for step time no torch op covers (the per-step and optimizer ranges, less their ops)."""


class StepProfile:
    """``torch.profiler`` over a few steps: self CPU time per op name per step (the top ones), on this rank."""

    def __init__(self, *, steps: int, top: int = 40) -> None:
        self.steps, self.top = steps, top
        self.profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
        self.done = 0

    def start(self) -> None:
        """Begin profiling (before a step)."""
        self.profiler.start()

    def step_done(self) -> bool:
        """Count a profiled step; stops the profiler after the last one (True then)."""
        self.done += 1
        if self.done == self.steps:
            self.profiler.stop()
            return True
        return False

    def summary(self) -> dict[str, float]:
        """Seconds per step of self CPU time by op name, the largest ``top``; outside-op time as :data:`PYTHON`."""
        per_op: dict[str, float] = defaultdict(float)
        for event in self.profiler.key_averages():
            # FSDP2 names its ranges by module path ("FSDP::all_gather (model.layers.0)"): summed per kind, since
            # the same layer has another path under a LightningModule
            # the optimizer's range holds Lightning's whole closure (forward and backward) but the loop's step only:
            # its own time (Python between ops) is counted with the rest of the Python
            python = event.key.startswith(("ProfilerStep", "Optimizer.step#", "Optimizer.zero_grad#"))
            name = PYTHON if python else event.key.split(" (")[0]
            per_op[name] += event.self_cpu_time_total / 1e6 / self.steps
        return dict(sorted(per_op.items(), key=lambda item: -item[1])[: self.top])


class StepClock:
    """Per-step phase times and collective bytes; Lightning hooks or a hand-written loop drive it. With
    ``profile_steps``, the first that many steps after warm-up also run under ``torch.profiler`` (their times are
    not kept: profiling slows them)."""

    def __init__(self, *, warmup: int, counter: CommCounter, profile_steps: int = 0) -> None:
        self.warmup, self.counter = warmup, counter
        self.steps: list[dict[str, float]] = []
        self.comm: list[dict[str, int]] = []
        self.tokens: list[int] = []
        self._marks: dict[str, float] = {}
        self._seen = 0
        self.first_step_s = float("nan")
        self.profile = StepProfile(steps=profile_steps) if profile_steps else None
        self._step_range: Any = None

    @property
    def _profiling(self) -> bool:
        return self.profile is not None and self.warmup < self._seen + 1 <= self.warmup + self.profile.steps

    def mark(self, name: str) -> None:
        """Record the time of ``name``: ``start``, ``forward``, ``backward``, ``optimizer_start``, ``end``."""
        if name == "start":
            self.counter.reset()
            self._marks = {}
            if self._profiling:
                assert self.profile is not None
                if self.profile.done == 0:
                    self.profile.start()
                self._step_range = torch.profiler.record_function(f"ProfilerStep#{self._seen}")
                self._step_range.__enter__()
        self._marks[name] = time.perf_counter()

    def end(self, tokens: int) -> None:
        """Close a step (kept if past warm-up and not profiled)."""
        self.mark("end")
        if self._step_range is not None:
            assert self.profile is not None
            self._step_range.__exit__(None, None, None)
            self._step_range = None
            self._seen += 1
            self.profile.step_done()
            return
        self._seen += 1
        if self._seen == 1:  # the first step: lazy initialisation, and with compile the compilation
            self.first_step_s = self._marks["end"] - self._marks["start"]
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
        profile = {"profile_s": self.profile.summary()} if self.profile is not None else {}
        return profile | {
            "step_time_s": statistics.median(s["step"] for s in self.steps),
            "first_step_s": self.first_step_s,
            "phases_s": {p: statistics.median(s[p] for s in self.steps) for p in PHASES},
            "tokens_per_step": statistics.median(self.tokens),
            "comm_per_step": {k: statistics.median(c.get(k, 0) for c in self.comm) for k in sorted(keys)},
        }


class LightningRecorder(Callback):
    """Drives a :class:`StepClock` from Lightning's hooks; memory from a ``MemoryMonitor`` (add both)."""

    def __init__(self, *, warmup: int, counter: CommCounter, profile_steps: int = 0) -> None:
        self.clock = StepClock(warmup=warmup, counter=counter, profile_steps=profile_steps)
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
