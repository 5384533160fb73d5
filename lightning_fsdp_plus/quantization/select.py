"""Which layers of a model a ``quantize_base`` setting converts (the rule int8 and 4-bit share)."""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Sequence

from torch import nn

from lightning_fsdp_plus.plan import tied_parameters


def skipped(path: str, skip: Sequence[str]) -> bool:
    """True when the module path or its last name matches a ``quantize_skip`` pattern (``fnmatch``)."""
    name = path.rsplit(".", 1)[-1]
    return any(fnmatch.fnmatchcase(path, pattern) or fnmatch.fnmatchcase(name, pattern) for pattern in skip)


def is_adapter(path: str) -> bool:
    """Whether a module path lies in a LoRA adapter (``lora_A``, ``lora_B``, ... in it): never quantized."""
    return any(part.startswith("lora_") for part in path.split("."))


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


PLAIN_LINEAR_SUBCLASSES = ("FalconLinear",)
"""``nn.Linear`` subclasses that override ``forward`` with the plain map ``x @ W.T + b`` (quantized like it)."""


def linear_kind(module: nn.Module) -> str | None:
    """``"linear"`` for a layer computing ``x @ W.T + b`` (``nn.Linear``, a subclass that keeps its forward or is
    in :data:`PLAIN_LINEAR_SUBCLASSES`, transformers' ``Conv1D``); the reason a ``nn.Linear`` subclass is not;
    ``None`` for anything else."""
    if type(module) is nn.Linear or is_conv1d(module):
        return "linear"
    if not isinstance(module, nn.Linear):
        return None
    cls = type(module)
    if cls.forward is nn.Linear.forward or cls.__name__ in PLAIN_LINEAR_SUBCLASSES:
        return "linear"
    return f"{cls.__name__} overrides nn.Linear.forward (not known to be a plain linear map)"


def output_embedding_paths(model: nn.Module) -> set[str]:
    """Paths of the output heads transformers names (``get_output_embeddings()`` of every model inside)."""
    heads = set()
    for module in model.modules():
        getter = getattr(module, "get_output_embeddings", None)
        if callable(getter):
            try:
                head = getter()
            except (AttributeError, NotImplementedError):
                continue
            if isinstance(head, nn.Module):
                heads.add(id(head))
    return {path for path, module in model.named_modules() if id(module) in heads}


def kept_float(model: nn.Module, *, skip: Sequence[str]) -> dict[str, str]:
    """Frozen linear layers that stay in float, with why: a ``quantize_skip`` match, an output head
    (``get_output_embeddings``, as transformers' own quantizers keep it), a weight tied to another module's (a
    tied embedding: quantizing it would break the tie), a ``nn.Linear`` subclass with its own forward.

    LoRA adapters and trainable layers are not listed (they are never quantized).
    """
    heads, tied = output_embedding_paths(model), {id(param): names for param, names in tied_parameters(model)}
    reasons = {}
    for path, module in model.named_modules():
        kind = linear_kind(module)
        if not path or kind is None or is_adapter(path):
            continue
        if is_bnb_layer(module, "Linear8bitLt") or is_bnb_layer(module, "Linear4bit"):
            continue  # quantized already: converted losslessly, whatever its class does
        if any(p.requires_grad for p in module.parameters()):
            continue
        own = [n for p in module.parameters(recurse=False) for n in tied.get(id(p), ())]
        others = [n for n in own if n.rpartition(".")[0] != path]
        if skipped(path, skip):
            reasons[path] = "quantize_skip"
        elif path in heads:
            reasons[path] = "output embeddings (get_output_embeddings)"
        elif others:
            reasons[path] = f"tied to {others[0]}"
        elif kind != "linear":
            reasons[path] = kind
    return reasons


def layer_candidates(model: nn.Module, *, skip: Sequence[str], prequantized: Callable[[nn.Module], bool]) -> list[str]:
    """Paths of every frozen plain linear layer (:func:`linear_kind`) and every ``prequantized`` bitsandbytes layer,
    except LoRA adapters (``lora_`` in the path) and what :func:`kept_float` keeps in float."""
    keep = kept_float(model, skip=skip)
    paths = []
    for path, module in model.named_modules():
        if not path or is_adapter(path) or path in keep or skipped(path, skip):  # skip: for bitsandbytes layers
            continue
        float_layer = linear_kind(module) == "linear"
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
