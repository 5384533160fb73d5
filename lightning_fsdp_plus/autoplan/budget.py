"""The per-device memory budget of the auto plan: a size ("40GiB", "24GB", bytes) or a fraction of the device.

A fraction means a share of the device's total memory: the GPU's (``torch.cuda.get_device_properties``), or on CPU
the host's physical memory divided among the ranks on the node (every rank's tensors live in the same RAM).
"""

from __future__ import annotations

import os
import re
from typing import Any

import torch

UNITS = {"B": 1, "KB": 10**3, "kB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
         "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}  # fmt: skip
"""The units a size may carry, spelt exactly so ("Gb" is gigabits to many, "1G" is ambiguous: both refused)."""
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*$")
_MEANING = (
    "a size (a number of bytes, or a number with one of B, KB, MB, GB, TB (powers of 1000) or KiB, MiB, GiB, TiB"
    " (powers of 1024): '40GiB', '24 GB', '512MiB') or a fraction of the device's memory (0 < f <= 1, or '90%')"
)


def check_budget(value: Any, *, key: str = "memory_budget") -> None:
    """Raise a ValueError naming ``key``, the value and the accepted forms unless ``value`` is a valid budget."""
    parse_budget(value, device_memory=1, key=key)


def parse_budget(value: Any, *, device_memory: int, key: str = "memory_budget") -> int:
    """Bytes per device: a size, or a fraction of ``device_memory``."""
    bad = ValueError(f"{key}={value!r} is not {_MEANING}")
    if isinstance(value, bool) or value is None:
        raise bad
    if isinstance(value, int):
        if value < 1:
            raise bad
        return value
    if isinstance(value, str) and value.strip().endswith("%"):
        try:
            value = float(value.strip()[:-1]) / 100
        except ValueError:
            raise bad from None
    if isinstance(value, str):
        match = _SIZE.match(value)
        if match is None or (match.group(2) and match.group(2) not in UNITS):
            raise bad
        number, unit = float(match.group(1)), match.group(2)
        if unit or "." not in match.group(1):
            size = int(number * UNITS.get(unit, 1))
            if size < 1:
                raise bad
            return size
        value = number
    if isinstance(value, float):
        if not 0.0 < value <= 1.0:
            raise bad
        return int(value * device_memory)
    raise bad


def device_memory(device: torch.device, *, ranks_per_node: int = 1) -> int:
    """Total bytes of ``device``: the GPU's memory, or on CPU the host's RAM divided by the node's ranks."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device.index or 0).total_memory
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return host // max(ranks_per_node, 1)


def format_bytes(value: float) -> str:
    """Bytes for people: GiB above 1 GiB, else MiB."""
    if abs(value) >= 2**30:
        return f"{value / 2**30:.2f} GiB"
    if abs(value) >= 2**20:
        return f"{value / 2**20:.1f} MiB"
    return f"{value / 2**10:.1f} KiB"
