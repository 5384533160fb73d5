"""What each system's run records, the same way for all: per-step time, useful tokens, batch digests, memory.

A :class:`Recorder` is made at the top of every worker process, before the model is loaded (its resident memory then
is the baseline); the system calls :meth:`Recorder.batch` with each micro-batch its model is given and
:meth:`Recorder.step_end` after each optimizer step; :meth:`Recorder.write` saves ``rank<R>.json`` in the run
directory. The driver merges the ranks (:func:`merge`).
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.peers.plan import digest, target_tokens


def rss_bytes() -> int:
    """This process's resident memory now."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def versions(*names: str) -> dict[str, str]:
    """Installed versions of ``names`` (``"-"`` for one that is missing)."""
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for name in names:
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            found[name] = "-"
    return found


class Recorder:
    """One rank's measurements of one run."""

    def __init__(self, *, out: str | Path, rank: int) -> None:
        self.out, self.rank = Path(out), rank
        self.baseline = rss_bytes()
        self.digests: list[str] = []
        self.tokens: list[int] = []
        self.step_ends: list[float] = []
        self.started = time.perf_counter()
        self._pending_tokens = 0

    def batch(self, batch: dict[str, torch.Tensor]) -> None:
        """A micro-batch this rank's model is given (``input_ids``, ``attention_mask``, ``labels``)."""
        self.digests.append(digest(batch["input_ids"], batch.get("attention_mask")))
        self._pending_tokens += target_tokens(batch["labels"])

    def step_end(self) -> None:
        """An optimizer step finished."""
        self.step_ends.append(time.perf_counter())
        self.tokens.append(self._pending_tokens)
        self._pending_tokens = 0

    def write(self, **extra: Any) -> dict[str, Any]:
        """Save this rank's record (``rank<R>.json``) and return it."""
        record = {
            "rank": self.rank,
            "digests": self.digests,
            "tokens_per_step": self.tokens,
            "step_s": [b - a for a, b in zip([self.started, *self.step_ends], self.step_ends, strict=False)],
            "peak_rss_added_mb": (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - self.baseline) / 2**20,
            **extra,
        }
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / f"rank{self.rank}.json").write_text(json.dumps(record))
        return record


def merge(run_dir: Path, *, warmup: int) -> dict[str, Any]:
    """A run from its ranks' records: steps, the median steady step time, useful tokens/s per rank over the steady
    steps (after ``warmup``), the highest peak memory added over the ranks, and every rank's digests."""
    ranks = [json.loads(p.read_text()) for p in sorted(run_dir.glob("rank*.json"))]
    steps = min(len(r["step_s"]) for r in ranks)
    # a step ends when the slowest rank's optimizer step ends: the step time is the ranks' longest
    step_s = [max(r["step_s"][i] for r in ranks) for i in range(steps)]
    steady = range(warmup, steps)
    tokens = sum(r["tokens_per_step"][i] for r in ranks for i in steady)
    return {
        "steps": steps,
        "step_s_median": statistics.median(step_s[i] for i in steady),
        "useful_tokens_per_s": tokens / len(ranks) / sum(step_s[i] for i in steady),
        "peak_rss_added_mb": max(r["peak_rss_added_mb"] for r in ranks),
        "digests": {str(r["rank"]): r["digests"] for r in ranks},
        "step_s": step_s,
    }
