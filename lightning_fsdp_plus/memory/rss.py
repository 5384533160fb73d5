"""This process's resident memory split as Linux reports it, and its peak over a stretch of code.

``RssAnon`` is memory only this process holds (tensors, Python objects); ``RssFile`` is file pages mapped in
(safetensors are read through mmap), which the kernel can drop and re-read at any time. Loading is judged by the
first; the second is reported apart. Linux keeps no peak per kind, so :class:`PeakRss` samples
``/proc/self/status`` from a thread every few milliseconds (a spike shorter than the interval can be missed).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from pathlib import Path

STATUS = Path("/proc/self/status")


@dataclass(frozen=True)
class Rss:
    """Resident memory in bytes: anonymous and file-backed."""

    anon: int
    """``RssAnon``: this process's own memory."""
    file: int
    """``RssFile``: mapped file pages (reclaimable)."""


def rss() -> Rss:
    """The current ``RssAnon`` / ``RssFile`` (zeros where ``/proc`` does not exist)."""
    try:
        lines = STATUS.read_text().splitlines()
    except OSError:
        return Rss(0, 0)
    fields = {}
    for line in lines:
        name, _, value = line.partition(":")
        if name in ("RssAnon", "RssFile"):
            fields[name] = int(value.split()[0]) * 1024
    return Rss(anon=fields.get("RssAnon", 0), file=fields.get("RssFile", 0))


class PeakRss:
    """Peak ``RssAnon`` and ``RssFile`` while the ``with`` block runs, and what was there before it.

    Arguments:
        interval_s: Sampling interval of the background thread.
    """

    def __init__(self, *, interval_s: float = 0.002) -> None:
        self.interval_s = interval_s
        self.before = Rss(0, 0)
        self.peak = Rss(0, 0)
        self.after = Rss(0, 0)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def added_anon(self) -> int:
        """Peak anonymous memory above what the process held at the start."""
        return self.peak.anon - self.before.anon

    @property
    def added_file(self) -> int:
        """Peak file-backed memory above the start."""
        return self.peak.file - self.before.file

    def sample(self) -> None:
        """Take a sample now, besides the background thread's: where a caller knows its peak (a whole model
        built before sharding) it need not rely on the thread being scheduled at that moment."""
        now = rss()
        self.peak = Rss(max(self.peak.anon, now.anon), max(self.peak.file, now.file))

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            time.sleep(self.interval_s)

    def __enter__(self) -> PeakRss:
        self.before = self.peak = rss()
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="PeakRss", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        assert self._thread is not None
        self._thread.join()
        self.sample()
        self.after = rss()
