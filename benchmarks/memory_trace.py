"""Which allocations make up a training step's peak (issue 32): torch's own allocation trace, attributed by op.

A Lightning callback for any run (the Hydra app included:
``fsdp-plus-train ... +callbacks.trace._target_=benchmarks.memory_trace.AllocationTrace +callbacks.trace.out=DIR``).
It records one training step (``step``, default the third: allocator and caches warm) with ``torch.profiler`` and
``profile_memory=True``: every allocation and free of torch's CPU (or CUDA) allocator, each with its size and the
operator that made it. From that trace it finds the moment the bytes allocated since the step began peak and
lists what is alive then, grouped by the operator that allocated it (inside which backward node or FSDP2 range):
the saved activations, the gathered parameters and the transients the tensor accounting of ``MemoryMonitor`` does
not see (an operator's output consumed a moment later, a dequantized weight, a gradient before reduce-scatter).

Written as ``DIR/trace.rank<r>.json``; ``python -m benchmarks.memory_trace DIR`` prints the table of rank 0.
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback
from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile

_CONTEXTS = ("autograd::engine::evaluate_function: ", "FSDP::")
"""Ranges that say where an operator ran: a backward node, an FSDP2 phase (Lightning runs forward and backward
inside ``Optimizer.step``'s range, so the optimizer is told by its ``_foreach`` operators instead)."""


def _walk(nodes: list[Any]) -> Iterator[Any]:
    stack = list(reversed(nodes))
    while stack:
        node = stack.pop()
        yield node
        stack.extend(reversed(node.children))


def _label(node: Any) -> str:
    """``<context> / <outermost operator>`` for an allocation event: the innermost backward node or FSDP2 range
    around it, else ``optimizer`` (a ``_foreach`` operator) or ``forward``."""
    op, context, parent = "", "", node.parent
    while parent is not None:
        name = parent.name
        if name.startswith("aten::"):
            op = name
        if not context and any(name.startswith(c) for c in _CONTEXTS):
            context = name.removeprefix("autograd::engine::evaluate_function: ")
        parent = parent.parent
    context = context or ("optimizer" if op.startswith("aten::_foreach") else "forward")
    return f"{context} / {op or 'outside an operator'}"


def peak_breakdown(events: list[tuple[int, int, int, int, str]]) -> dict[str, Any]:
    """From ``(time_ns, ptr, size, total_allocated, label)`` allocation events (negative size: a free), the peak of
    the bytes allocated since the window began (frees of older tensors count against it) and what the window
    allocated that is alive then, by label (bytes, count) and by size."""
    events = sorted(events)
    if not events:
        return {"events": 0}
    totals, running = [], 0  # bytes allocated since the window began (the CPU allocator reports no total)
    for event in events:
        running += event[2]
        totals.append(running)
    peak_index = max(range(len(events)), key=totals.__getitem__)
    live: dict[int, tuple[int, str]] = {}
    for _, ptr, size, _, label in events[: peak_index + 1]:
        if size > 0:
            live[ptr] = (size, label)
        else:
            live.pop(ptr, None)
    by_label: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    by_size: dict[int, int] = defaultdict(int)
    for size, label in live.values():
        by_label[label][0] += size
        by_label[label][1] += 1
        by_size[size] += 1
    return {
        "events": len(events),
        "peak_bytes": totals[peak_index],
        "end_bytes": totals[-1],
        "peak_at": events[peak_index][4],
        "alive_at_peak": sorted(([label, b, n] for label, (b, n) in by_label.items()), key=lambda r: -r[1]),
        "alive_sizes": sorted(([size, n] for size, n in by_size.items()), key=lambda r: -r[0] * r[1]),
    }


def allocation_events(prof: profile, *, device: str) -> list[tuple[int, int, int, int, str]]:
    """The profile's allocation events on ``device`` (``cpu`` or ``cuda``) as ``(time_ns, ptr, size, total, label)``."""
    tree = prof.profiler.kineto_results.experimental_event_tree()  # type: ignore[union-attr]
    out = []
    for node in _walk(tree):
        if node.tag != _EventType.Allocation:
            continue
        fields = node.extra_fields
        if fields.device.type != device:
            continue
        out.append((node.start_time_ns, fields.ptr, fields.alloc_size, fields.total_allocated, _label(node)))
    return out


class AllocationTrace(Callback):
    """Traces the allocations of training step ``step`` and writes their peak breakdown (module docstring).

    Arguments:
        out: Directory for ``trace.rank<r>.json``.
        step: The training step (0-based batch index of the fit) to trace.
    """

    def __init__(self, *, out: str = ".", step: int = 2) -> None:
        self.out, self.step = Path(out), step
        self._prof: profile | None = None
        self._batches = 0

    def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, batch_idx: int) -> None:
        if self._batches == self.step:
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
            self._prof = profile(activities=activities, profile_memory=True)
            self._prof.__enter__()

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self._batches += 1
        if self._prof is None:
            return
        self._prof.__exit__(None, None, None)
        device = "cuda" if trainer.strategy.root_device.type == "cuda" else "cpu"
        result = peak_breakdown(allocation_events(self._prof, device=device))
        self._prof = None
        self.out.mkdir(parents=True, exist_ok=True)
        result["step"] = self.step
        (self.out / f"trace.rank{trainer.global_rank}.json").write_text(json.dumps(result, indent=1))


def table(result: dict[str, Any], *, top: int = 15) -> str:
    """The peak breakdown as Markdown (MiB)."""
    mib = lambda b: f"{b / 2**20:,.1f}"  # noqa: E731
    lines = [f"step {result['step']}: allocated since the step began: peak {mib(result['peak_bytes'])} MiB (at"
             f" {result['peak_at']}), {mib(result['end_bytes'])} MiB at the end",
             "", "| allocated by (context / operator) | alive at the peak, MiB | tensors |",
             "|---|---|---|"]  # fmt: skip
    rows = result["alive_at_peak"]
    lines += [f"| {label} | {mib(b)} | {n} |" for label, b, n in rows[:top]]
    rest = rows[top:]
    if rest:
        lines.append(f"| {len(rest)} more | {mib(sum(r[1] for r in rest))} | {sum(r[2] for r in rest)} |")
    lines += ["", "| tensor size, MiB | alive at the peak |", "|---|---|"]
    lines += [f"| {mib(size)} | {n} |" for size, n in result["alive_sizes"][:10]]
    return "\n".join(lines)


if __name__ == "__main__":
    print(table(json.loads((Path(sys.argv[1]) / "trace.rank0.json").read_text())))
