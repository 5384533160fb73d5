"""One rank's failure, known to every rank within seconds — never through a collective.

A rank that raises cannot tell the others with a collective: they are inside one of their own (an FSDP2
all-gather or reduce-scatter), the two would pair wrongly, and both would wait for the collective timeout, the
real error never printed. Instead the failing rank records its error and traceback in the process group's store
(the rendezvous key/value server every rank reaches over its own connection, outside the collectives:
:func:`report_failure`). Every rank runs a :class:`FailureWatch` thread that reads the store a few times a
second: when another rank has failed, it logs ``rank 1 failed first: <error>`` at once and, should this rank not
have ended by itself within ``grace_s`` seconds, prints where its threads stand and ends the process with status 1.
Under gloo a rank's next collective fails anyway as soon as the failed process exits ("Connection closed by
peer"); under NCCL it may otherwise wait for the collective timeout.

The strategy starts the watch with the process group and reports every exception that reaches its
``on_exception`` (preemption is not a failure); the Hydra app reports what fails outside the trainer and writes the
first failure into the run's ``failed.txt``.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import logging
import os
import sys
import threading
import time
import traceback
from dataclasses import asdict, dataclass
from typing import Any

import torch.distributed as dist

from lightning_fsdp_plus._private import default_store

log = logging.getLogger(__name__)

FIRST_KEY = "fsdp_plus/failure/first"
"""The store key of the first failure (set once, by whichever rank gets there first)."""
ACK_KEY = "fsdp_plus/failure/seen"
"""Counts the ranks that have read the first failure (the failing rank waits briefly for them before it exits)."""
GRACE_S = 10.0
"""Seconds a rank may go on after another rank failed before its watch ends it."""
POLL_S = 0.25
"""How often the watch reads the store."""
ACK_WAIT_S = 1.5
"""How long a failing rank waits for the others to have read its failure (they cannot once it is gone, when it
hosts the store)."""


@dataclass(frozen=True)
class FailureRecord:
    """One rank's failure, as the store holds it."""

    rank: int
    """The global rank that raised."""
    error: str
    """``Type: message``."""
    traceback: str
    """The formatted traceback (the error's last line included)."""

    def headline(self) -> str:
        """``rank 1 failed first: RuntimeError: ...``."""
        return f"rank {self.rank} failed first: {self.error}"


_last: tuple[BaseException, FailureRecord, FailureRecord] | None = None  # the strategy and the app report the same
_watch: FailureWatch | None = None


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def describe(exception: BaseException) -> FailureRecord:
    """This rank's record of ``exception`` (no store involved)."""
    text = "".join(traceback.format_exception(exception))
    return FailureRecord(rank=_rank(), error=f"{type(exception).__name__}: {exception}", traceback=text)


def report_failure(exception: BaseException) -> tuple[FailureRecord, FailureRecord]:
    """Record ``exception`` as this rank's failure: ``(mine, first)``, where ``first`` is the run's first failure
    (``mine`` when this rank got there first, or when no store can be reached). Idempotent per exception.

    Talks to the store only, never to other ranks' collectives; waits at most :data:`ACK_WAIT_S` for the other
    ranks to read a failure this rank is the first to report.
    """
    global _last
    if _last is not None and _last[0] is exception:
        return _last[1], _last[2]
    mine = describe(exception)
    first = _record(mine)
    if first == mine and _watch is not None:
        _watch.wait_for_readers()
    _last = (exception, mine, first)
    return mine, first


def _record(mine: FailureRecord) -> FailureRecord:
    """Put ``mine`` in the store unless a failure is there already; the run's first failure."""
    store = _store()
    seen = _watch.seen if _watch is not None else None  # read before the store's host (rank 0) was gone
    if store is None:
        return seen or mine
    try:
        return FailureRecord(**json.loads(store.compare_set(FIRST_KEY, "", json.dumps(asdict(mine)))))
    except Exception:  # the store's host is gone: it failed first, or ended
        return seen or mine


