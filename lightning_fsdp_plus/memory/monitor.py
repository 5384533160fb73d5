"""``MemoryMonitor``: where a rank's memory goes while it trains, on CUDA and on CPU.

Two kinds of figures per rank:

* **tensor-accounted** (any device, exact): parameters (local shards and replicated), parameters FSDP2
  currently holds unsharded, gradients, optimizer state (:mod:`~lightning_fsdp_plus.memory.accounting`), and
  activations — the storages autograd saved for backward during this step's forward, counted by a
  ``saved_tensors_hooks`` pair that only measures (parameters and their views are not activations);
* **device** (the allocator's view): on CUDA allocated, reserved, active and peak allocated bytes, and
  ``other`` = allocated - tensor-accounted (workspaces, all-gather buffers, fragmentation); on CPU the
  process's resident set and its peak.

Samples are taken after forward (activations and unsharded parameters alive), before the optimizer step
(gradients) and after it (optimizer state); the step's peak is the largest tensor-accounted total.
"""

from __future__ import annotations

import logging
import resource
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback
from lightning.pytorch.utilities.exceptions import SIGTERMException
from torch import Tensor, nn

from lightning_fsdp_plus._dist import all_gather_object
from lightning_fsdp_plus.memory.accounting import model_state_bytes

log = logging.getLogger(__name__)

CATEGORIES = ("params", "unsharded_params", "grads", "optimizer", "activations")
"""Tensor-accounted categories, in the order they are logged."""


def _is_parameter(tensor: Tensor) -> bool:
    base = tensor._base if tensor._base is not None else tensor
    return isinstance(base, nn.Parameter) or isinstance(tensor, nn.Parameter)


class SavedActivations:
    """Bytes of the distinct storages autograd saves for backward while active (parameters excluded).

    Use as a context manager around a forward pass, or ``start``/``stop`` from two callback hooks.
    Packing returns the tensor itself, so training is unchanged; activation-checkpointed regions install
    their own hooks inside, so what they recompute is not counted — as it is not kept.
    """

    def __init__(self) -> None:
        self._storages: dict[int, int] = {}
        self._context: Any = None

    @property
    def bytes(self) -> int:
        """Bytes of the distinct saved storages seen since ``start``."""
        return sum(self._storages.values())

    @property
    def largest(self) -> int:
        """Bytes of the largest saved storage seen since ``start`` (0 if none)."""
        return max(self._storages.values(), default=0)

    def _pack(self, tensor: Tensor) -> Tensor:
        if not _is_parameter(tensor):
            storage = tensor.untyped_storage()  # keyed by the storage object: works for meta and fake tensors too
            self._storages[storage._cdata] = max(storage.nbytes(), self._storages.get(storage._cdata, 0))
        return tensor

    def start(self) -> None:
        """Start counting (forgets earlier counts)."""
        self.stop()
        self._storages.clear()
        self._context = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda tensor: tensor)
        self._context.__enter__()

    def stop(self) -> None:
        """Stop counting; ``bytes`` keeps the count."""
        if self._context is not None:
            self._context.__exit__(None, None, None)
            self._context = None

    def __enter__(self) -> SavedActivations:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


@dataclass(frozen=True)
class DeviceMemory:
    """The allocator's (CUDA) or the operating system's (CPU) view of this rank's memory, in bytes."""

    allocated: int
    """CUDA: bytes in live tensors. CPU: resident set size of the process."""
    reserved: int | None
    """CUDA: bytes held by the caching allocator. CPU: ``None`` (no caching allocator)."""
    active: int | None
    """CUDA: bytes in active allocator blocks. CPU: ``None``."""
    peak: int
    """CUDA: peak allocated since start (or the last reset). CPU: peak resident set of the process."""


def _rss_bytes() -> int:
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
        return pages * resource.getpagesize()
    except (OSError, IndexError, ValueError):  # not Linux: fall back to the peak
        return _peak_rss_bytes()


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def device_memory(device: torch.device) -> DeviceMemory:
    """This rank's allocator (CUDA) or process (CPU) memory figures."""
    if device.type == "cuda":
        stats = torch.cuda.memory_stats(device)
        return DeviceMemory(
            allocated=int(torch.cuda.memory_allocated(device)),
            reserved=int(torch.cuda.memory_reserved(device)),
            active=int(stats.get("active_bytes.all.current", 0)),
            peak=int(torch.cuda.max_memory_allocated(device)),
        )
    rss = _rss_bytes()  # statm and getrusage count slightly differently: the peak is never below now
    return DeviceMemory(allocated=rss, reserved=None, active=None, peak=max(rss, _peak_rss_bytes()))


