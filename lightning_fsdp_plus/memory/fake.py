"""A transformers config's model without memory: built on meta, prepared by the pipeline, then FakeTensors.

The estimator (``estimate.py``) counts parameters and one forward's activations on it; ``--simulate``
(``simulate.py``) shards it on a fake process group. Both get it from here, prepared exactly as
``FSDPPlusStrategy`` prepares a model (LoRA, int8), inside a holder module that plays the LightningModule.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_fsdp_plus._private import _DtypeContextManager, fake_tensor_mode
from lightning_fsdp_plus.options import FSDPPlusOptions
from lightning_fsdp_plus.pipeline import prepare_model, quantize_model


class EstimateError(ValueError):
    """Bad estimator input; the message names the key, the bad value and the valid choices."""


@dataclass(frozen=True)
class ForwardBatch:
    """The batch one counted forward sees."""

    batch_size: int = 1
    """Sequences per rank."""
    seq_len: int = 2048
    """Tokens per sequence."""
    padded: bool = False
    """Give the batch an attention mask with a padded position (the masked attention path)."""
    packed: bool = False
    """Rows of several examples (:mod:`lightning_fsdp_plus.app.packing`): ``position_ids`` restarting mid-row and no
    attention mask, so that attention takes its masked path with a ``[batch, 1, seq, seq]`` block mask."""


class CausalLMHolder(nn.Module):
    """The root module around a causal LM, as a LightningModule holds ``self.model`` (LoRA wraps the inside)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, chunked_loss: bool | None = None, **batch: torch.Tensor) -> Any:
        """Run the held model; with ``chunked_loss`` given, return the loss as the app computes it
        (:func:`~lightning_fsdp_plus.loss.causal_lm_loss`) inside this root's call, as a LightningModule's
        ``training_step`` runs inside its root's."""
        if chunked_loss is None:
            return self.model(**batch)
        from lightning_fsdp_plus.loss import causal_lm_loss

        return causal_lm_loss(self.model, batch, chunked=chunked_loss)


def load_config(path: Any) -> Any:
    """A transformers config from ``config.json`` or a directory holding one (local files only); a config object
    is returned as it is."""
    from transformers import AutoConfig, PretrainedConfig

    if isinstance(path, PretrainedConfig):
        return path
    target = Path(path)
    file = target / "config.json" if target.is_dir() else target
    try:
        values = json.loads(file.read_text())
        model_type = values.pop("model_type")
        return AutoConfig.for_model(model_type, **values)
    except (OSError, ValueError, KeyError) as err:
        reason = "no model_type" if isinstance(err, KeyError) else f"{type(err).__name__}: {err}"
        raise EstimateError(f"config={str(path)!r} is not a readable transformers config.json ({reason})") from None


def build_meta_model(hf_config: Any, *, dtype: torch.dtype, options: FSDPPlusOptions) -> CausalLMHolder:
    """The config's causal LM on the meta device in a holder, through the pipeline's prepare and quantize stages
    (everything trains when no LoRA is configured). Built in ``dtype`` whatever the config's own ``dtype`` says
    (transformers' ``from_config`` follows the config, and hub configs say bfloat16: activations would be counted
    at half their size under ``32-true``)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"), _DtypeContextManager(dtype):
        holder = CausalLMHolder(AutoModelForCausalLM.from_config(hf_config, dtype=dtype))
        if options.lora is None:
            holder.requires_grad_(True)
        try:
            prepare_model(holder, options)
        except ValueError as err:
            raise EstimateError(str(err)) from None
        quantize_model(holder, options)
    return holder


def config_source(config: Any) -> str:
    """How a config reads in tables: its path, or the model type and size of a config object."""
    if isinstance(config, (str, Path)):
        return str(config)
    layers = getattr(config, "num_hidden_layers", "?")
    return f"{getattr(config, 'model_type', type(config).__name__)} ({layers} layers, hidden {config.hidden_size})"


@contextmanager
def fake_model(
    config: Any, *, dtype: torch.dtype, options: FSDPPlusOptions, batch: ForwardBatch
) -> Iterator[tuple[nn.Module, dict]]:
    """``(model, batch)`` on CPU FakeTensors inside ``FakeTensorMode``: the prepared model in ``dtype`` and one
    example batch."""
    hf_config = load_config(config)
    model = build_meta_model(hf_config, dtype=dtype, options=options)
    with fake_tensor_mode()():
        to_fake(model)
        model.train()
        yield model, example_batch(vocab_size=hf_config.vocab_size, batch=batch)


def to_fake(model: nn.Module) -> nn.Module:
    """Replace meta parameters and buffers by CPU FakeTensors of the same shapes (call in ``FakeTensorMode``).

    Fake CPU tensors run the CPU kernels' shape logic (which tensors autograd saves), unlike meta ones.
    Tied parameters stay tied.
    """
    memo: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for name, tensor in table.items():
                if tensor is None:
                    continue
                if id(tensor) not in memo:
                    fake = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu")
                    is_param = isinstance(tensor, nn.Parameter)
                    memo[id(tensor)] = nn.Parameter(fake, requires_grad=tensor.requires_grad) if is_param else fake
                table[name] = memo[id(tensor)]
    return model


def example_batch(*, vocab_size: int, batch: ForwardBatch) -> dict[str, torch.Tensor]:
    """Token ids (and labels) for one forward; ``padded`` adds an attention mask with one padded position,
    as padding collators produce: attention then takes its masked path, which saves more for backward; ``packed``
    gives packed rows' ``position_ids`` (two examples a row), whose block mask takes the same path."""
    ids = torch.randint(0, vocab_size, (batch.batch_size, batch.seq_len))
    out = {"input_ids": ids, "labels": ids}
    if batch.padded:
        mask = torch.ones(batch.batch_size, batch.seq_len, dtype=torch.long)
        mask[0, -1] = 0
        out["attention_mask"] = mask
    if batch.packed:  # two examples a row; no cache, as packed rows run (transformers detects them only so)
        half = batch.seq_len // 2
        positions = torch.cat([torch.arange(half), torch.arange(batch.seq_len - half)])
        out.update(position_ids=positions.expand(batch.batch_size, -1), use_cache=False)
    return out
