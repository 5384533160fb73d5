"""A SLURM job that was requeued: what the app measures, trains and exports when it starts again.

On SLURM, Lightning's ``Trainer`` loads the newest ``hpc_ckpt_<N>.ckpt`` of ``default_root_dir`` (written when the job
was sent ``SIGUSR1``) for every ``fit``, ``validate``, ``test`` or ``predict`` called with ``ckpt_path=None``. Right for
the ``fit`` that resumes; wrong for the app's other two calls: the validation before training would measure the
checkpoint instead of the base, and the one after training would put the checkpoint's weights back over the trained
ones — the exported adapter was the checkpoint's (measured: the medical example requeued at step 12 of 60 ended
0.094 away from the uninterrupted run, val perplexity 6.89 instead of 3.62). So the base's figures are kept in the
run directory by the first attempt and read again, and once ``fit`` has finished the consumed HPC checkpoints move
to ``hpc_consumed/`` (kept, not deleted; not read by Lightning any more).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lightning.fabric.plugins.environments import SLURMEnvironment

BASE_METRICS_FILE = "base_metrics.json"
"""The validation before training, as the first attempt measured it (``{val_loss, val_perplexity}``)."""
CONSUMED_DIR = "hpc_consumed"
"""Where HPC checkpoints go once the ``fit`` that resumed from them has finished."""
_HPC = re.compile(r"^hpc_ckpt_(\d+)\.ckpt$")


def pending_hpc_checkpoint(run_dir: Path) -> Path | None:
    """The HPC checkpoint a ``ckpt_path=None`` call of Lightning's Trainer loads here (the newest), or None (not on
    SLURM, or none written)."""
    if not SLURMEnvironment.detect() or not run_dir.is_dir():
        return None
    found = [(int(m.group(1)), p) for p in run_dir.iterdir() if (m := _HPC.match(p.name))]
    return max(found)[1] if found else None


def _restarts(environ: Mapping[str, str]) -> int:
    """How often SLURM requeued this job (``SLURM_RESTART_COUNT``; 0 on the first attempt)."""
    return int(environ.get("SLURM_RESTART_COUNT", "0") or 0)


def check_requeued_attempt(run_dir: Path, *, ckpt_path: Any, environ: Mapping[str, str] = os.environ) -> None:
    """A requeued attempt (``SLURM_RESTART_COUNT`` > 0) whose run directory holds nothing of an earlier attempt
    would silently train from the start: Hydra gave it a new directory. Raise ``ValueError`` with the fix."""
    restarts = _restarts(environ)
    if restarts == 0 or ckpt_path is not None or not SLURMEnvironment.detect():
        return
    if pending_hpc_checkpoint(run_dir) is not None or (run_dir / "checkpoints").is_dir():
        return
    raise ValueError(
        f"this is attempt {restarts + 1} of SLURM job {environ.get('SLURM_JOB_ID')}, but its run directory {run_dir}"
        " holds nothing of the earlier attempt (Hydra gave this attempt a new one), so it would train from the"
        " start. Give every attempt the same run directory: hydra.run.dir=outputs/slurm/${SLURM_JOB_ID}"
        " (examples/slurm/finetune.sbatch does), or pass ckpt_path=<the earlier attempt's checkpoint>"
    )


def requeued_last_checkpoint(run_dir: Path, *, ckpt_path: Any, environ: Mapping[str, str] = os.environ) -> Path | None:
    """In a requeued attempt without an HPC checkpoint — stopped by SIGTERM (``scancel``, or SLURM ending the job
    when submitit requeues it on its own signal), which saves ``checkpoints/last.ckpt`` — the checkpoint to resume
    from; None otherwise (a first attempt, ``ckpt_path`` given, or Lightning's HPC resume applies)."""
    if _restarts(environ) == 0 or ckpt_path is not None:
        return None
    last = run_dir / "checkpoints" / "last.ckpt"
    return last if pending_hpc_checkpoint(run_dir) is None and last.exists() else None


def read_base_metrics(run_dir: Path) -> dict[str, Any] | None:
    """The first attempt's validation before training, or None when it did not get that far."""
    path = run_dir / BASE_METRICS_FILE
    return json.loads(path.read_text()) if path.is_file() else None


def write_base_metrics(run_dir: Path, metrics: dict[str, Any]) -> None:
    """Keep the validation before training for a later attempt (call on rank 0)."""
    (run_dir / BASE_METRICS_FILE).write_text(json.dumps({k: float(v) for k, v in metrics.items()}))


def retire_hpc_checkpoints(run_dir: Path) -> list[Path]:
    """Move every HPC checkpoint (and its ``.sha256`` sidecar) of ``run_dir`` into ``hpc_consumed/`` (call on rank 0,
    after ``fit`` finished); returns their new paths."""
    moved = []
    for path in sorted(run_dir.iterdir()):
        if not _HPC.match(path.name):
            continue
        target = run_dir / CONSUMED_DIR
        target.mkdir(exist_ok=True)
        for item in (path, path.with_name(path.name + ".sha256")):
            if item.exists():
                moved.append(item.rename(target / item.name))
    return moved