def release_cached_memory(device: torch.device) -> bool:
    """Return cached blocks to the device (``torch.cuda.empty_cache``); False where there is no cache (CPU)."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
        return True
    return False


@dataclass(frozen=True)
class MemorySample:
    """One rank's memory at one point of a step."""

    params: int
    """Local parameter storage: shards of sharded parameters, replicated (ignored) parameters in full."""
    unsharded_params: int
    """All-gathered parameters FSDP2 holds at this point."""
    grads: int
    """Gradient storage (local shards)."""
    optimizer: int
    """Optimizer state tensors (local shards)."""
    activations: int
    """Storages saved for backward by this step's forward (zero once backward has consumed them)."""
    device: DeviceMemory = field(compare=False)
    """The allocator's or the process's view at the same moment."""

    @property
    def model_state(self) -> int:
        """Parameters (sharded and unsharded), gradients and optimizer state."""
        return self.params + self.unsharded_params + self.grads + self.optimizer

    @property
    def tensor_total(self) -> int:
        """Everything tensor-accounted: model state and activations."""
        return self.model_state + self.activations

    @property
    def other(self) -> int | None:
        """CUDA: allocated bytes no category accounts for (buffers, workspaces). CPU: ``None``."""
        if self.device.reserved is None:
            return None
        return self.device.allocated - self.tensor_total

    def to_dict(self) -> dict[str, int | None]:
        """Categories, totals and device figures as a flat dict."""
        out: dict[str, int | None] = {name: getattr(self, name) for name in CATEGORIES}
        out.update(model_state=self.model_state, tensor_total=self.tensor_total, other=self.other)
        out.update({f"device_{k}": v for k, v in asdict(self.device).items()})
        return out


def sample_memory(
    module: nn.Module, *, optimizers: list[torch.optim.Optimizer], activations: int, device: torch.device
) -> MemorySample:
    """Measure this rank now."""
    state = model_state_bytes(module, optimizers)
    return MemorySample(
        params=state.params,
        unsharded_params=state.unsharded_params,
        grads=state.grads,
        optimizer=state.optimizer,
        activations=activations,
        device=device_memory(device),
    )


@dataclass
class MemoryPeaks:
    """The largest samples seen: by tensor-accounted total, by model state, and the most activations."""

    peak: MemorySample | None = None
    """The sample with the largest ``tensor_total``."""
    model_state: MemorySample | None = None
    """The sample with the largest ``model_state``."""
    activations: int = 0
    """The most bytes saved for backward by one forward."""

    def update(self, sample: MemorySample) -> None:
        """Keep ``sample`` where it is the largest so far."""
        if self.peak is None or sample.tensor_total > self.peak.tensor_total:
            self.peak = sample
        if self.model_state is None or sample.model_state > self.model_state.model_state:
            self.model_state = sample
        self.activations = max(self.activations, sample.activations)

    def figures(self) -> dict[str, int]:
        """Model-state, tensor-peak and activation bytes."""
        return {
            "model_state_bytes": self.model_state.model_state if self.model_state else 0,
            "tensor_peak_bytes": self.peak.tensor_total if self.peak else 0,
            "activation_bytes": self.activations,
        }


def format_sample(sample: MemorySample, *, title: str) -> str:
    """A small text table of one sample, in MiB."""
    rows = [(name, value) for name, value in sample.to_dict().items() if value is not None]
    width = max(len(name) for name, _ in rows)
    lines = [title, "-" * len(title)]
    lines += [f"{name:<{width}}  {value / 2**20:12.3f} MiB" for name, value in rows]
    return "\n".join(lines) + "\n"


