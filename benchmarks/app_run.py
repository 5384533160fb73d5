"""One run of the Hydra app as users start it (``scripts/run fsdp-plus-train``: tcmalloc preloaded), for the
benchmarks that measure whole runs."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def run_train(overrides: list[str], *, out: Path, timeout: float = 1800) -> dict[str, Any]:
    """Run ``fsdp-plus-train`` with ``overrides`` in the run directory ``out`` (``hydra.run.dir``); its console goes
    to ``out/console.txt``. Returns the run's ``metrics.json``; a failed run raises naming that file."""
    out.mkdir(parents=True, exist_ok=True)  # the console has somewhere to go even if the app fails before Hydra
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([str(REPO / "scripts" / "run"), "fsdp-plus-train", *overrides, f"hydra.run.dir={out}"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)  # fmt: skip
    (out / "console.txt").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise RuntimeError(f"run {out} failed ({proc.returncode}); see {out / 'console.txt'}")
    return json.loads((out / "metrics.json").read_text())
