"""An exception on one rank only ends every rank within seconds, and the user sees that rank's error.

Real 2-process runs under Lightning's own launcher: the plain Trainer script ``tests/helpers/fault_run.py`` (with a
``MemoryMonitor``, clipping, a CSV logger, validation and checkpoints) fails on rank 1 inside a unit's forward,
inside a unit's backward (rank 0 then waits in its reduce-scatter), before the optimizer step, in validation, while
a checkpoint is saved, and in the first step after a resume; the Hydra app fails on rank 1 inside backward. Before,
a failing rank's exception path ran a collective (``trainer.log_dir``'s broadcast) against the other rank's FSDP
collective and both hung for the collective timeout (10 minutes), the real error never shown.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers.launch import REPO, failure_excerpt, subprocess_env

FAULT_RUN = REPO / "tests" / "helpers" / "fault_run.py"
DEADLINE_S = 30
"""Every rank must be gone this many seconds after the injected error."""


def all_gone_after_injection(out: Path) -> float:
    """Seconds from the injected error until every rank's process had ended (polls the recorded pids)."""
    injected = json.loads((out / "injected.json").read_text())["time"]
    pids = [int((out / f"pid.rank{r}").read_text()) for r in (0, 1)]
    while any(_alive(pid) for pid in pids) and time.time() - injected < DEADLINE_S + 5:
        time.sleep(0.2)
    assert not any(_alive(pid) for pid in pids), f"a rank outlived the failure by {DEADLINE_S + 5} s"
    return time.time() - injected


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").is_file() and Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


POINTS = [(where, 1) for where in ("forward", "backward", "optimizer", "validation", "checkpoint", "resumed")]
POINTS.append(("backward", 0))  # rank 0: Lightning's launcher process, and the store's host


@pytest.mark.parametrize(("where", "failing"), POINTS)
def test_one_rank_failing_in_a_plain_trainer_script_ends_every_rank_with_its_message(tmp_path, where, failing):
    command = [sys.executable, str(FAULT_RUN), "--where", where, "--rank", str(failing), "--out", str(tmp_path)]
    proc = subprocess.run(command, cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=180)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0 and (tmp_path / "injected.json").is_file(), failure_excerpt(output)
    seconds = all_gone_after_injection(tmp_path)
    assert seconds < DEADLINE_S, f"ranks still running {seconds:.0f} s after the failure:\n{failure_excerpt(output)}"
    message = f"injected failure at {where} on rank {failing}"
    assert f"InjectedFailure: {message}" in output  # the failing rank's own traceback, on the console
    assert f"rank {failing} failed first: InjectedFailure: {message}; rank {1 - failing} stopped because" in output
    assert "Timed out" not in output


def test_a_rank_busy_outside_any_collective_is_ended_by_its_watch(tmp_path):
    """Rank 0 fails at the start of a step while rank 1 sleeps outside any collective (slow I/O, a hang: what NCCL
    can leave a rank doing until its timeout). No collective can fail there, and Lightning's launcher watches its
    children only from rank 0, which is gone: rank 1's watch reads rank 0's failure from the store, shows where its
    threads are and ends the process after its grace period."""
    from lightning_fsdp_plus.failures import GRACE_S

    command = [sys.executable, str(FAULT_RUN), "--where", "batch_start", "--rank", "0", "--stall", "600", "--out",
               str(tmp_path)]  # fmt: skip
    proc = subprocess.run(command, cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=180)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0 and (tmp_path / "injected.json").is_file(), failure_excerpt(output)
    seconds = all_gone_after_injection(tmp_path)
    assert GRACE_S <= seconds < DEADLINE_S, f"{seconds:.1f} s:\n{failure_excerpt(output)}"
    assert "rank 0 failed first: InjectedFailure: injected failure at batch_start on rank 0" in output
    assert f"[rank 1] still running {GRACE_S:g} s later; where its threads are:" in output
    assert "in on_train_batch_start" in output  # faulthandler's dump: the sleeping callback


def test_one_rank_failing_in_the_app_writes_its_traceback_to_failed_txt_and_every_rank_ends(tmp_path):
    run_dir = tmp_path / "run"
    env = {**subprocess_env(), "FAULT_OUT": str(tmp_path)}
    fault = ["+callbacks.fault._target_=tests.helpers.faults.FailOnRank", "+callbacks.fault.where=backward"]
    args = ["experiment=medical_lora", "trainer.max_steps=4", "trainer.enable_progress_bar=false",
            "validate_before=false", "generate.num_prompts=0", *fault, f"hydra.run.dir={run_dir}"]  # fmt: skip
    proc = subprocess.run([str(Path(sys.executable).with_name("fsdp-plus-train")), *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=180)  # fmt: skip
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0 and (tmp_path / "injected.json").is_file(), failure_excerpt(output)
    seconds = all_gone_after_injection(tmp_path)
    assert seconds < DEADLINE_S, f"ranks still running {seconds:.0f} s after the failure:\n{failure_excerpt(output)}"
    message = "InjectedFailure: injected failure at backward on rank 1"
    failed = (run_dir / "failed.txt").read_text()
    assert failed.startswith(f"the run failed on rank 1: {message}") and "Traceback (most recent call last)" in failed
    assert "rank 0 stopped because of it" in failed  # the other rank's own error follows, never replaces it
    assert message in (run_dir / "train_ddp_process_1.log").read_text()  # the failing rank's log
    # each rank's traceback on the console once (Hydra's); the app's failure record goes to the files only
    assert output.count("Traceback (most recent call last)") == 2, failure_excerpt(output)
    assert f"rank 1 failed first: {message}" in (run_dir / "train.log").read_text()  # rank 0's log
    assert message in output and "Timed out" not in output
    assert list(run_dir.glob("**/memory_summary.exception.rank1.txt"))  # the monitor's summary, written locally
