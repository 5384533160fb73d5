"""Native threads of this process, by name (Linux ``/proc``): how tests see whether gloo is still running."""

from __future__ import annotations

import os


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
