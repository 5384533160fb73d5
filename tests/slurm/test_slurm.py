"""``examples/slurm/finetune.sbatch`` on a real one-node SLURM, 2 CPU tasks (issue 34): it runs to the end, a USR1
requeue resumes exactly, ``scancel`` stops every task with a resumable checkpoint, and a requeued attempt that lost
its run directory says how to keep it instead of starting over."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from tests.helpers.launch import REPO, subprocess_env

SBATCH = REPO / "examples" / "slurm" / "finetune.sbatch"
OVERRIDES = ("trainer.max_steps=20", "checkpoint.every_n_train_steps=5", "generate.num_prompts=0",
             "trainer.enable_progress_bar=false")  # fmt: skip
"""20 steps, a checkpoint every 5: a signal lands between the first checkpoint and the end, 15 steps to spare (the
test sends it when the first checkpoint appears; the ranks stop one step later)."""

EPOCH2 = ("trainer.max_steps=32", "checkpoint.every_n_train_steps=20", *OVERRIDES[2:])
"""The medical experiment is 19 steps an epoch (its 360 examples packed into 149 rows, a global batch of 8 rows, the
last one filled up): the first checkpoint, and the signal sent when it appears, fall inside the second epoch. 12
steps after that checkpoint, not 4: on a loaded machine the signal once arrived after the last step (step 24), and
the requeued attempt had nothing left to train."""

pytestmark = pytest.mark.usefixtures("slurm")


def submit(tmp: Path, name: str, *args: str, flags: tuple[str, ...] = (), script: Path = SBATCH) -> str:
    """``sbatch`` the script from the repository (its run directory under ``tmp``); the job id."""
    command = ["sbatch", "--parsable", f"--output={tmp / name}.log", f"--job-name={name}", *flags, str(script), *args]
    return subprocess.run(command, cwd=REPO, env=subprocess_env(), capture_output=True, text=True,
                          check=True).stdout.strip()  # fmt: skip


ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE")
"""Job states after which nothing runs again. A requeue passes through REQUEUED and PENDING, and squeue may not list
the job for a moment in between: the controller's record (kept MinJobAge=300 s) is read instead."""


def state(job: str) -> str:
    """The job's state in the controller (PENDING, RUNNING, REQUEUED, ..., or one of :data:`ENDED`); "" once it has
    ended (the tests' reading: nothing will run again)."""
    record = subprocess.run(["scontrol", "-o", "show", "job", job], capture_output=True, text=True).stdout
    found = record.split("JobState=")[1].split()[0] if "JobState=" in record else ""
    return "" if found in ENDED else found


SETTLE_S = 5.0
"""How long a requeued job stays PENDING before a test releases it. Released at once, slurmctld can allocate it
while the previous attempt's credential is still being revoked, and it kills the new attempt ("Killing
non-startable batch JobId=25: Job credential revoked", seen 0.24 s after a requeue)."""
_PENDING_SINCE: dict[str, float] = {}


def release_if_pending(job: str) -> None:
    """A requeued job waits ~2 min (BeginTime): release it once it has been PENDING for :data:`SETTLE_S`."""
    if state(job) != "PENDING":
        _PENDING_SINCE.pop(job, None)
        return
    since = _PENDING_SINCE.setdefault(job, time.monotonic())
    if time.monotonic() - since >= SETTLE_S:
        subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], capture_output=True)


def wait_gone(job: str, timeout: float = 300) -> float:
    """Wait until the job has left the queue (requeued attempts released, :func:`release_if_pending`); the seconds
    it took."""
    start = time.monotonic()
    while state(job):
        release_if_pending(job)
        assert time.monotonic() - start < timeout, f"job {job} still {state(job)} after {timeout} s"
        time.sleep(0.5)
    return time.monotonic() - start


def wait_for(path: Path, job: str, timeout: float = 180) -> None:
    start = time.monotonic()
    while not path.exists():
        assert state(job), f"job {job} ended before {path} appeared"
        assert time.monotonic() - start < timeout, f"{path} did not appear in {timeout} s"
        time.sleep(0.1)


