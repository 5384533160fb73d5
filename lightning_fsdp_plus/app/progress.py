"""The app's progress bar: Lightning's rich bar, with an epoch label that is right for step-limited runs.

Lightning's ``RichProgressBar`` labels the training bar ``Epoch {e}/{max_epochs - 1}``; a run limited by
``max_steps`` leaves ``max_epochs`` at -1 and reads ``Epoch 0/-2``. Here such a run reads ``Epoch 0 · max_steps 100``.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.callbacks import RichProgressBar, TQDMProgressBar
from lightning.pytorch.callbacks.progress.rich_progress import _RICH_AVAILABLE  # where lightning 2.5 has it too
from typing_extensions import override


def train_description(*, epoch: int, max_epochs: int | None, max_steps: int) -> str:
    """``Epoch 2/9`` when the epochs are bounded, else ``Epoch 2`` (with ``· max_steps N`` when steps are)."""
    text = f"Epoch {epoch}"
    if max_epochs is not None and max_epochs >= 1:
        text += f"/{max_epochs - 1}"
    if max_steps > 0:
        text += f" · max_steps {max_steps}"
    return text


class StepAwareRichProgressBar(RichProgressBar):
    """``RichProgressBar`` whose training label never shows a negative epoch count (see module docstring)."""

    @override
    def _get_train_description(self, current_epoch: int) -> str:
        text = train_description(epoch=current_epoch, max_epochs=self.trainer.max_epochs,
                                 max_steps=self.trainer.max_steps)  # fmt: skip
        width = len(self.validation_description)
        return f"{text:{width}}" if width > len(text) else text  # Lightning pads too, against flicker


def progress_bar() -> Any:
    """The bar the app adds when ``trainer.enable_progress_bar`` is true (tqdm's when rich is missing)."""
    return StepAwareRichProgressBar() if _RICH_AVAILABLE else TQDMProgressBar()
