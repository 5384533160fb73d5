"""A sweep job's training process and the signals meant for it.

Each multirun job trains in a fresh child process (:func:`lightning_fsdp_plus.app.train.run_job_in_subprocess`).
A signal that stops a run (SIGTERM, SIGINT, SIGUSR1, SIGUSR2) must reach the child, which stops every rank after
the same step and saves, *before* whatever the job process itself does with it: under Hydra's submitit launcher the
job process's SIGUSR2 handler (submitit's preemption and timeout signal) checkpoints the job and requeues it at once,
and ``subprocess.run`` then killed the child 0.1 s after the signal, before it saved (measured on a one-node SLURM:
the requeued job restarted from the last periodic checkpoint, the other rank's child died of SIGUSR2).

:func:`run_relaying_signals` runs the child with the job process's handlers replaced by a relay: the signal is
passed on to the child (SIGINT excepted: a terminal sends it to the child too, and a second one aborts the child
without saving), the child stops and saves, and then the signal is delivered to the job process's own handler —
submitit requeues only once the checkpoint is complete. No collective, no I/O in the handler.
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning_fsdp_plus.preemption import STOP_SIGNALS

HELD_SIGNALS: tuple[int, ...] = (*STOP_SIGNALS, int(signal.SIGUSR1))
"""Held back from the job process's own handlers until the child has ended: the signals the child's ranks stop on
(SIGUSR1: Lightning's default requeue signal). Each but SIGINT is passed on to the child as it arrives (it stops
after the next step and saves; a duplicate is ignored there); SIGINT the child got from the terminal already."""


class JobStopped(RuntimeError):
    """The job's training process stopped on a signal after saving (a preemption, a requeue, a cancel): not a
    failure; the message says where the checkpoints are."""


@dataclass(frozen=True)
class ChildExit:
    """How the child ended and which signal, if any, the job process received while it ran."""

    returncode: int
    """The child's exit status (negative: the signal that killed it)."""
    signum: int
    """The first of :data:`HELD_SIGNALS` the job process received while the child ran (0: none)."""


def run_relaying_signals(command: Sequence[str], *, cwd: str | Path, env: Mapping[str, str]) -> ChildExit:
    """Run ``command`` to its end, relaying stop signals to it; then hand a signal received meanwhile to the handler
    that was in place before (submitit's requeue, Python's ``KeyboardInterrupt``, the default action) — it may
    raise or end this process, after the child has saved."""
    if threading.current_thread() is not threading.main_thread():  # handlers can only be set in the main thread
        return ChildExit(subprocess.run(list(command), cwd=cwd, env=dict(env), check=False).returncode, 0)
    received: list[int] = []
    children: list[subprocess.Popen[Any]] = []

    def relay(signum: int, frame: Any) -> None:
        if not received:
            received.append(signum)
        if signum != signal.SIGINT and children and children[0].poll() is None:
            with contextlib.suppress(ProcessLookupError):
                children[0].send_signal(signum)

    previous = {signum: signal.signal(signum, relay) for signum in HELD_SIGNALS}
    try:
        children.append(subprocess.Popen(list(command), cwd=cwd, env=dict(env)))
        if received:  # arrived between the handlers and the child: it has not seen it
            relay(received[0], None)
        returncode = children[0].wait()
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    ended = ChildExit(returncode, received[0] if received else 0)
    if ended.signum:
        _deliver(ended.signum, previous[ended.signum])
    return ended


def _deliver(signum: int, handler: Any) -> None:
    """Give the signal to the handler that was in place: call a Python one, raise it again for the default action."""
    if callable(handler):
        handler(signum, None)
    elif handler == signal.SIG_DFL:
        signal.raise_signal(signum)