def run_dir(tmp: Path, name: str) -> str:
    return f"hydra.run.dir={tmp / name}"


def adapter(path: Path) -> dict:
    return load_file(path / "adapter" / "adapter_model.safetensors")


def test_finetune_sbatch_runs_and_a_usr1_requeue_resumes_exactly(tmp_path):
    """a) the sbatch example at world size 2 writes metrics.json; b) the same job sent USR1 after its first checkpoint,
    inside its second epoch: every rank stops after one step, the HPC checkpoint is written, the job requeued,
    resumed from it (the log says so), and its LoRA weights equal the uninterrupted run's bit for bit; c) requeued
    onto one task instead, it keeps the global batch and ends within 1e-5 of the uninterrupted run."""
    whole = submit(tmp_path, "whole", *EPOCH2, run_dir(tmp_path, "whole"))
    wait_gone(whole)
    metrics = json.loads((tmp_path / "whole" / "metrics.json").read_text())
    assert metrics["world_size"] == 2 and metrics["val_perplexity"] < metrics["base_val_perplexity"]

    job = submit(tmp_path, "requeued", *EPOCH2, run_dir(tmp_path, "requeued"))
    wait_for(tmp_path / "requeued" / "checkpoints" / "last.ckpt", job)
    subprocess.run(["scancel", "--signal=USR1", job], check=True)
    wait_gone(job)
    log = (tmp_path / "requeued.log").read_text()
    assert "SIGUSR1 received; every rank stopped after step" in log
    assert "attempt 2 of job" in log
    assert f"requeued SLURM job: resuming from {tmp_path / 'requeued' / 'hpc_ckpt_1.ckpt'}" in log
    assert f"Restored all states from the checkpoint at {tmp_path / 'requeued' / 'hpc_ckpt_1.ckpt'}" in log
    resumed = json.loads((tmp_path / "requeued" / "metrics.json").read_text())
    assert resumed["base_val_perplexity"] == pytest.approx(metrics["base_val_perplexity"])  # the first attempt's
    assert resumed["val_perplexity"] == metrics["val_perplexity"]
    expected, got = adapter(tmp_path / "whole"), adapter(tmp_path / "requeued")
    assert all((expected[k] == got[k]).all() for k in expected)
    assert (tmp_path / "requeued" / "hpc_consumed" / "hpc_ckpt_1.ckpt").exists()  # kept, no longer reloaded
    attempts = json.loads((tmp_path / "requeued" / "attempts.json").read_text())
    assert len(attempts) == 2 and attempts[1]["start_step"] > 19  # resumed inside the second epoch

    # c) requeued onto 1 task (NumTasks and NumCPUs updated while it is pending): the same global batches, 2 micro-steps
    job = submit(tmp_path, "one_task", *EPOCH2, run_dir(tmp_path, "one_task"))
    wait_for(tmp_path / "one_task" / "checkpoints" / "last.ckpt", job)
    subprocess.run(["scancel", "--signal=USR1", job], check=True)
    while state(job) != "PENDING":
        assert state(job), "the job ended instead of being requeued"
        time.sleep(0.2)
    subprocess.run(["scontrol", "update", f"JobId={job}", "NumTasks=1", "NumCPUs=1"], check=True)
    wait_gone(job)
    attempts = json.loads((tmp_path / "one_task" / "attempts.json").read_text())
    assert [(a["world_size"], a["accumulate_grad_batches"], a["global_batch_size"]) for a in attempts] == [
        (2, 1, 8), (1, 2, 8)]  # fmt: skip
    got = adapter(tmp_path / "one_task")
    assert max((expected[k].float() - got[k].float()).abs().max().item() for k in expected) <= 1e-5
    assert "resuming on 1 ranks (micro-batch 4, accumulating 2)" in (tmp_path / "one_task.log").read_text()


