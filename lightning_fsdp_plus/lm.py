"""``CausalLMModule``: a LightningModule that fine-tunes any transformers-style causal LM."""

from __future__ import annotations

import math
from typing import Any

import torch
from lightning.pytorch import LightningModule
from torch import Tensor, nn


class CausalLMModule(LightningModule):
    """Next-token training of a causal LM whose ``forward(input_ids, labels=...)`` returns ``.loss``.

    Arguments:
        model: The causal LM (e.g. ``transformers.LlamaForCausalLM``), possibly PEFT-adapted.
        lr: AdamW learning rate.
        weight_decay: AdamW weight decay.
        betas: AdamW betas.

    Batches are either a LongTensor of token ids (labels = inputs) or a mapping with ``input_ids`` and
    optionally ``attention_mask`` and ``labels`` (``-100`` marks tokens left out of the loss).
    Only parameters with ``requires_grad`` reach the optimizer, so frozen weights get no optimizer state.
    """

    def __init__(
        self, model: nn.Module, *, lr: float = 1e-3, weight_decay: float = 0.0, betas: tuple[float, float] = (0.9, 0.95)
    ) -> None:
        super().__init__()
        self.model = model
        self.lr, self.weight_decay, self.betas = lr, weight_decay, tuple(betas)

    def forward(self, **batch: Tensor) -> Any:
        """Run the wrapped model."""
        return self.model(**batch)

    def loss(self, batch: Tensor | dict[str, Tensor]) -> Tensor:
        """Mean next-token cross-entropy of a batch."""
        if isinstance(batch, Tensor):
            batch = {"input_ids": batch, "labels": batch}
        return self.model(**batch).loss

    def training_step(self, batch: Tensor | dict[str, Tensor], batch_idx: int) -> Tensor:
        """One optimisation step's loss, logged as ``train_loss``."""
        loss = self.loss(batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: Tensor | dict[str, Tensor], batch_idx: int) -> Tensor:
        """Held-out loss, averaged over ranks; perplexity is logged as ``val_perplexity``."""
        loss = self.loss(batch)
        self.log("val_loss", loss, sync_dist=True, prog_bar=True)
        self.log("val_perplexity", torch.exp(loss.detach().float()).clamp(max=math.exp(20)), sync_dist=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        """AdamW over the trainable parameters only."""
        params = [p for p in self.parameters() if p.requires_grad]
        return torch.optim.AdamW(params, lr=self.lr, weight_decay=self.weight_decay, betas=self.betas)
