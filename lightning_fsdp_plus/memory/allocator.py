"""Which ``malloc`` serves this process, and where a faster, leaner one is (CPU runs).

On CPU every tensor comes from the C allocator. glibc's ``malloc`` raises its mmap threshold after a large block is
freed (up to 32 MiB), so later tensors of a few MiB are carved from its heap and, once freed, stay resident in it.
Measured on 2 CPU ranks, LoRA on an int8 Llama of 135M parameters (``docs/memory.md``): 1,226 MiB free but kept by
glibc after a step, beside 295 MiB in use; ``RssAnon`` peaked at 1,874 MiB with glibc, 1,049 MiB with tcmalloc
(``LD_PRELOAD``, steps 12% faster). A running process cannot change its allocator, so this module only tells what
is loaded and where tcmalloc lies; ``scripts/run`` and ``scripts/demo.sh`` preload it when it is installed.
"""

from __future__ import annotations

import ctypes
import functools
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning.pytorch.utilities.rank_zero import rank_zero_info

TCMALLOC_NAMES = ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4")
"""tcmalloc's shared libraries (Debian/Ubuntu ``libtcmalloc-minimal4``, ``libgoogle-perftools4``)."""
LIBRARY_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib", "/usr/local/lib")
"""Where :func:`tcmalloc_path` looks."""
_KNOWN = {"tcmalloc": "tcmalloc", "jemalloc": "jemalloc", "mimalloc": "mimalloc"}
TCMALLOC_FACTOR = 1.10
"""Process memory added ÷ live tensor bytes at the peak under tcmalloc: 1.05-1.20 measured at 12.8M-400M, LoRA on
int8 and float bases (docs/memory.md)."""
GLIBC_FACTOR = 2.4
"""The same under glibc's ``malloc``: 2.24 measured at 12.8M and 135M, 2.34 at 400M (docs/memory.md)."""
CUDA_CONTEXT_BYTES = 287_047_680
"""Device memory a process's CUDA context takes once it has run kernels, with lazy module loading (PyTorch's default
since 1.13, CUDA's on Linux since 12.2): ``cudaMemGetInfo`` after one tensor op, pytorch/pytorch#85692
(666,632,192 bytes loading every module eagerly). Outside PyTorch's allocator: ``torch.cuda.max_memory_*`` never
shows it, ``nvidia-smi`` does."""
NCCL_COMMUNICATOR_BYTES = (544 * 2**20, 688 * 2**20)
"""Device memory one NCCL communicator holds once it has run a collective, for 2 ranks and for more: 544 and 688 MiB
on 4 A100s over NVLink with PyTorch, a 4 MB all-reduce per process group (NVIDIA/nccl#964). It is linear in NCCL's
channels (NCCL_BUFFSIZE, 4 MiB by default, per channel and peer; NVIDIA/nccl#986), so PCIe cards with fewer channels
hold less. Outside PyTorch's allocator, like the context."""


def allocator_in_use(maps: Path = Path("/proc/self/maps")) -> str:
    """``tcmalloc``, ``jemalloc`` or ``mimalloc`` when one is mapped into this process, else ``glibc`` (or
    ``unknown`` where ``/proc`` does not exist)."""
    try:
        text = maps.read_text()
    except OSError:
        return "unknown"
    return next((name for marker, name in _KNOWN.items() if marker in text), "glibc")


def tcmalloc_path(dirs: tuple[str, ...] = LIBRARY_DIRS) -> Path | None:
    """The first tcmalloc shared library found in ``dirs`` (``None``: not installed)."""
    return next((Path(d) / n for d in dirs for n in TCMALLOC_NAMES if (Path(d) / n).is_file()), None)


@functools.cache
def _tcmalloc_property() -> Any:
    """tcmalloc's ``MallocExtension_GetNumericProperty`` in this process, or ``None`` (looked up once: samplers call
    :func:`tcmalloc_allocated_bytes` every fraction of a millisecond)."""
    return getattr(ctypes.CDLL(None), "MallocExtension_GetNumericProperty", None)


def tcmalloc_allocated_bytes() -> int | None:
    """Bytes the application holds in tcmalloc now (``generic.current_allocated_bytes``: live allocations, without
    tcmalloc's own free lists); ``None`` when tcmalloc is not this process's allocator."""
    query = _tcmalloc_property()
    if query is None:
        return None
    value = ctypes.c_size_t(0)
    return value.value if query(b"generic.current_allocated_bytes", ctypes.byref(value)) else None