def test_scancel_stops_every_task_within_60_s_with_a_resumable_last_checkpoint(tmp_path):
    """c) ``scancel`` (SIGTERM, no requeue): every task gone within 60 s, ``last.ckpt`` written at the step they
    stopped after; ``ckpt_path=last`` in the same run directory resumes it and finishes."""
    job = submit(tmp_path, "cancelled", *OVERRIDES, run_dir(tmp_path, "cancelled"), flags=("--no-requeue",))
    wait_for(tmp_path / "cancelled" / "checkpoints" / "last.ckpt", job)
    subprocess.run(["scancel", job], check=True)
    assert wait_gone(job) < 60
    log = (tmp_path / "cancelled.log").read_text()
    assert "SIGTERM received; every rank stopped after step" in log
    step = int(log.split("SIGTERM received; every rank stopped after step")[1].split(";")[0])
    assert 5 <= step < 20
    resumed = submit(tmp_path, "resumed", *OVERRIDES, run_dir(tmp_path, "cancelled"), "ckpt_path=last")
    wait_gone(resumed)
    assert f"Restored all states from the checkpoint at {tmp_path / 'cancelled' / 'checkpoints' / 'last.ckpt'}" in (
        (tmp_path / "resumed.log").read_text()
    )
    assert json.loads((tmp_path / "cancelled" / "metrics.json").read_text())["world_size"] == 2


def test_a_requeued_attempt_in_a_new_run_directory_fails_with_how_to_keep_it(tmp_path):
    """f) ``srun fsdp-plus-train`` without a fixed run directory: Hydra gives the requeued attempt a new timestamped
    one, which holds nothing to resume. It stops with the fix instead of silently training from the start. The job
    works in its own directory, not the repository's: the experiment finds its shipped model and data from there."""
    script = tmp_path / "plain.sbatch"
    script.write_text(
        "#!/usr/bin/env bash\n#SBATCH --ntasks-per-node=2\n#SBATCH --requeue\n#SBATCH --open-mode=append\n"
        f"cd {tmp_path}\nsrun {REPO}/scripts/run fsdp-plus-train experiment=medical_lora {' '.join(OVERRIDES)}"
        f" hydra.run.dir={tmp_path}/runs/\\${{now:%H-%M-%S-%f}}\n"
    )
    job = submit(tmp_path, "plain", script=script)
    while not list((tmp_path / "runs").glob("*/checkpoints/last.ckpt")):
        assert state(job), "the job ended before its first checkpoint"
        time.sleep(0.1)
    subprocess.run(["scancel", "--signal=USR1", job], check=True)
    wait_gone(job)
    log = (tmp_path / "plain.log").read_text()
    assert "is attempt 2 of SLURM job" in log and "its run directory" in log
    assert "hydra.run.dir=outputs/slurm/${SLURM_JOB_ID}" in log
    runs = list((tmp_path / "runs").iterdir())  # each attempt's, one per rank here (the timestamp has microseconds)
    first = [d for d in runs if (d / "checkpoints").is_dir()]
    second = [d for d in runs if d not in first]
    assert first and second and not any((d / "metrics.json").exists() for d in second)  # it trained nothing


def test_a_time_limit_ends_in_a_requeue_not_a_kill(tmp_path):
    """d) ``--time=2 --signal=USR1@60`` (the shortest limit; SLURM sends the signal up to 60 s early: 38 s after the
    start here): the job is requeued with its HPC checkpoint and the next attempt resumes from it; then ``scancel``
    ends it."""
    log = tmp_path / "limited.log"
    idle = ("+callbacks.record._target_=tests.helpers.ckpt_cases.Record", f"+callbacks.record.out={tmp_path}",
            "+callbacks.record.name=limited", "+callbacks.record.step_sleep=1")  # fmt: skip
    # a step a second while it waits for the limit: the minute in between leaves the cores to the other tests
    job = submit(tmp_path, "limited", "trainer.max_steps=100000", *OVERRIDES[1:], *idle, run_dir(tmp_path, "limited"),
                 flags=("--time=2", "--signal=USR1@60"))  # fmt: skip
    start = time.monotonic()
    while "Restored all states from the checkpoint" not in (log.read_text() if log.exists() else ""):
        assert time.monotonic() - start < 240, "no requeued attempt resumed within 4 minutes"
        release_if_pending(job)
        time.sleep(0.5)
    subprocess.run(["scancel", job], check=True)
    wait_gone(job)
    text = log.read_text()
    assert "SIGUSR1 received; every rank stopped after step" in text and "attempt 2 of job" in text
    assert f"resuming from {tmp_path / 'limited' / 'hpc_ckpt_1.ckpt'}" in text
    assert "DUE TO TIME LIMIT" not in text


