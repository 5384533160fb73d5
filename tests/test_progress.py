"""The app's progress bar labels step-limited runs without Lightning's "Epoch 0/-2"."""

from __future__ import annotations

import pytest
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import RichProgressBar
from lightning.pytorch.demos.boring_classes import BoringModel

from lightning_fsdp_plus.app.progress import StepAwareRichProgressBar, train_description


class Capture(StepAwareRichProgressBar):
    def on_train_batch_end(self, trainer, *args, **kwargs) -> None:
        super().on_train_batch_end(trainer, *args, **kwargs)
        self.seen = self.progress.tasks[self.train_progress_bar_id].description


def _fit(bar, **limits) -> str:
    trainer = Trainer(accelerator="cpu", devices=1, callbacks=[bar], logger=False, enable_checkpointing=False,
                      enable_model_summary=False, limit_val_batches=0, limit_train_batches=2, **limits)  # fmt: skip
    trainer.fit(BoringModel())
    return bar.seen.strip()


@pytest.mark.parametrize(
    ("limits", "expected"),
    [({"max_steps": 3}, "Epoch 1 · max_steps 3"), ({"max_epochs": 2}, "Epoch 1/1"),
     ({"max_epochs": 2, "max_steps": 3}, "Epoch 1/1 · max_steps 3")],
)  # fmt: skip
def test_training_label_in_a_real_fit(limits, expected):
    assert _fit(Capture(), **limits) == expected


def test_lightnings_own_bar_is_what_this_replaces():
    class Lightnings(RichProgressBar):
        def on_train_batch_end(self, trainer, *args, **kwargs) -> None:
            super().on_train_batch_end(trainer, *args, **kwargs)
            self.seen = self.progress.tasks[self.train_progress_bar_id].description

    assert _fit(Lightnings(), max_steps=3) == "Epoch 1/-2"


def test_description_rules():
    assert train_description(epoch=0, max_epochs=None, max_steps=-1) == "Epoch 0"
    assert train_description(epoch=4, max_epochs=-1, max_steps=100) == "Epoch 4 · max_steps 100"
