"""``CausalLMModule``: a LightningModule that fine-tunes any transformers-style causal LM."""

from __future__ import annotations

import math
from typing import Any

import torch
from lightning.pytorch import LightningModule
from torch import Tensor, nn

from lightning_fsdp_plus.app.data import BOOKKEEPING_KEYS, GLOBAL_TOKENS_KEY
from lightning_fsdp_plus.app.packing import Route, attention_route, packed_model_inputs
from lightning_fsdp_plus.loss import causal_lm_loss
from lightning_fsdp_plus.sampler import data_parallel_ranks


def target_tokens(batch: Tensor | dict[str, Tensor]) -> int:
    """Tokens the loss averages over: every next token, minus labels masked with -100."""
    if isinstance(batch, Tensor):
        return batch.size(0) * (batch.size(1) - 1)
    labels = batch.get("labels", batch["input_ids"])
    return int((labels[:, 1:] != -100).sum())


class CausalLMModule(LightningModule):
    """Next-token training of a causal LM whose ``forward(input_ids, labels=...)`` returns ``.loss``.

    Arguments:
        model: The causal LM (e.g. ``transformers.LlamaForCausalLM``), possibly PEFT-adapted.
        lr: AdamW learning rate.
        weight_decay: AdamW weight decay.
        betas: AdamW betas.
        chunked_loss: Compute the loss chunk by chunk inside the output head's call
            (:func:`~lightning_fsdp_plus.loss.causal_lm_loss`): the batch's float32 logits never exist. False: the
            model's own ``.loss``. Both give the same loss and gradients.

    Batches are either a LongTensor of token ids (labels = inputs) or a mapping with ``input_ids`` and
    optionally ``attention_mask`` and ``labels`` (``-100`` marks tokens left out of the loss).
    Only parameters with ``requires_grad`` reach the optimizer, so frozen weights get no optimizer state.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        lr: float = 1e-3,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.95),
        chunked_loss: bool = True,
    ) -> None:
        super().__init__()
        self.model = model
        self.lr, self.weight_decay, self.betas = lr, weight_decay, tuple(betas)
        self.chunked_loss = chunked_loss
        self._step_loss: Tensor | None = None
        self._route: Route | None = None

    @classmethod
    def from_pretrained(
        cls,
        name_or_path: str,
        *,
        torch_dtype: str | torch.dtype | None = None,
        config_overrides: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> CausalLMModule:
        """A module around a pretrained causal LM whose weights ``FSDPPlusStrategy`` loads after sharding.

        The model is built on the meta device (:func:`~lightning_fsdp_plus.loading.deferred_pretrained`): no
        rank ever holds the whole float model; each reads only its own shards from the safetensors files.
        ``torch_dtype`` as in ``from_pretrained``; other keyword arguments are this class's (``lr``, ...).
        """
        from lightning_fsdp_plus.loading import deferred_pretrained

        return cls(deferred_pretrained(name_or_path, dtype=torch_dtype, config_overrides=config_overrides), **kwargs)

    def on_fit_start(self) -> None:
        """Train mode for the whole model, as transformers' ``Trainer`` does: ``from_pretrained`` and
        ``deferred_pretrained`` return it in eval mode and Lightning 2.6 keeps submodules' modes at fit start, so the
        base's dropout would be off in training, and on CPU bitsandbytes' int8 layers would take their inference path
        (int8 activations) instead of their training one (the weight dequantized, a float matmul). Lightning's
        validation switches to eval mode and back."""
        self.train()

    def forward(self, **batch: Tensor) -> Any:
        """Run the wrapped model."""
        return self.model(**batch)

    def loss(self, batch: Tensor | dict[str, Tensor]) -> Tensor:
        """Mean next-token cross-entropy of a batch (chunked unless ``chunked_loss=False``). No key/value cache:
        nothing reads it in training or validation, and in validation it would hold every layer's keys and values
        until the loss is computed. Packed rows (``position_ids``, no ``attention_mask``) keep attention inside
        their examples (:func:`~lightning_fsdp_plus.app.packing.packed_model_inputs`)."""
        if isinstance(batch, Tensor):
            batch = {"input_ids": batch, "labels": batch}
        batch = {k: v for k, v in batch.items() if k not in BOOKKEEPING_KEYS}
        if getattr(getattr(self.model, "config", None), "use_cache", None) is not None:
            batch = {**batch, "use_cache": False}
        if "position_ids" in batch and batch.get("attention_mask") is None:
            self._route = self._route or attention_route(self.model)
            batch = packed_model_inputs(self.model, batch, route=self._route)
        return causal_lm_loss(self.model, batch, chunked=self.chunked_loss)

    def training_step(self, batch: Tensor | dict[str, Tensor], batch_idx: int) -> Tensor:
        """One micro-batch's loss; ``train_loss`` is logged once per optimizer step.

        A batch carrying its global batch's target tokens (``global_target_tokens``, from the app's data modules)
        counts as its share of the global batch's token mean: the gradient and the logged ``train_loss`` are then
        that mean whatever the number of ranks and micro-steps (a mean of micro-batch means weighs a short
        micro-batch's tokens more). Other batches: the micro-batch's mean, logged as it is.
        """
        if not isinstance(batch, dict) or GLOBAL_TOKENS_KEY not in batch:
            loss = self.loss(batch)
            self.log("train_loss", loss, prog_bar=True)
            return loss
        global_tokens = batch[GLOBAL_TOKENS_KEY][0].to(torch.float64)
        labels = batch.get("labels", batch["input_ids"])
        share = (labels[:, 1:] != -100).sum().to(torch.float64) / global_tokens.clamp(min=1)
        part = self.loss(batch) * share.to(torch.float32)  # this micro-batch's part of the global batch's mean
        self._step_loss = part.detach() + (self._step_loss if self._step_loss is not None else 0.0)
        accumulate = self.trainer.accumulate_grad_batches
        ranks, _ = data_parallel_ranks(self.trainer)
        copies = self.trainer.world_size // ranks  # a tensor-parallel group's ranks hold the same part
        if (batch_idx + 1) % accumulate == 0:  # the global batch is complete: its mean over every rank's parts
            self.log("train_loss", self._step_loss / copies, prog_bar=True, sync_dist=True, reduce_fx="sum")
            self._step_loss = None
        # Lightning divides by the accumulation and FSDP averages the gradients over the data-parallel ranks
        return part * (accumulate * ranks)

    def on_validation_epoch_start(self) -> None:
        """Reset the token-weighted held-out loss."""
        self._val_totals = torch.zeros(2, dtype=torch.float64, device=self.device)

    def validation_step(self, batch: Tensor | dict[str, Tensor], batch_idx: int) -> Tensor:
        """Accumulate the held-out loss weighted by the number of predicted tokens."""
        loss = self.loss(batch)
        tokens = target_tokens(batch)
        self._val_totals += torch.stack([loss.detach().double() * tokens, torch.tensor(tokens, dtype=torch.float64)])
        return loss

    def on_validation_epoch_end(self) -> None:
        """Log ``val_loss`` (mean over every rank's tokens) and ``val_perplexity = exp(val_loss)``."""
        totals = self.trainer.strategy.reduce(self._val_totals.clone(), reduce_op="sum")
        mean = (totals[0] / totals[1].clamp(min=1)).float()
        self.log("val_loss", mean, sync_dist=True, prog_bar=True)
        self.log("val_perplexity", torch.exp(mean).clamp(max=math.exp(20)), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        """AdamW over the trainable parameters only."""
        params = [p for p in self.parameters() if p.requires_grad]
        return torch.optim.AdamW(params, lr=self.lr, weight_decay=self.weight_decay, betas=self.betas)


def build_causal_lm(
    *, name_or_path: str | None = None, config: dict[str, Any] | None = None, torch_dtype: str | None = None
) -> nn.Module:
    """A transformers causal LM: loaded from a directory, a hub id or a GGUF file (its one-time conversion), or
    built from config kwargs.

    ``config`` needs ``model_type`` (e.g. ``llama``) and builds randomly initialised weights; with both,
    ``config`` entries override the loaded config.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    dtype = getattr(torch, torch_dtype) if torch_dtype else None
    if name_or_path is not None:
        from lightning_fsdp_plus.loading.gguf import resolve_model_source

        overrides = dict(config or {})
        overrides.pop("model_type", None)
        return AutoModelForCausalLM.from_pretrained(resolve_model_source(name_or_path), dtype=dtype, **overrides)
    if not config or "model_type" not in config:
        raise ValueError("build_causal_lm: give name_or_path, or config with a model_type (e.g. 'llama')")
    kwargs = dict(config)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(kwargs.pop("model_type"), **kwargs))
    return model.to(dtype) if dtype is not None else model
