"""The run's data layout across attempts: the global batch a resume keeps, its accumulation, Lightning's progress
re-counted for it, and the attempts recorded (the launches are in test_resume_layouts_distributed.py)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from lightning.pytorch import Trainer

from lightning_fsdp_plus.app.layout import AttemptLog, plan_layout, rescale_progress
from lightning_fsdp_plus.app.train import USER_ERRORS
from lightning_fsdp_plus.sampler import LayoutError


def test_a_layout_that_cannot_keep_the_global_batch_is_refused_before_training():
    """What the app calls before ``fit`` (no process group yet): the checkpoint's global batch of 16 on 3 ranks; the
    app reports it as an ``Error:`` block with exit status 2."""
    trainer = Trainer(accelerator="cpu", devices=3, logger=False, enable_checkpointing=False)
    datamodule = SimpleNamespace(batch_size=8, global_batch_size=None)
    recorded = {"global_batch_size": 16, "world_size": 2, "micro_batch_size": 8, "accumulate_grad_batches": 1}
    said = r"global batch size 16 cannot be split over 3 ranks x micro-batch 8 \(24 samples a micro-step\); no"
    with pytest.raises(LayoutError, match=said + " micro-batch keeps it on 3 ranks: use a number of ranks"):
        plan_layout(trainer=trainer, datamodule=datamodule, recorded=recorded)
    assert issubclass(LayoutError, USER_ERRORS)


@pytest.mark.parametrize(("devices", "micro", "lowered", "accumulate"), [(4, 8, 4, 1), (1, 3, 2, 8), (2, 8, 8, 1)])
def test_a_micro_batch_that_does_not_divide_the_global_batch_is_lowered_with_a_warning(
    devices, micro, lowered, accumulate
):
    trainer = Trainer(accelerator="cpu", devices=devices, logger=False, enable_checkpointing=False)
    datamodule = SimpleNamespace(batch_size=micro, global_batch_size=None)
    recorded = {"global_batch_size": 16, "world_size": 2, "micro_batch_size": 8, "accumulate_grad_batches": 1}
    if lowered == micro:
        layout = plan_layout(trainer=trainer, datamodule=datamodule, recorded=recorded)
    else:
        with pytest.warns(UserWarning, match=f"data.batch_size={micro} is lowered to {lowered}: the global batch"):
            layout = plan_layout(trainer=trainer, datamodule=datamodule, recorded=recorded)
    assert layout == {"world_size": devices, "global_batch_size": 16, "micro_batch_size": lowered,
                      "accumulate_grad_batches": accumulate}  # fmt: skip
    assert datamodule.batch_size == lowered and trainer.accumulate_grad_batches == accumulate


def test_validation_every_n_optimizer_steps_stays_between_optimizer_steps_when_accumulating():
    trainer = Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, val_check_interval=3,
                      check_val_every_n_epoch=None)  # fmt: skip
    recorded = {"global_batch_size": 16, "world_size": 2, "micro_batch_size": 8, "accumulate_grad_batches": 1}
    plan_layout(trainer=trainer, datamodule=SimpleNamespace(batch_size=8, global_batch_size=None), recorded=recorded)
    assert trainer.accumulate_grad_batches == 2 and trainer.val_check_interval == 6  # every 3 optimizer steps


def test_a_fresh_layout_takes_the_trainers_accumulation_and_a_given_global_batch_wins():
    trainer = Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, accumulate_grad_batches=3)
    unset = SimpleNamespace(batch_size=8, global_batch_size=None)
    fresh = plan_layout(trainer=trainer, datamodule=unset, recorded=None)
    assert fresh == {"world_size": 1, "global_batch_size": 24, "micro_batch_size": 8, "accumulate_grad_batches": 3}
    recorded = {"global_batch_size": 16, "world_size": 2, "micro_batch_size": 8, "accumulate_grad_batches": 1}
    given = SimpleNamespace(batch_size=8, global_batch_size=32)
    assert plan_layout(trainer=trainer, datamodule=given, recorded=recorded)["accumulate_grad_batches"] == 4


def _checkpoint() -> dict:
    """Lightning's fit-loop state as a 2-rank run saved it after its 4th optimizer step (1 into its epoch)."""
    total = {"ready": 4, "completed": 3, "started": 4, "processed": 4}
    current = {"ready": 1, "completed": 0, "started": 1, "processed": 1}
    progress = {"total": total, "current": current, "is_last_batch": False}
    loader = {"_sampler_iter_yielded": 1, "_num_yielded": 1, "_sampler_iter_state": {"samples_yielded": 8}}
    return {"loops": {"fit_loop": {"epoch_loop.batch_progress": progress, "epoch_loop.state_dict":
                                   {"_batches_that_stepped": 3}, "state_dict": {"combined_loader": [loader]}}},
            "InstructionDataModule": {"global_batch_size": 16, "world_size": 2, "micro_batch_size": 8,
                                      "accumulate_grad_batches": 1}}  # fmt: skip


def test_lightnings_micro_batch_counts_are_recounted_for_the_new_accumulation():
    checkpoint = _checkpoint()
    rescale_progress(checkpoint, old_accumulate=1, new_accumulate=2)
    loop = checkpoint["loops"]["fit_loop"]
    progress = loop["epoch_loop.batch_progress"]
    # 4 optimizer steps are 8 micro-batches of 1 rank accumulating 2; the batch being finished is still one
    assert progress["total"] == {"ready": 8, "completed": 7, "started": 8, "processed": 8}
    assert progress["current"] == {"ready": 2, "completed": 1, "started": 2, "processed": 2}
    assert loop["epoch_loop.state_dict"] == {"_batches_that_stepped": 3}  # optimizer steps stay
    assert loop["state_dict"]["combined_loader"][0]["_num_yielded"] == 2
    back = _checkpoint()
    rescale_progress(back, old_accumulate=2, new_accumulate=2)
    assert back == _checkpoint()  # the same accumulation: nothing changes


def test_the_attempt_log_recounts_on_load_and_appends_each_attempt(tmp_path):
    layout = {"world_size": 1, "global_batch_size": 16, "micro_batch_size": 8, "accumulate_grad_batches": 2}
    log = AttemptLog(tmp_path, layout, resuming=True)
    checkpoint = _checkpoint()
    log.on_load_checkpoint(None, None, checkpoint)
    assert checkpoint["loops"]["fit_loop"]["epoch_loop.batch_progress"]["total"]["processed"] == 8
    (tmp_path / "attempts.json").write_text(json.dumps([{"attempt": 1, "start_step": 0, "world_size": 2}]))
    trainer = SimpleNamespace(global_step=4, is_global_zero=True, global_rank=0)
    log.on_train_start(trainer, None)
    log.on_train_end(trainer, None)
    attempts = json.loads((tmp_path / "attempts.json").read_text())
    assert attempts[1] == {"attempt": 2, "start_step": 4, **layout} and attempts[0]["world_size"] == 2
    other = SimpleNamespace(global_step=4, is_global_zero=False, global_rank=1)
    AttemptLog(tmp_path, layout, resuming=True).on_train_start(other, None)  # only rank 0 reads and writes it
    assert len(json.loads((tmp_path / "attempts.json").read_text())) == 2
    AttemptLog(tmp_path, layout, resuming=False).on_train_start(trainer, None)  # a fresh run starts the list anew
    assert [a["attempt"] for a in json.loads((tmp_path / "attempts.json").read_text())] == [1]
