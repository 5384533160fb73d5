"""CPU ranks share the host's cores: each rank's torch gets its share of intra-op threads, as torchrun gives.

torch uses every core for its intra-op threads by default, in every process. Lightning's launcher starts one process
per CPU "device", so N ranks on C cores run N x C threads, and the cores thrash between them; torchrun avoids it by
setting ``OMP_NUM_THREADS=1`` for each rank. Measured on 2 cores, 2 ranks, LoRA on a 135M int8 Llama: 3.24 s per
step with 2 threads per rank, 2.70 s with 1 (and the auto plan's probe, timing each rank while the other waits on
a collective, saw up to 162 GFLOP/s on a core that does 115: its step times were 20-50% too fast).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info


def cores_per_rank(*, local_ranks: int, cores: int | None = None) -> int:
    """This rank's share of the cores it may run on: at least one."""
    available = cores if cores is not None else len(os.sched_getaffinity(0))
    return max(1, available // max(local_ranks, 1))


def share_cores(*, local_ranks: int, environ: Mapping[str, str] = os.environ, cores: int | None = None) -> int | None:
    """Give this rank's torch its share of the cores (``torch.set_num_threads``) unless ``OMP_NUM_THREADS`` says
    how many it wants; the thread count set, or ``None`` when the environment decides."""
    if environ.get("OMP_NUM_THREADS"):
        return None
    threads = cores_per_rank(local_ranks=local_ranks, cores=cores)
    if torch.get_num_threads() != threads:
        _BEFORE.append(torch.get_num_threads())
        torch.set_num_threads(threads)
        rank_zero_info(f"fsdp_plus: {local_ranks} CPU rank(s) on this host share its cores: {threads} torch thread(s)"
                       " per rank (OMP_NUM_THREADS=N chooses otherwise)")  # fmt: skip
    return threads


_BEFORE: list[int] = []


def restore_threads() -> None:
    """Give torch back the thread count :func:`share_cores` replaced (a process that outlives the fit, such as a
    test session or a notebook, keeps its own setting)."""
    if _BEFORE:
        torch.set_num_threads(_BEFORE[0])
        _BEFORE.clear()


@contextmanager
def rank_share_of_cores(*, local_ranks: int, cores: int | None = None) -> Iterator[int]:
    """Run the block with the torch threads one of ``local_ranks`` ranks on this host would get (as the strategy
    gives them): a one-process probe of a multi-rank run then measures one rank's compute, not the whole host's."""
    before = torch.get_num_threads()
    threads = cores_per_rank(local_ranks=local_ranks, cores=cores)
    torch.set_num_threads(threads)
    try:
        yield threads
    finally:
        torch.set_num_threads(before)
