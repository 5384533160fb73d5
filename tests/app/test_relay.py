"""A sweep job's child gets the stop signal first and the job process's own handler runs only after the child has
ended (submitit's requeue killed the child before it saved: issue 34)."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest

from lightning_fsdp_plus.app.relay import run_relaying_signals

CHILD = """
import signal, sys, time
from pathlib import Path
out = Path(sys.argv[1])
got = []
for s in (signal.SIGUSR2, signal.SIGTERM, signal.SIGINT):
    signal.signal(s, lambda n, f: got.append(n))
(out / "ready").touch()
start = time.monotonic()
while not got and time.monotonic() - start < float(sys.argv[2]):
    time.sleep(0.01)
time.sleep(0.3)  # "saving"
(out / "saved").write_text(",".join(str(n) for n in got))
sys.exit(128 + got[0] if got else 0)
"""


def signal_self_when_ready(out: Path, signum: int) -> None:
    """Send ``signum`` to this (the job) process once the child says it is ready, from a thread."""

    def send() -> None:
        while not (out / "ready").exists():
            time.sleep(0.01)
        os.kill(os.getpid(), signum)

    threading.Thread(target=send, daemon=True).start()


def run_child(out: Path, *, wait_s: float = 30):
    """The child: it waits up to ``wait_s`` for a signal, then "saves" and exits with 128 + the signal."""
    return run_relaying_signals([sys.executable, "-c", CHILD, str(out), str(wait_s)], cwd=out, env=os.environ)


@pytest.fixture
def restore_handlers():
    saved = {s: signal.getsignal(s) for s in (signal.SIGUSR2, signal.SIGINT, signal.SIGTERM)}
    yield
    for s, handler in saved.items():
        signal.signal(s, handler)


@pytest.mark.usefixtures("restore_handlers")
def test_the_child_saves_before_the_job_processs_own_handler_runs(tmp_path):
    """Like submitit's SIGUSR2 handler (requeue, exit): it sees the child's checkpoint already written, once."""
    seen: list[tuple[int, bool]] = []

    def submitit_like(signum, frame):
        seen.append((signum, (tmp_path / "saved").exists()))

    signal.signal(signal.SIGUSR2, submitit_like)
    signal_self_when_ready(tmp_path, signal.SIGUSR2)
    ended = run_child(tmp_path)
    assert seen == [(signal.SIGUSR2, True)]
    assert (tmp_path / "saved").read_text() == str(int(signal.SIGUSR2))  # relayed once, to the child
    assert (ended.returncode, ended.signum) == (128 + signal.SIGUSR2, signal.SIGUSR2)
    assert signal.getsignal(signal.SIGUSR2) is submitit_like  # put back


@pytest.mark.usefixtures("restore_handlers")
def test_sigint_is_not_relayed_and_interrupts_after_the_child_ended(tmp_path):
    """A terminal's Ctrl+C reaches the child by itself (a second one would abort its save): the job process only
    raises its ``KeyboardInterrupt`` once the child has ended."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal_self_when_ready(tmp_path, signal.SIGINT)
    with pytest.raises(KeyboardInterrupt):
        run_child(tmp_path, wait_s=1)
    assert (tmp_path / "saved").read_text() == ""  # the child ran its course and received nothing from us


@pytest.mark.usefixtures("restore_handlers")
def test_without_a_signal_the_child_runs_to_its_end(tmp_path):
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    ended = run_relaying_signals([sys.executable, "-c", "import sys; sys.exit(3)"], cwd=tmp_path, env=os.environ)
    assert (ended.returncode, ended.signum) == (3, 0)
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
