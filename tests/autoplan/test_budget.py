"""Memory budgets: sizes in both unit systems, fractions of the device, and clear refusals."""

from __future__ import annotations

import re

import pytest
import torch

from lightning_fsdp_plus.autoplan.budget import device_memory, format_bytes, parse_budget


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("40GiB", 40 * 2**30),
        ("24GB", 24 * 10**9),
        ("1.5 GiB", int(1.5 * 2**30)),
        ("2 kB", 2000),
        ("7B", 7),
        ("512MiB", 512 * 2**20),
        ("3000", 3000),
        (123456, 123456),
        (0.5, 500),
        ("0.25", 250),
        ("90%", 900),
    ],
)
def test_sizes_and_fractions(value, expected):
    assert parse_budget(value, device_memory=1000) == expected


@pytest.mark.parametrize(
    "value", ["lots", "40 GiBs", "-1GB", 0, 0.0, 1.01, "150%", True, None, [1], "1 Gb", "1gb", "1G", "1.5 gib"]
)
def test_refusals_name_the_key_the_value_and_the_accepted_units(value):
    """Only the exact unit spellings: "1 Gb" was read as 1e9 bytes (953.7 MiB) though many mean gigabits by it."""
    forms = r"a number of bytes, or a number with one of B, KB, MB, GB, TB .* KiB, MiB, GiB, TiB .*fraction"
    with pytest.raises(ValueError, match=rf"memory_budget={re.escape(repr(value))} is not a size \({forms}"):
        parse_budget(value, device_memory=1000)


def test_cpu_device_memory_is_the_host_ram_shared_by_the_node_ranks():
    whole = device_memory(torch.device("cpu"))
    assert whole > 2**30 and device_memory(torch.device("cpu"), ranks_per_node=4) == whole // 4


def test_bytes_for_people():
    assert (format_bytes(3 * 2**30), format_bytes(1536 * 2**10), format_bytes(2048)) == (
        "3.00 GiB",
        "1.5 MiB",
        "2.0 KiB",
    )
