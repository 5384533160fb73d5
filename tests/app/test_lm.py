import warnings

import torch
from lightning.pytorch import Callback, Trainer
from torch.utils.data import DataLoader

from lightning_fsdp_plus.app.lm import CausalLMModule
from tests.helpers.models import tiny_llama


class Modes(Callback):
    """Whether every submodule is in train mode, per training and validation batch."""

    def __init__(self) -> None:
        self.train: list[bool] = []
        self.val: list[bool] = []

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        self.train.append(all(m.training for m in module.modules()))

    def on_validation_batch_start(self, trainer, module, batch, batch_idx, dataloader_idx=0):
        self.val.append(any(m.training for m in module.modules()))


def test_a_pretrained_model_handed_over_in_eval_mode_trains_in_train_mode_and_validates_in_eval_mode():
    # from_pretrained (and deferred_pretrained) return the model in eval mode; Lightning 2.6 keeps submodule modes
    model = tiny_llama(0).eval()
    module, modes = CausalLMModule(model), Modes()
    data = DataLoader([torch.randint(0, model.config.vocab_size, (2, 8)) for _ in range(2)], batch_size=None)
    trainer = Trainer(accelerator="cpu", devices=1, max_steps=2, limit_val_batches=1, val_check_interval=1,
                      num_sanity_val_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, callbacks=[modes])  # fmt: skip
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, train_dataloaders=data, val_dataloaders=data)
    assert modes.train == [True, True]
    assert modes.val and not any(modes.val)  # the sanity check and both validations: eval mode throughout
    assert not [w for w in caught if "in eval mode" in str(w.message)]
