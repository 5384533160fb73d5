"""Native threads of this process, by name (Linux ``/proc``): how tests see whether gloo is still running."""

from __future__ import annotations

import os
import time


def gloo_threads() -> list[str]:
    """Names of this process's live gloo threads (``pt_gloo_runloop`` workers, the ``gloo_tcp_loop``)."""
    names = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                names.append(f.read().strip())
        except FileNotFoundError:  # the thread ended while we listed
            continue
    return sorted(name for name in names if "gloo" in name)


def started_gloo_threads(*, timeout_s: float = 10.0) -> list[str]:
    """:func:`gloo_threads` once one is named: a new thread names itself when it first runs, so right after a gloo
    group is created its threads may still carry the creator's name (seen on a loaded machine: none found)."""
    deadline = time.monotonic() + timeout_s
    while not (names := gloo_threads()) and time.monotonic() < deadline:
        time.sleep(0.01)
    return names
