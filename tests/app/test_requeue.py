"""``app/requeue.py`` in one process: which HPC checkpoint Lightning would load, retiring consumed ones, and the
requeued attempt that lost its run directory (the real SLURM runs are in tests/slurm/)."""

from __future__ import annotations

import pytest

from lightning_fsdp_plus.app.requeue import (
    CONSUMED_DIR,
    check_requeued_attempt,
    pending_hpc_checkpoint,
    read_base_metrics,
    retire_hpc_checkpoints,
    write_base_metrics,
)

SLURM = {"SLURM_NTASKS": "2", "SLURM_JOB_NAME": "finetune", "SLURM_JOB_ID": "41"}


@pytest.fixture
def on_slurm(monkeypatch):
    for key, value in SLURM.items():
        monkeypatch.setenv(key, value)


def test_the_newest_hpc_checkpoint_is_pending_on_slurm_only(tmp_path, on_slurm, monkeypatch):
    for name in ("hpc_ckpt_2.ckpt", "hpc_ckpt_10.ckpt", "hpc_ckpt_x.ckpt", "last.ckpt"):
        (tmp_path / name).write_text("")
    assert pending_hpc_checkpoint(tmp_path) == tmp_path / "hpc_ckpt_10.ckpt"  # by number, as Lightning picks
    monkeypatch.delenv("SLURM_NTASKS")
    assert pending_hpc_checkpoint(tmp_path) is None


def test_consumed_checkpoints_move_aside_with_their_sidecars(tmp_path, on_slurm):
    (tmp_path / "hpc_ckpt_1.ckpt").mkdir()  # a sharded one is a directory
    (tmp_path / "hpc_ckpt_2.ckpt").write_text("x")
    (tmp_path / "hpc_ckpt_2.ckpt.sha256").write_text("y")
    moved = retire_hpc_checkpoints(tmp_path)
    assert sorted(p.name for p in moved) == ["hpc_ckpt_1.ckpt", "hpc_ckpt_2.ckpt", "hpc_ckpt_2.ckpt.sha256"]
    assert pending_hpc_checkpoint(tmp_path) is None
    assert (tmp_path / CONSUMED_DIR / "hpc_ckpt_2.ckpt").read_text() == "x"


def test_the_base_metrics_survive_for_the_next_attempt(tmp_path):
    assert read_base_metrics(tmp_path) is None
    write_base_metrics(tmp_path, {"val_loss": 4.16, "val_perplexity": 64.07})
    assert read_base_metrics(tmp_path) == {"val_loss": 4.16, "val_perplexity": 64.07}


def test_a_requeued_attempt_with_nothing_to_resume_is_stopped_with_the_fix(tmp_path, on_slurm):
    environ = {**SLURM, "SLURM_RESTART_COUNT": "1"}
    with pytest.raises(ValueError, match=r"this is attempt 2 of SLURM job 41, but its run directory .* holds nothing"
                                         r".*hydra.run.dir=outputs/slurm/\$\{SLURM_JOB_ID\}"):  # fmt: skip
        check_requeued_attempt(tmp_path, ckpt_path=None, environ=environ)
    check_requeued_attempt(tmp_path, ckpt_path="last", environ=environ)  # the user said where to resume from
    check_requeued_attempt(tmp_path, ckpt_path=None, environ={**SLURM, "SLURM_RESTART_COUNT": "0"})  # first attempt
    (tmp_path / "hpc_ckpt_1.ckpt").write_text("")
    check_requeued_attempt(tmp_path, ckpt_path=None, environ=environ)  # Lightning resumes from it