def release_free_memory() -> None:
    """Return the allocator's free memory to the system (tcmalloc's ``ReleaseFreeMemory``, glibc's ``malloc_trim``):
    a process measuring several runs one after another starts each from its live bytes."""
    process = ctypes.CDLL(None)
    release = getattr(process, "MallocExtension_ReleaseFreeMemory", None)
    if release is not None:
        release()
    elif hasattr(process, "malloc_trim"):
        process.malloc_trim(0)


def allocator_advice() -> str | None:
    """One line for a CPU run under glibc's ``malloc`` (``None`` under another allocator)."""
    if allocator_in_use() != "glibc":
        return None
    found = tcmalloc_path()
    how = f"LD_PRELOAD={found}" if found else "apt-get install libtcmalloc-minimal4, then LD_PRELOAD it"
    return (f"fsdp_plus: CPU tensors come from glibc's malloc, which keeps freed blocks resident: a rank can hold"
            f" 2-3x its tensors (LoRA on a 135M int8 Llama: 1.8 GiB vs 1.0 GiB under tcmalloc, whose steps were 12%"
            f" faster). To use tcmalloc: {how} (scripts/run and scripts/demo.sh do when it is installed)")  # fmt: skip


@functools.cache
def report_allocator_once() -> None:
    """Log :func:`allocator_advice` once per process (rank 0), when there is advice to give."""
    advice = allocator_advice()
    if advice:
        rank_zero_info(advice)


@dataclass(frozen=True)
class Platform:
    """What a device's runtime adds to the tensors the estimator counts: the real peak is
    ``(peak with transient + gather_copies x the largest gathered unit) x allocator_factor + runtime_bytes``."""

    name: str
    """``cuda``, or ``cpu-<allocator>``."""
    gather_copies: int
    """Extra buffers of a unit's gathered size alive while its all-gather runs (gloo gathers into a temporary, then
    copies; NCCL gathers into FSDP2's output)."""
    allocator_factor: float
    """Process memory added over an idle process ÷ the live tensor bytes at the peak: what the allocator keeps."""
    basis: str
    """Where the figures come from."""
    context_bytes: int = 0
    """What the device runtime holds per process outside the allocator (the CUDA context)."""
    communicator_bytes: tuple[int, int] = (0, 0)
    """What one collective communicator holds outside the allocator, for 2 ranks and for more (NCCL's buffers)."""

    def runtime_bytes(self, *, group_sizes: Iterable[int]) -> int:
        """The context plus a communicator for every distinct process group of more than one rank the run uses
        (``group_sizes``: the world, and the mesh's shard and replicate groups where they differ from it)."""
        pairs, more = self.communicator_bytes
        return self.context_bytes + sum(pairs if n == 2 else more for n in set(group_sizes) if n > 1)


PLATFORMS: dict[str, Platform] = {
    "cuda": Platform(
        "cuda",
        0,
        1.0,
        "NCCL gathers in place; the CUDA context (pytorch/pytorch#85692) and NCCL's buffers (NVIDIA/nccl#964) as"
        " published; the caching allocator's reserve above its tensors is what memory_margin keeps free (to be"
        " confirmed on a GPU)",
        CUDA_CONTEXT_BYTES,
        NCCL_COMMUNICATOR_BYTES,
    ),
    "cpu-tcmalloc": Platform("cpu-tcmalloc", 1, TCMALLOC_FACTOR, "measured: 2 CPU ranks, 12.8M-400M (docs/memory.md)"),
    "cpu-glibc": Platform(
        "cpu-glibc",
        1,
        GLIBC_FACTOR,
        "measured: 2 CPU ranks, 12.8M-400M (docs/memory.md); glibc's fragmentation varies with the order of frees",
    ),
    "cpu-mmap": Platform(
        "cpu-mmap",
        1,
        1.0,
        "glibc with MALLOC_MMAP_THRESHOLD_ <= 1 MiB: every tensor its own mapping, returned when freed (slower steps)",
    ),
}
"""The platforms the real peak knows, by name."""


def platform_for(
    device_type: str, *, allocator: str | None = None, environ: Mapping[str, str] = os.environ
) -> Platform:
    """The platform of a ``device_type`` device; on CPU, of ``allocator`` (default: the one in this process)."""
    if device_type != "cpu":
        return PLATFORMS["cuda"]
    allocator = allocator or allocator_in_use()
    if allocator == "glibc" and int(environ.get("MALLOC_MMAP_THRESHOLD_", "0") or 0) in range(1, 2**20 + 1):
        return PLATFORMS["cpu-mmap"]
    return PLATFORMS.get(f"cpu-{allocator}", PLATFORMS["cpu-glibc"])
