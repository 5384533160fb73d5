"""benchmarks/memory_trace.py: the peak of an allocation trace and what is alive at it, by operator."""

from __future__ import annotations

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.memory_trace import allocation_events, peak_breakdown, table


def test_the_peak_is_the_largest_running_total_and_lists_only_what_is_alive_then():
    # (time, ptr, size, total reported, label): a, b allocated, a freed, c allocated (peak 300), b and c freed
    events = [(1, 0xA, 100, 0, "forward / aten::add"), (2, 0xB, 150, 0, "forward / aten::mul"),
              (3, 0xA, -100, 0, ""), (4, 0xC, 150, 0, "MmBackward0 / aten::mm"), (5, 0xB, -150, 0, ""),
              (6, 0xC, -150, 0, ""), (0, 0xD, -40, 0, "")]  # fmt: skip
    result = peak_breakdown(events)
    assert result["peak_bytes"] == 260 and result["end_bytes"] == -40  # a tensor from before the window freed first
    assert result["peak_at"] == "MmBackward0 / aten::mm"
    assert result["alive_at_peak"] == [["forward / aten::mul", 150, 1], ["MmBackward0 / aten::mm", 150, 1]]
    assert result["alive_sizes"] == [[150, 2]]
    assert "| forward / aten::mul | 0.0 | 1 |" in table(result | {"step": 2})


def test_a_profiled_forward_and_backward_attributes_its_allocations():
    x = torch.randn(256, 256, requires_grad=True)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        y = (x @ x).relu()  # the product and the relu's output are saved for backward
        y.sum().backward()
    result = peak_breakdown(allocation_events(prof, device="cpu"))
    labels = {label for label, _, _ in result["alive_at_peak"]}
    assert result["peak_bytes"] >= 2 * 256 * 256 * 4  # at least the two saved activations at once
    assert any(label.startswith("forward / aten::") for label in labels)
    assert any(not label.startswith("forward") for label in labels)  # backward's temporaries
