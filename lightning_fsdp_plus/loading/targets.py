"""Which checkpoint tensor fills which tensor of a prepared (LoRA-wrapped, quantized, sharded) model.

Names are mapped from the module to the checkpoint: the path of the deferred transformers model inside the
LightningModule is dropped, and so are PEFT's wrappers (``base_layer``, ``original_module``,
``modules_to_save.<adapter>``); LoRA adapters are not in the checkpoint. An ``Int8Linear``'s or
``FourBitLinear``'s ``weight`` is filled from the float weight of the same name (quantized while loading) and its
statistics with it.
Tied tensors (e.g. embeddings and ``lm_head``) are one target whichever of their names the checkpoint holds.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from lightning_fsdp_plus.loading.build import PretrainedSource, check_entry, pretrained_source
from lightning_fsdp_plus.loading.files import PretrainedLoadError
from lightning_fsdp_plus.quantization import FourBitLinear, Int8Linear

QUANTIZED = (Int8Linear, FourBitLinear)
"""Layers whose ``weight`` is quantized from the checkpoint's float weight while loading."""

_PEFT_WRAPPERS = ("base_layer", "original_module")


@dataclass(frozen=True)
class LoadTarget:
    """One tensor of the model to fill from one checkpoint tensor."""

    key: str
    """The checkpoint key read."""
    module_path: str
    """Path (in the root module) of the module that owns the tensor."""
    attribute: str
    """The tensor's name on that module (``weight``, ``bias``, ...)."""
    load_dtype: torch.dtype
    """dtype the weight is first converted to (the model's as built), before the tensor's own dtype."""
    quantize: bool = False
    """Quantize rows into an ``Int8Linear`` (``weight``, ``weight_scale``) or a ``FourBitLinear`` (``weight``,
    ``weight_absmax``, ``quant_map``)."""
    transposed: bool = False
    """The checkpoint holds the transpose (transformers ``Conv1D`` weights, ``[in, out]``)."""
    gather: bool = False
    """A replicated weight quantized in row blocks, one per rank, then all-gathered: each rank reads and
    quantizes 1/N of it instead of all of it."""

    def tensor(self, root: nn.Module) -> Tensor:
        """The model's tensor (looked up now: materialization replaces tensors)."""
        return getattr(root.get_submodule(self.module_path), self.attribute)


def checkpoint_key(name: str) -> str | None:
    """A module tensor's checkpoint name inside its transformers model (None for LoRA adapter tensors)."""
    parts = name.split(".")
    if any(part.startswith("lora_") for part in parts):
        return None
    kept: list[str] = []
    skip_next = False
    for part in parts:
        if skip_next:
            skip_next = False
        elif part == "modules_to_save":
            skip_next = True  # followed by the adapter name
        elif part not in _PEFT_WRAPPERS:
            kept.append(part)
    return ".".join(kept)


def deferred_models(root: nn.Module) -> list[tuple[str, nn.Module, PretrainedSource]]:
    """``(path, model, source)`` of every deferred pretrained model inside ``root`` (``root`` itself too)."""
    found = []
    for path, module in root.named_modules():
        source = pretrained_source(module)
        if source is not None:
            found.append((path, module, source))
    return found


def _owned_tensors(host: nn.Module) -> dict[int, list[tuple[str, Tensor]]]:
    """Parameters and persistent buffers of ``host`` by identity, each with all its names."""
    grouped: dict[int, list[tuple[str, Tensor]]] = {}
    for name, param in host.named_parameters(remove_duplicate=False):
        grouped.setdefault(id(param), []).append((name, param))
    for name, buffer in host.named_buffers(remove_duplicate=False):
        owner_path, _, attribute = name.rpartition(".")
        owner = host.get_submodule(owner_path)
        if attribute not in owner._non_persistent_buffers_set:
            grouped.setdefault(id(buffer), []).append((name, buffer))
    return grouped


def collect_targets(root: nn.Module) -> list[LoadTarget]:
    """The load targets of every deferred model inside ``root``; call while its weights are still on meta."""
    return [t for host_path, host, source in deferred_models(root) for t in host_targets(root, host_path, host, source)]


def host_targets(root: nn.Module, host_path: str, host: nn.Module, source: PretrainedSource) -> list[LoadTarget]:
    """The load targets of one deferred model (at ``host_path`` in ``root``), read from ``source``.

    Raises :class:`PretrainedLoadError` naming every meta tensor no checkpoint tensor fills.
    """
    targets: list[LoadTarget] = []
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    prefix = f"{host_path}." if host_path else ""
    missing = []
    for named in _owned_tensors(host).values():
        name, tensor = named[0]
        owner_path, _, attribute = (prefix + name).rpartition(".")
        owner = root.get_submodule(owner_path)
        if isinstance(owner, QUANTIZED) and attribute != "weight" and attribute != "bias":
            continue  # statistics: filled together with the weight
        if isinstance(owner, FourBitLinear) and owner.double_quant:
            raise PretrainedLoadError(
                f"{owner_path}: quantize_double=True needs every row's statistics at once (their mean and their"
                " 256-value blocks span rows and shards), which streaming loading never holds. Set quantize_double"
                " to false, or load with model.low_memory_load=false"
            )
        aliases = [k for k in dict.fromkeys(checkpoint_key(n) for n, _ in named) if k is not None]
        if not aliases:  # a LoRA adapter: PEFT initialized it, unless it was left on meta
            if tensor.is_meta:
                missing.append(f"{prefix}{name} (a LoRA adapter on the meta device)")
            continue
        present = [k for k in aliases if k in source.checkpoint.tensors]
        if not present:
            if tensor.is_meta:
                missing.append(" = ".join(prefix + n for n, _ in named))
            continue  # a persistent buffer the checkpoint lacks keeps its built value
        key = present[0]
        quantize = isinstance(owner, QUANTIZED) and attribute == "weight"
        transposed = quantize and owner.source_layout == "conv1d"
        shape = (owner.out_features, owner.in_features) if quantize else tuple(tensor.shape)
        shape = shape[::-1] if transposed else shape
        check_entry(source.checkpoint, key, shape=shape, floating=quantize or tensor.is_floating_point())
        load_dtype = source.dtypes.get(key, tensor.dtype)
        gather = quantize and not isinstance(tensor, DTensor) and world > 1
        targets.append(LoadTarget(key=key, module_path=owner_path, attribute=attribute, load_dtype=load_dtype,
                                  quantize=quantize, transposed=transposed, gather=gather))  # fmt: skip
    if missing:
        raise PretrainedLoadError(
            f"{source.checkpoint.directory} has no weight for {', '.join(missing[:5])}"
            f"{f' and {len(missing) - 5} more' if len(missing) > 5 else ''}: these tensors would stay"
            " uninitialized. Add them to the checkpoint, or build them outside the deferred model"
        )
    return targets
