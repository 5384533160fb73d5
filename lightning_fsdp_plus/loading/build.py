"""A transformers causal LM built on the meta device, tagged with the checkpoint its weights come from.

:func:`deferred_pretrained` reads ``config.json`` and the safetensors headers, builds the model's parameters on
the meta device (no memory; buffers such as rotary ``inv_freq`` are computed for real, as a normal build does)
in the dtype ``from_pretrained`` would load them in, and checks every weight against the checkpoint. The model
carries a :class:`PretrainedSource`; ``FSDPPlusStrategy`` reads the weights after sharding, each rank only its
own shards (:func:`~lightning_fsdp_plus.loading.load.load_pretrained_weights`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_fsdp_plus.loading.files import CheckpointFiles, PretrainedLoadError, read_checkpoint

SOURCE_ATTRIBUTE = "_fsdp_plus_pretrained"
"""The attribute under which a deferred model keeps its :class:`PretrainedSource`."""


@dataclass(frozen=True)
class PretrainedSource:
    """Where a deferred model's weights are, and the dtype each one is loaded in before any later cast."""

    name_or_path: str
    """What the user gave: a directory or a Hugging Face id."""
    checkpoint: CheckpointFiles = field(repr=False)
    """The resolved files and their tensor headers."""
    dtypes: dict[str, torch.dtype] = field(repr=False)
    """Each checkpoint key's dtype in the model as built (what ``from_pretrained`` would hold)."""


def pretrained_source(module: nn.Module) -> PretrainedSource | None:
    """The source a deferred model carries, or None."""
    return module.__dict__.get(SOURCE_ATTRIBUTE)


def deferred_pretrained(
    name_or_path: str | Path,
    *,
    dtype: str | torch.dtype | None = None,
    config_overrides: Mapping[str, Any] | None = None,
    trust_remote_code: bool = False,
) -> nn.Module:
    """``AutoModelForCausalLM.from_pretrained(name_or_path, dtype=dtype)`` without reading a single weight.

    Returns the model with parameters on the meta device; ``FSDPPlusStrategy`` loads them after sharding (every
    rank reads only its shards). ``name_or_path`` may also name a GGUF file (``*.gguf`` or ``pkg:<module>/<file>``),
    read from its one-time conversion (:func:`~lightning_fsdp_plus.loading.gguf.converted_checkpoint`). ``dtype`` as in
    ``from_pretrained`` (``None``: the checkpoint's, from
    ``config.json``); ``config_overrides`` change config entries. Raises :class:`PretrainedLoadError` when the
    checkpoint lacks a weight, has another shape than the config implies, or its files are unusable.
    """
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    from lightning_fsdp_plus.loading.gguf import resolve_model_source

    name_or_path = resolve_model_source(name_or_path)  # a GGUF file: its converted checkpoint directory
    checkpoint = read_checkpoint(name_or_path)
    overrides = dict(config_overrides or {})
    overrides.pop("model_type", None)
    config = AutoConfig.from_pretrained(checkpoint.directory, trust_remote_code=trust_remote_code, **overrides)
    load_dtype = resolve_dtype(dtype, config=config, checkpoint=checkpoint)
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=load_dtype, trust_remote_code=trust_remote_code)
    model.tie_weights()  # within init_empty_weights an assigned Parameter is re-created on meta: tie again
    model.config.name_or_path = str(name_or_path)  # PEFT writes it into adapter_config.json
    _load_generation_config(model, checkpoint.directory)
    model.eval()  # as from_pretrained returns it
    dtypes = {name: t.dtype for name, t in model.state_dict(keep_vars=True).items()}
    check_model_against_checkpoint(model, checkpoint)
    model.__dict__[SOURCE_ATTRIBUTE] = PretrainedSource(str(name_or_path), checkpoint, dtypes)
    return model


def resolve_dtype(dtype: str | torch.dtype | None, *, config: Any, checkpoint: CheckpointFiles) -> torch.dtype:
    """The dtype ``from_pretrained`` loads in: the one given, else ``config.dtype``, else the checkpoint's first
    floating tensor's (transformers' ``"auto"``)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in (None, "auto"):
        resolved = getattr(torch, str(dtype), None)
        if not isinstance(resolved, torch.dtype) or not resolved.is_floating_point:
            raise PretrainedLoadError(
                f"model.torch_dtype={dtype!r} is not a floating torch dtype; valid choices: float32, bfloat16,"
                " float16, auto or null (the checkpoint's)"
            )
        return resolved
    stored = getattr(config, "dtype", None)
    if isinstance(stored, str):
        stored = getattr(torch, stored, None)
    if isinstance(stored, torch.dtype):
        return stored
    floating = [info.dtype for info in checkpoint.tensors.values() if info.dtype.is_floating_point]
    return floating[0] if floating else torch.get_default_dtype()


def _load_generation_config(model: nn.Module, directory: Path) -> None:
    from transformers import GenerationConfig

    if (directory / "generation_config.json").is_file() and hasattr(model, "generation_config"):
        model.generation_config = GenerationConfig.from_pretrained(directory)


def tied_groups(module: nn.Module) -> list[list[str]]:
    """Names of every parameter and persistent buffer, grouped by tensor (tied weights share a group)."""
    groups: dict[int, list[str]] = {}
    for name, tensor in module.state_dict(keep_vars=True).items():
        groups.setdefault(id(tensor), []).append(name)
    return list(groups.values())


def check_model_against_checkpoint(model: nn.Module, checkpoint: CheckpointFiles) -> None:
    """Every weight is in the checkpoint with the model's shape and a floating dtype (persistent buffers may be
    missing: they keep their built value, as in ``from_pretrained``)."""
    tensors = model.state_dict(keep_vars=True)
    buffers = {name for name, _ in model.named_buffers()}
    missing = []
    for names in tied_groups(model):
        present = [n for n in names if n in checkpoint.tensors]
        if not present:
            if not set(names) <= buffers:
                missing.append(" = ".join(names))
            continue
        for name in present:
            check_entry(checkpoint, name, shape=tuple(tensors[name].shape), floating=tensors[name].is_floating_point())
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise PretrainedLoadError(
            f"{checkpoint.directory} has no weight for {shown} ({len(missing)} of the model's tensors): the"
            " checkpoint does not match its config.json (another architecture or a partial save). Refusing to train"
            " on randomly initialized weights"
        )


def check_entry(checkpoint: CheckpointFiles, key: str, *, shape: tuple[int, ...], floating: bool) -> None:
    """``key``'s stored shape is ``shape`` and (for floating tensors) its stored dtype is floating too."""
    info = checkpoint.tensors[key]
    if info.shape != shape:
        raise PretrainedLoadError(
            f"{checkpoint.where(key)} has shape {list(info.shape)}, but the model built from"
            f" {checkpoint.directory / 'config.json'} expects {list(shape)}: config and weights do not belong together"
        )
    if floating and not info.dtype.is_floating_point:
        raise PretrainedLoadError(
            f"{checkpoint.where(key)} is stored as {info.dtype}: an already-quantized checkpoint. Streaming loading"
            " reads float weights (and quantizes them itself with quantize_base=int8); give the float checkpoint"
        )