def announce_failure(exception: BaseException) -> tuple[FailureRecord, FailureRecord]:
    """:func:`report_failure`, then one log line: this rank's error, or the first failure when another rank's
    came first (this rank's own error then follows from it, e.g. gloo's "Connection closed by peer")."""
    mine, first = report_failure(exception)
    if first.rank != mine.rank:
        log.error(f"{first.headline()}; rank {mine.rank} stopped because of it with {mine.error}")
    else:
        log.error(f"rank {mine.rank} failed: {mine.error}")
    return mine, first


def first_failure() -> FailureRecord | None:
    """The run's first failure if any rank has reported one (``None`` without a store, or when it is gone)."""
    store = _store()
    try:
        if store is None or not store.check([FIRST_KEY]):
            return None
        return FailureRecord(**json.loads(store.get(FIRST_KEY)))
    except Exception:
        return None


def _store() -> Any:
    return default_store() if dist.is_available() and dist.is_initialized() else None


class FailureWatch:
    """A daemon thread that ends this rank when another one failed and this one did not end by itself.

    Arguments:
        store: The process group's store.
        rank: This process's global rank.
        world_size: Ranks in the group.
        grace_s: Seconds between learning of another rank's failure and ending this process.
    """

    def __init__(self, *, store: Any, rank: int, world_size: int, grace_s: float = GRACE_S) -> None:
        self.store, self.rank, self.world_size, self.grace_s = store, rank, world_size, grace_s
        self.seen: FailureRecord | None = None
        """The other rank's failure, once read."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fsdp-plus-failure-watch", daemon=True)

    def start(self) -> FailureWatch:
        """Start watching."""
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop watching (before the process group is destroyed)."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=2 * POLL_S + 1)

    def wait_for_readers(self) -> None:
        """After this rank reported the first failure: give the other ranks' watches a moment to read it."""
        deadline = time.monotonic() + ACK_WAIT_S
        while time.monotonic() < deadline:
            try:
                if int(self.store.add(ACK_KEY, 0)) >= self.world_size - 1:
                    return
            except Exception:
                return
            time.sleep(POLL_S / 5)

    def _run(self) -> None:
        while not self._stop.wait(POLL_S):
            try:
                if not self.store.check([FIRST_KEY]):
                    continue
                first = FailureRecord(**json.loads(self.store.get(FIRST_KEY)))
            except Exception:  # the store's host ended: nothing more to watch
                return
            if first.rank == self.rank:
                return  # this rank's own failure: it is on its way out
            self._on_other_failure(first)
            return

    def _on_other_failure(self, first: FailureRecord) -> None:
        self.seen = first
        with contextlib.suppress(Exception):
            self.store.add(ACK_KEY, 1)
        log.error(f"{first.headline()} (its traceback is in its log); rank {self.rank} stops too")
        if self._stop.wait(self.grace_s):
            return  # this rank ended by itself (its own collective failed) and stopped the watch
        print(f"[rank {self.rank}] {first.headline()}\n{first.traceback}\n[rank {self.rank}] still running"
              f" {self.grace_s:g} s later; where its threads are:", file=sys.stderr, flush=True)  # fmt: skip
        faulthandler.dump_traceback(all_threads=True)
        for handler in logging.getLogger().handlers:
            handler.flush()
        os._exit(1)


def start_failure_watch(*, grace_s: float = GRACE_S) -> FailureWatch | None:
    """Start this process's watch over the default process group (once per group; ``None`` in one process)."""
    global _watch
    store = _store()
    if store is None or dist.get_world_size() == 1:
        return None
    if _watch is not None and _watch.store is store and _watch._thread.is_alive():
        return _watch
    stop_failure_watch()
    _watch = FailureWatch(store=store, rank=dist.get_rank(), world_size=dist.get_world_size(), grace_s=grace_s)
    return _watch.start()


def stop_failure_watch() -> None:
    """Stop this process's watch, if any (at shutdown, before the process group goes)."""
    global _watch
    if _watch is not None:
        _watch.stop()
        _watch = None
