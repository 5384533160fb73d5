"""The cluster tests need a real SLURM controller (``scripts/slurm_local.sh start``; ``scripts/test.sh`` starts one
when it runs as root). Without one they fail with the command to run; ``FSDP_PLUS_SKIP_SLURM=1`` skips them
explicitly (locally; never set in CI)."""

from __future__ import annotations

import os
import shutil
import subprocess
import time

import pytest


@pytest.fixture(scope="session")
def slurm() -> None:
    """A controller that answers, with its node idle or in use."""
    if os.environ.get("FSDP_PLUS_SKIP_SLURM") == "1":
        pytest.skip("FSDP_PLUS_SKIP_SLURM=1: the SLURM tests are skipped on request")
    deadline = time.monotonic() + 30  # a node still completing an earlier job ("comp") answers in a moment
    while (
        up := shutil.which("sinfo") is not None
        and subprocess.run(["sinfo", "-h", "-o", "%t"], capture_output=True, text=True).stdout.strip()
        in ("idle", "mix", "alloc")
    ) is False and time.monotonic() < deadline:
        time.sleep(1)
    assert up, "no SLURM controller answers: start one with `sudo bash scripts/slurm_local.sh start`"