class MemoryMonitor(Callback):
    """Logs and summarises per-rank memory by category while training (CPU and CUDA).

    Arguments:
        log_every_n_steps: Log the step's peak sample (maximum over ranks, as ``memory/<category>``) every
            N optimizer steps; 0 never logs (figures still reach :meth:`summary`).
        empty_cache_every_n_steps: Call ``torch.cuda.empty_cache()`` before every N-th step (0: never).
            Returns cached blocks to the driver, so ``reserved`` drops; no effect on CPU.
        track_activations: Count saved activation storages (a cheap ``saved_tensors_hooks`` pair).
        summary_every_n_steps: Write each rank's memory summary text every N steps (0: never).
        summary_dir: Where summaries go (default: the trainer's ``log_dir`` or ``default_root_dir``).
        summary_on_exception: Write the summary when training raises (an out-of-memory, say).
    """

    def __init__(
        self,
        *,
        log_every_n_steps: int = 10,
        empty_cache_every_n_steps: int = 0,
        track_activations: bool = True,
        summary_every_n_steps: int = 0,
        summary_dir: str | None = None,
        summary_on_exception: bool = True,
    ) -> None:
        for key, value in (
            ("log_every_n_steps", log_every_n_steps),
            ("empty_cache_every_n_steps", empty_cache_every_n_steps),
            ("summary_every_n_steps", summary_every_n_steps),
        ):
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"MemoryMonitor: {key}={value!r} is not valid; use an integer >= 0 (0 = off).")
        self.log_every_n_steps = log_every_n_steps
        self.empty_cache_every_n_steps = empty_cache_every_n_steps
        self.track_activations = track_activations
        self.summary_every_n_steps = summary_every_n_steps
        self.summary_dir = summary_dir
        self.summary_on_exception = summary_on_exception
        self.peaks = MemoryPeaks()
        """The run's largest samples on this rank."""
        self.last: MemorySample | None = None
        """The most recent sample."""
        self.step_peaks: list[MemorySample] = []
        """Each step's largest sample (in step order)."""
        self.empty_cache_steps: list[int] = []
        """Steps before which the cache was emptied."""
        self._activations = SavedActivations()
        self._step_peak: MemorySample | None = None
        self._directory: Path | None = None

    @property
    def peak(self) -> MemorySample | None:
        """The largest tensor-accounted sample of the run on this rank."""
        return self.peaks.peak

    @property
    def model_state_peak(self) -> int:
        """The largest model state (parameters, unsharded copies, gradients, optimizer) of any sample."""
        return self.peaks.figures()["model_state_bytes"]

    @property
    def activation_peak(self) -> int:
        """The most bytes saved for backward by any step's forward."""
        return self.peaks.activations

    # ---- sampling --------------------------------------------------------------------------------------
    def _sample(self, trainer: Any, module: nn.Module, activations: int) -> None:
        sample = sample_memory(
            module, optimizers=trainer.optimizers, activations=activations, device=trainer.strategy.root_device
        )
        self.last = sample
        self.peaks.update(sample)
        if self._step_peak is None or sample.tensor_total > self._step_peak.tensor_total:
            self._step_peak = sample

    def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, batch_idx: int) -> None:
        """Empty the cache when due and start counting saved activations."""
        step = trainer.global_step
        if self.empty_cache_every_n_steps and step > 0 and step % self.empty_cache_every_n_steps == 0:
            release_cached_memory(trainer.strategy.root_device)
            self.empty_cache_steps.append(step)
        self._step_peak = None
        if self.track_activations:
            self._activations.start()

    def on_before_backward(self, trainer: Any, module: Any, loss: Tensor) -> None:
        """Sample after forward: activations and the units' unsharded parameters are alive."""
        self._activations.stop()
        self._sample(trainer, module, self._activations.bytes)

    def on_before_optimizer_step(self, trainer: Any, module: Any, optimizer: Any) -> None:
        """Sample with gradients present."""
        self._sample(trainer, module, 0)

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        """Sample after the optimizer step, keep the step's peak, log and write the summary when due."""
        self._activations.stop()
        self._sample(trainer, module, 0)
        self.step_peaks.append(self._step_peak)
        step = trainer.global_step
        if self.log_every_n_steps and step % self.log_every_n_steps == 0:
            self._log(trainer, module, self._step_peak)
        if self.summary_every_n_steps and step % self.summary_every_n_steps == 0:
            self.write_summary(trainer, tag=f"step{step}")

    def setup(self, trainer: Any, module: Any, stage: str) -> None:
        """Resolve the summary directory now, while every rank is here: ``trainer.log_dir`` is a collective (a
        broadcast), which the exception path must never run."""
        self._directory = Path(self.summary_dir or trainer.log_dir or trainer.default_root_dir)

    def on_exception(self, trainer: Any, module: Any, exception: BaseException) -> None:
        """Stop counting and, if asked, write what this rank held when training failed (no collective: the other
        ranks may be inside one of their own)."""
        self._activations.stop()
        if isinstance(exception, SIGTERMException):
            return  # a preemption or requeue, not a failure: the strategy says which signal, step and checkpoint
        if self.summary_on_exception and self.last is not None:
            directory = self._directory or Path(self.summary_dir or trainer.default_root_dir)
            path = self.write_summary(trainer, tag="exception", directory=directory)
            log.info(f"MemoryMonitor: rank {trainer.global_rank}'s memory at the failure written to {path}")

    # ---- reporting -------------------------------------------------------------------------------------
    def _log(self, trainer: Any, module: Any, sample: MemorySample) -> None:
        values = {k: v for k, v in sample.to_dict().items() if v is not None}
        stacked = torch.tensor(list(values.values()), dtype=torch.int64, device=trainer.strategy.root_device)
        maxed = trainer.strategy.reduce(stacked, reduce_op="max") if trainer.world_size > 1 else stacked
        module.log_dict(
            {f"memory/{k}": float(v) for k, v in zip(values, maxed.tolist(), strict=True)},
            on_step=True,
            on_epoch=False,
            rank_zero_only=True,
        )

    def memory_summary(self, trainer: Any) -> str:
        """This rank's summary: ``torch.cuda.memory_summary()`` on CUDA, then the tensor-accounted table."""
        device = trainer.strategy.root_device
        parts = [torch.cuda.memory_summary(device)] if device.type == "cuda" else []
        for title, sample in (("latest sample", self.last), ("peak sample", self.peak)):
            if sample is not None:
                parts.append(format_sample(sample, title=f"rank {trainer.global_rank} {title}"))
        return "\n".join(parts)

    def write_summary(self, trainer: Any, *, tag: str = "now", directory: Path | None = None) -> Path:
        """Write :meth:`memory_summary` to ``<summary_dir>/memory_summary.<tag>.rank<r>.txt`` (on demand too). The
        directory resolved in :meth:`setup` is reused; before it, ``trainer.log_dir`` is a collective when
        ``summary_dir`` is unset (a broadcast of rank 0's)."""
        directory = directory or self._directory
        directory = directory or Path(self.summary_dir or trainer.log_dir or trainer.default_root_dir)
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / f"memory_summary.{tag}.rank{trainer.global_rank}.txt"
        path.write_text(self.memory_summary(trainer))
        return path

    def summary(self, trainer: Any) -> dict[str, Any]:
        """Peak figures over all ranks (a collective: call on every rank) for ``metrics.json``.

        ``model_state_bytes_per_rank`` (largest model state of any sample), ``activation_bytes_per_rank``
        (most saved activations), ``tensor_peak_bytes_per_rank`` (largest model state + activations) and
        ``peak_bytes_per_rank`` (device or process peak) are maxima over ranks; ``memory`` holds the largest
        rank's peak sample by category, ``memory_per_rank`` every rank's.
        """
        mine = self.peak.to_dict() if self.peak is not None else {}
        device = device_memory(trainer.strategy.root_device)
        ranks = all_gather_object({**mine, "model_state_peak": self.model_state_peak,
                                   "activation_peak": self.activation_peak, "device_peak": device.peak})  # fmt: skip
        largest = max(ranks, key=lambda r: r.get("tensor_total") or 0)
        return {
            "model_state_bytes_per_rank": max(r["model_state_peak"] for r in ranks),
            "tensor_peak_bytes_per_rank": max(r.get("tensor_total") or 0 for r in ranks),
            "activation_bytes_per_rank": max(r["activation_peak"] for r in ranks),
            "peak_bytes_per_rank": max(r["device_peak"] for r in ranks),
            "memory": largest,
            "memory_per_rank": ranks,
        }


def iter_monitors(callbacks: list[Callback]) -> Iterator[MemoryMonitor]:
    """The ``MemoryMonitor`` instances among ``callbacks``."""
    return (cb for cb in callbacks if isinstance(cb, MemoryMonitor))
