"""Which layers of a model a ``quantize_base`` setting converts (the rule int8 and 4-bit share)."""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Sequence

from torch import nn


def skipped(path: str, skip: Sequence[str]) -> bool:
    """True when the module path or its last name matches a ``quantize_skip`` pattern (``fnmatch``)."""
    name = path.rsplit(".", 1)[-1]
    return any(fnmatch.fnmatchcase(path, pattern) or fnmatch.fnmatchcase(name, pattern) for pattern in skip)


def is_conv1d(module: nn.Module) -> bool:
    """transformers' ``Conv1D`` (GPT-2, GPT-J's predecessors, ...): a linear layer with a transposed weight."""
    from transformers.pytorch_utils import Conv1D

    return type(module) is Conv1D


def is_bnb_layer(module: nn.Module, class_name: str) -> bool:
    """True for an instance of ``bitsandbytes.nn.<class_name>`` (False when bitsandbytes cannot be imported)."""
    try:
        import bitsandbytes.nn as bnb_nn
    except Exception:  # bitsandbytes can fail at import with errors other than ImportError
        return False
    return isinstance(module, getattr(bnb_nn, class_name))


def layer_candidates(model: nn.Module, *, skip: Sequence[str], prequantized: Callable[[nn.Module], bool]) -> list[str]:
    """Paths of every frozen ``nn.Linear`` / ``Conv1D`` and every ``prequantized`` bitsandbytes layer, except LoRA
    adapters (``lora_`` in the path) and ``skip`` matches."""
    paths = []
    for path, module in model.named_modules():
        if not path or any(part.startswith("lora_") for part in path.split(".")) or skipped(path, skip):
            continue
        float_layer = type(module) is nn.Linear or is_conv1d(module)
        if prequantized(module) or (float_layer and not any(p.requires_grad for p in module.parameters())):
            paths.append(path)
    return paths


def replace_layers(model: nn.Module, paths: Sequence[str], convert: Callable[[nn.Module], nn.Module]) -> list[str]:
    """Replace each module at ``paths`` with ``convert(module)`` in place (train/eval mode kept); returns ``paths``."""
    for path in paths:
        module = model.get_submodule(path)
        replacement = convert(module)
        replacement.train(module.training)  # int8 layers compute differently in eval (bitsandbytes' int8 matmul)
        model.set_submodule(path, replacement)
    return list(paths)


def meta_shapes(module: nn.Module) -> tuple[int, int, str]:
    """``(in_features, out_features, source_layout)`` of a float linear layer (``nn.Linear`` or ``Conv1D``)."""
    if is_conv1d(module):  # Conv1D holds [in, out]
        return module.weight.shape[0], module.weight.shape[1], "conv1d"
    return module.weight.shape[1], module.weight.shape[0], "linear"
