"""The app's run reports (``lightning_fsdp_plus.app.train``): what it validates and prints when Lightning runs no
validation (``trainer.limit_val_batches=0``), in-process; the whole app runs in tests/test_train_app.py."""

from __future__ import annotations

import pytest
from lightning.pytorch import Trainer
from lightning.pytorch.demos.boring_classes import BoringModel

from lightning_fsdp_plus.app.train import perplexity_line, throughput_line, validation


class LoggingModel(BoringModel):
    """Lightning's BoringModel, logging its validation loss as the app's module does."""

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.step(batch))


@pytest.mark.parametrize(("limit", "ran"), [(0, False), (2, True)])
def test_validation_is_empty_when_lightning_runs_no_validation_batch(limit, ran):
    """Lightning's ``validate`` returns ``[]`` when ``limit_val_batches=0``: the app's final and base validations
    then report nothing (they raised IndexError) instead of the first result."""
    trainer = Trainer(accelerator="cpu", devices=1, limit_val_batches=limit, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False)  # fmt: skip
    results = validation(trainer, module=LoggingModel(), datamodule=None)
    assert set(results) == ({"val_loss"} if ran else set())


def test_the_console_says_why_a_figure_is_missing():
    assert perplexity_line({"val_perplexity": None, "base_val_perplexity": None}) == (
        "val perplexity not measured (no validation batch: trainer.limit_val_batches=0?)"
    )
    assert perplexity_line({"val_perplexity": 2.371, "base_val_perplexity": None}) == "val perplexity 2.37"
    assert perplexity_line({"val_perplexity": 2.371, "base_val_perplexity": 61.96}) == "val perplexity 61.96 -> 2.37"
    assert throughput_line({"useful_tokens_per_s": 5290.4, "tokens_per_s": 5443.0, "padding_share": 0.028}) == (
        "5,290 useful tokens/s of 5,443 (2.8% padding)"
    )
    assert throughput_line({"useful_tokens_per_s": float("nan"), "tokens_per_s": 1.0, "padding_share": 0.0}) == (
        "throughput not measured (no step after the timing warm-up)"
    )
