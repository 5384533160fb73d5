"""Run a script on several CPU processes from a test, the way users launch training.

Multi-process tests never call ``Trainer(devices=2).fit`` inside pytest: Lightning's launcher would re-run
pytest for rank 1. They run a script instead, batching many cases into one launch to pay start-up once.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def subprocess_env() -> dict[str, str]:
    """The environment for launched scripts.

    Repository importable, one OpenMP thread, faulthandler on, no stale rank.
    """
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH", "")]))
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("PYTHONFAULTHANDLER", "1")  # a rank that aborts prints every thread's Python stack
    env.pop("LOCAL_RANK", None)  # a stale value would make Lightning think the ranks already exist
    return env


def run_script(script: str | Path, *args: str, torchrun: int | None = None, timeout: float = 600) -> str:
    """Run ``script`` (with Lightning's own launcher, or under ``torchrun --nproc_per_node N``).

    Returns the combined output; when the run fails, raises AssertionError with :func:`failure_excerpt`.
    """
    command = [sys.executable, str(script), *args]
    if torchrun:
        command = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={torchrun}",
                   "--standalone", str(script), *args]  # fmt: skip
    proc = subprocess.run(command, cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=timeout)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{' '.join(command)} failed ({proc.returncode}):\n{failure_excerpt(output)}"
    return output


FAILURE_MARKERS = ("Traceback (most recent call last)", "Fatal Python error", "terminate called")
"""How a failing rank announces itself: a Python traceback, faulthandler's dump, a C++ abort."""


def failure_excerpt(output: str, *, chars: int = 6000) -> str:
    """The first failure (where a rank went wrong first) and the output's tail (how the launch ended)."""
    starts = [i for i in (output.find(marker) for marker in FAILURE_MARKERS) if i >= 0]
    first = min(starts, default=-1)
    if first < 0 or first >= len(output) - chars:
        return output[-chars:]
    return f"{output[first : first + chars]}\n[...]\n{output[-chars:]}"


def assert_case_passed(out: Path, output: str, name: str, *, ranks: int = 2) -> None:
    """A batched launch's case ``name`` ran on every rank and passed (its ``OUT/<name>.rank<r>.json`` says so)."""
    import json

    for rank in range(ranks):
        result = out / f"{name}.rank{rank}.json"
        assert result.is_file(), (
            f"{name} did not run on rank {rank} (an earlier case failed):\n{failure_excerpt(output)}"
        )
        record = json.loads(result.read_text())
        assert record["ok"], f"rank {rank}:\n{record['error']}"
