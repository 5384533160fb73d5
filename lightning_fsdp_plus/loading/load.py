"""Load the weights of every deferred pretrained model inside a (sharded) module: each rank reads its shards.

Called by the preparation pipeline's last stage (after ``fully_shard``), and usable on its own after
hand-written ``fully_shard`` calls or in a single process. Tensors still on the meta device become empty
ones on ``device`` (real tensors — LoRA adapters, buffers — are left alone), then ``torch.distributed.checkpoint``
fills them through :class:`~lightning_fsdp_plus.loading.planner.StreamingLoadPlanner`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lightning_fsdp_plus.loading.files import PretrainedLoadError, read_checkpoint, storage_reader
from lightning_fsdp_plus.loading.planner import StreamingLoadPlanner
from lightning_fsdp_plus.loading.targets import deferred_models, host_targets


@dataclass(frozen=True)
class LoadSummary:
    """What one rank loaded: files, bytes and time (rank 0 reports it)."""

    sources: tuple[str, ...]
    """``name_or_path`` of each deferred model loaded."""
    files: int
    """safetensors files in those checkpoints."""
    checkpoint_bytes: int
    """Bytes of tensor data in those checkpoints."""
    bytes_read: int
    """Bytes this rank read from them (its slices)."""
    tensors: int
    """Tensors filled."""
    seconds: float
    """Wall time of the read."""

    def message(self) -> str:
        """One line for the log."""
        return (
            f"fsdp_plus: loaded {', '.join(self.sources)}: {self.tensors} tensors from {self.files} safetensors"
            f" file(s) ({_size(self.checkpoint_bytes)}); this rank read {_size(self.bytes_read)} (its shards)"
            f" in {self.seconds:.1f} s"
        )


def _size(nbytes: int) -> str:
    return f"{nbytes / 1e9:.2f} GB" if nbytes >= 1e9 else f"{nbytes / 1e6:.1f} MB"


def has_pending_weights(model: nn.Module) -> bool:
    """True when a deferred pretrained model inside ``model`` still has weights on the meta device."""
    return any(p.is_meta for _, host, _ in deferred_models(model) for p in host.parameters())


def materialize_meta(model: nn.Module, *, device: torch.device) -> None:
    """Tensors on the meta device become uninitialized ones on ``device``; real tensors are kept as they are.

    ``Module.to_empty`` would also replace real ones (LoRA adapters, rotary buffers). Applied from the root, so
    FSDP2 units re-register their new shards (``FSDPModule._apply``). A plain parameter moved off meta becomes a
    new ``Parameter`` per module that holds it, which would untie tied weights: ties are restored afterwards.
    """
    tied = [names for names in _names_by_tensor(model) if len(names) > 1]
    model._apply(lambda t: torch.empty_like(t, device=device) if t.is_meta else t)
    for names in tied:
        first = model.get_parameter(names[0])
        for name in names[1:]:
            owner_path, _, attribute = name.rpartition(".")
            setattr(model.get_submodule(owner_path), attribute, first)


def _names_by_tensor(model: nn.Module) -> list[list[str]]:
    groups: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(param), []).append(name)
    return list(groups.values())


def load_pretrained_weights(
    model: nn.Module, *, device: torch.device | str = "cpu", report: Callable[[str], Any] = lambda _: None
) -> LoadSummary | None:
    """Fill every deferred pretrained model inside ``model`` from its checkpoint; call on every rank.

    Returns None when there is nothing to load (no deferred model, or its weights are loaded already). An error
    on any rank (a file gone, unreadable data) is raised on every rank by ``torch.distributed.checkpoint``.
    """
    if not has_pending_weights(model):
        return None
    import torch.distributed.checkpoint as dcp

    hosts = deferred_models(model)
    # while still on meta: names and shapes are checked before anything is read
    per_host = [(source, host_targets(model, path, host, source)) for path, host, source in hosts]
    materialize_meta(model, device=torch.device(device))
    started = time.perf_counter()
    bytes_read = 0
    for source, own in per_host:
        report(f"fsdp_plus: loading {source.name_or_path} ({len(source.checkpoint.files)} safetensors file(s),"
               f" {_size(source.checkpoint.nbytes)}); every rank reads only its own shards")  # fmt: skip
        planner = StreamingLoadPlanner(model, own)
        try:
            dcp.load({}, storage_reader=storage_reader(source.checkpoint), planner=planner)
        except dcp.CheckpointException as err:  # raised on every rank, whichever failed
            _recheck_files(source.checkpoint.directory, err)
            raise PretrainedLoadError(_first_failure(err, source.name_or_path)) from err
        planner.finish()
        bytes_read += planner.bytes_read
    release_free_memory()
    summary = LoadSummary(
        sources=tuple(source.name_or_path for _, _, source in hosts),
        files=sum(len(source.checkpoint.files) for _, _, source in hosts),
        checkpoint_bytes=sum(source.checkpoint.nbytes for _, _, source in hosts),
        bytes_read=bytes_read,
        tensors=sum(len(own) for _, own in per_host),
        seconds=time.perf_counter() - started,
    )
    report(summary.message())
    return summary


def release_free_memory() -> None:
    """Hand the loader's freed temporaries back to the OS (glibc keeps freed heap memory; elsewhere a no-op).

    Slices and quantization temporaries below glibc's dynamic mmap threshold come from the heap; once the load
    is done they are free but still resident until ``malloc_trim``.
    """
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return
    trim(0)


def _recheck_files(directory: Any, err: BaseException) -> None:
    """Name the broken file when the failure came from the files (changed since the model was built)."""
    try:
        read_checkpoint(directory)
    except PretrainedLoadError as broken:
        raise broken from err


def _first_failure(err: Any, name: str) -> str:
    """The first failing rank's own message (DCP's exception lists every rank's traceback)."""
    failures = getattr(err, "failures", {}) or {}
    for rank, failure in sorted(failures.items()):
        exc = failure[0] if isinstance(failure, tuple) else failure
        return f"loading {name} failed on rank {rank}: {type(exc).__name__}: {exc}"
    return f"loading {name} failed: {err}"
