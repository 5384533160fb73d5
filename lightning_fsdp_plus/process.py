"""What every rank sets up once its process group exists, under the Trainer's strategy and Fabric's alike."""

from __future__ import annotations

import atexit

from lightning_fsdp_plus._dist import shutdown
from lightning_fsdp_plus.cpu_threads import share_cores
from lightning_fsdp_plus.failures import start_failure_watch
from lightning_fsdp_plus.memory.allocator import report_allocator_once


def start_rank_services(*, device_type: str, local_ranks: int) -> None:
    """Free the process groups at exit while the interpreter is still whole (:func:`~lightning_fsdp_plus._dist.
    shutdown`: Lightning only destroys nccl groups at exit, and a gloo group left to interpreter teardown can abort
    the process); watch for another rank's failure (:mod:`~lightning_fsdp_plus.failures`: one rank's error ends
    every rank within seconds); on CPU, say what glibc's malloc costs and share the cores among the ``local_ranks``
    ranks of this machine (N ranks using every core each thrash)."""
    atexit.unregister(shutdown)  # once per process, however many fits
    atexit.register(shutdown)
    start_failure_watch()
    if device_type == "cpu":
        report_allocator_once()
        share_cores(local_ranks=local_ranks)