def test_the_submitit_sweep_runs_every_job_on_slurm_and_a_preempted_job_resumes(tmp_path):
    """e) ``examples/slurm/sweep.sh``: Hydra's submitit launcher submits both jobs (2 tasks each, world size 2); each
    writes metrics.json and the sweep summary lists both. The first job is sent submitit's preemption signal
    (SIGUSR2) after its first checkpoint: its ranks stop after one step and save ``last.ckpt`` before submitit
    requeues it; the next attempt resumes from that checkpoint in the same job directory, and nothing is recorded as
    a failure."""
    sweep, name = tmp_path / "sweep", f"sweep{tmp_path.name[-12:]}"
    command = ["bash", "examples/slurm/sweep.sh", "trainer.max_steps=20", "checkpoint.every_n_train_steps=10",
               "generate.num_prompts=0", "trainer.enable_progress_bar=false", f"hydra.sweep.dir={sweep}",
               f"hydra.launcher.name={name}", "hydra.launcher.array_parallelism=1"]  # fmt: skip
    # one job at a time: two would share the 2 cores (4 ranks, 4 job processes: 259 s instead of ~120 s)
    proc = subprocess.Popen(command, cwd=REPO, env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)  # fmt: skip
    start = time.monotonic()
    while not list(sweep.glob("0_*/checkpoints/last.ckpt")):
        assert proc.poll() is None, proc.stdout.read()[-4000:] if proc.stdout else ""
        assert time.monotonic() - start < 240, "the first sweep job wrote no checkpoint in 4 minutes"
        time.sleep(0.1)
    running = subprocess.run(["squeue", "-h", "-n", name, "-t", "RUNNING", "-o", "%i"], capture_output=True,
                             text=True).stdout.split()  # fmt: skip
    first = [job for job in running if job.endswith("_0")]  # the array's task 0 is the sweep's job 0
    assert len(first) == 1, running
    subprocess.run(["scancel", "--signal=USR2", first[0]], check=True)
    while proc.poll() is None:
        pending = subprocess.run(["squeue", "-h", "-n", name, "-t", "PENDING", "-o", "%i"], capture_output=True,
                                 text=True).stdout.split()  # fmt: skip
        for job in pending:
            release_if_pending(job)
        assert time.monotonic() - start < 600, "the sweep did not end in 10 minutes"
        time.sleep(0.5)
    output = proc.stdout.read() if proc.stdout else ""
    assert proc.returncode == 0, output[-4000:]
    jobs = sorted(p for p in sweep.iterdir() if (p / "metrics.json").exists())
    assert [p.name.split("strategy=")[1] for p in jobs] == ["lora_int8_replicated", "lora_int8_sharded"]
    assert all(json.loads((p / "metrics.json").read_text())["world_size"] == 2 for p in jobs)
    summary = (sweep / "sweep_summary.csv").read_text()
    assert "lora_int8_replicated" in summary and "lora_int8_sharded" in summary
    log = (jobs[0] / "train.log").read_text()
    step = int(log.split("SIGUSR2 received; every rank stopped after step")[1].split(";")[0])
    assert 10 <= step < 20
    assert log.index("Caught signal SIGUSR2") > log.index("SIGUSR2 received; every rank stopped")  # saved first
    assert f"requeued SLURM job: resuming from {jobs[0] / 'checkpoints' / 'last.ckpt'}" in log
    assert f"Restored all states from the checkpoint at {jobs[0] / 'checkpoints' / 'last.ckpt'}" in log
    assert "Requeued job" in log and not any((p / "failed.txt").exists() for p in jobs)
