"""Launching ``ckpt_cases.py`` from tests and reading what its runs leave behind."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import torch

from tests.helpers.launch import REPO, failure_excerpt, run_script

SCRIPT = REPO / "tests" / "helpers" / "ckpt_cases.py"


def launch(out: Path, scenario: str, *args: str) -> str:
    """One run of ``ckpt_cases.py`` that is to finish; its output (AssertionError when it fails).

    Two ranks start together under ``torchrun`` (both import at once: seconds sooner than Lightning's launcher,
    which starts rank 1 only when rank 0 reaches ``fit``; the results are the same, see
    ``test_other_launchers_give_the_same_result``); ``--devices 1`` runs one plain process. Runs that are stopped
    on purpose (signals, kill -9, a crash) start with Lightning's launcher, whose semantics they test.
    """
    devices = int(args[args.index("--devices") + 1]) if "--devices" in args else 2
    torchrun = devices if devices > 1 else None
    return run_script(SCRIPT, "--out", str(out), "--scenario", scenario, *args, torchrun=torchrun)


def result(out: Path, scenario: str) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
    """A finished run's per-step global losses and final full state dict."""
    losses = json.loads((out / f"{scenario}.rank0.json").read_text())["losses"]
    return losses, torch.load(out / f"{scenario}.pt", weights_only=True)


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """The largest absolute difference between two state dicts with the same keys."""
    return max((a[k] - b[k]).abs().max().item() for k in a)


def wait_for(
    path: Path, *, step: int, timeout: float, proc: subprocess.Popen | None = None, log: Path | None = None
) -> None:
    """Wait until a run's progress file says ``step`` (or later); fail at once, with the run's output, when ``proc``
    has already ended (a run that died before the step never writes it)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if path.is_file() and path.read_text().strip() and int(path.read_text()) >= step:
            return
        if proc is not None and proc.poll() is not None:
            output = log.read_text() if log is not None and log.is_file() else ""
            raise RuntimeError(f"the run ended ({proc.returncode}) before {path} said step {step}:\n"
                               + failure_excerpt(output))  # fmt: skip
        time.sleep(0.1)
    raise TimeoutError(f"{path} never reached step {step}")
