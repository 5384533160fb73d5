"""Where a rank's resident memory goes, phase by phase (issue 32): tensors vs the allocator vs the rest.

A Lightning callback for any run (the Hydra app included:
``fsdp-plus-train ... +callbacks.phases._target_=benchmarks.memory_phases.PhaseMemory +callbacks.phases.out=DIR``).
At every phase boundary — set up (the model loaded and sharded), after the first forward, after its backward, after
the first optimizer step, after later steps, after validation, at the end — each rank records:

* ``RssAnon``: the process's own resident memory (``/proc/self/status``), and its peak since the previous boundary
  (sampled every 2 ms by :class:`~lightning_fsdp_plus.memory.rss.PeakRss`);
* glibc's view (``mallinfo2``): bytes in use by ``malloc`` (``uordblks`` + ``hblkhd``), bytes free but kept in its
  arenas (``fordblks``: retained, counted in RssAnon once touched), and the number of arenas' bytes (``arena``);
* the tensor-accounted sample of ``MemoryMonitor`` (parameters, gradients, optimizer state, saved activations).

Written as ``DIR/phases.rank<r>.json``; ``python -m benchmarks.memory_phases DIR`` prints the table.
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

from lightning.pytorch import Callback

from lightning_fsdp_plus.memory.accounting import model_state_bytes
from lightning_fsdp_plus.memory.rss import PeakRss, rss


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                     "fsmblks", "uordblks", "fordblks", "keepcost")]  # fmt: skip


def malloc_info() -> dict[str, int]:
    """glibc's ``mallinfo2()``: ``in_use`` (heap + mmapped chunks), ``free_retained`` (free bytes kept in the arenas),
    ``mmapped``, ``heap``; empty where glibc has no ``mallinfo2`` (musl, macOS, glibc < 2.33)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = _MallInfo2
        info = libc.mallinfo2()
    except (OSError, AttributeError):
        return {}
    return {"in_use": info.uordblks + info.hblkhd, "free_retained": info.fordblks, "mmapped": info.hblkhd,
            "heap": info.arena}  # fmt: skip


class PhaseMemory(Callback):
    """Records resident, allocator and tensor memory at each phase boundary (see the module docstring).

    Arguments:
        out: Directory for ``phases.rank<r>.json``.
    """

    def __init__(self, *, out: str = ".") -> None:
        self.out = Path(out)
        self.rows: list[dict[str, Any]] = []
        self._peak: PeakRss | None = None
        self._steps = 0

    def _boundary(self, trainer: Any, module: Any, phase: str, *, activations: int = 0) -> None:
        peak = 0
        if self._peak is not None:
            self._peak.__exit__()
            peak = self._peak.peak.anon
        optimizers = getattr(trainer, "optimizers", None) or []
        state = dataclasses.asdict(model_state_bytes(module, optimizers=optimizers))
        self.rows.append({"phase": phase, "rss_anon": rss().anon, "peak_anon_since_last": peak,
                          "tensors_model_state": sum(state.values()), **state, "activations": activations,
                          "malloc": malloc_info()})  # fmt: skip
        self._peak = PeakRss().__enter__()

    def setup(self, trainer: Any, module: Any, stage: str) -> None:
        self._boundary(trainer, module, f"before {stage} setup")

    def on_fit_start(self, trainer: Any, module: Any) -> None:
        self._boundary(trainer, module, "loaded and sharded")

    def on_before_backward(self, trainer: Any, module: Any, loss: Any) -> None:
        if self._steps < 2:
            self._boundary(trainer, module, f"step {self._steps}: after forward")

    def on_after_backward(self, trainer: Any, module: Any) -> None:
        if self._steps < 2:
            self._boundary(trainer, module, f"step {self._steps}: after backward")

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self._steps < 2:
            self._boundary(trainer, module, f"step {self._steps}: after optimizer step")
        self._steps += 1

    def on_validation_end(self, trainer: Any, module: Any) -> None:
        self._boundary(trainer, module, f"validation (after {self._steps} steps)")

    def on_fit_end(self, trainer: Any, module: Any) -> None:
        self._boundary(trainer, module, f"fit end ({self._steps} steps)")
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / f"phases.rank{trainer.global_rank}.json").write_text(json.dumps(self.rows, indent=1))


def table(rows: list[dict[str, Any]]) -> str:
    """The rows as a Markdown table in MiB."""
    mib = lambda b: f"{b / 2**20:,.0f}"  # noqa: E731
    lines = ["| phase | RssAnon | peak since last | tensors (model state) | malloc in use | malloc free, kept |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        m = r["malloc"]
        cells = [r["rss_anon"], r["peak_anon_since_last"], r["tensors_model_state"], m.get("in_use", 0),
                 m.get("free_retained", 0)]  # fmt: skip
        lines.append(f"| {r['phase']} | " + " | ".join(map(mib, cells)) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    for path in sorted(Path(sys.argv[1]).glob("phases.rank*.json")):
        print(f"{path.name}\n{table(json.loads(path.read_text()))}\n")
