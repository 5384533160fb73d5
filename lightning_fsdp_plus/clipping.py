"""Gradient clipping that is correct across shards.

Sharded gradients are DTensors: their norm needs a reduction over the shard group. Parameters kept out of
FSDP (``ignored_params``) have ordinary, replicated gradients that must be counted once, not once per rank.
``torch.nn.utils.clip_grad_norm_`` handles neither mix, so the gradients are grouped by kind and mesh,
each group's norm is computed by torch (``get_total_norm``), and the group norms are combined.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor


def _grouped_params(parameters: Iterable[Tensor]) -> list[list[Tensor]]:
    """Parameters with a gradient, grouped so that each group's grads share a kind (and a mesh)."""
    groups: dict[object, list[Tensor]] = {}
    for param in parameters:
        grad = param.grad
        if grad is None:
            continue
        key = (grad.device_mesh, grad.placements) if isinstance(grad, DTensor) else ("local", grad.device)
        groups.setdefault(key, []).append(param)
    return list(groups.values())


def grad_norm_across_shards(parameters: Iterable[Tensor], *, norm_type: float = 2.0) -> Tensor:
    """The global gradient norm over all shards and replicated parameters (a plain tensor on every rank)."""
    norms = []
    for group in _grouped_params(parameters):
        norm = torch.nn.utils.get_total_norm([p.grad for p in group], norm_type=norm_type)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    if not norms:
        return torch.tensor(0.0)
    device = norms[0].device
    return torch.nn.utils.get_total_norm([n.to(device) for n in norms], norm_type=norm_type)


def clip_grad_norm_across_shards(parameters: Iterable[Tensor], *, max_norm: float, norm_type: float = 2.0) -> Tensor:
    """Scale all gradients so that their global norm is at most ``max_norm``; returns the pre-clip norm."""
    params = list(parameters)
    total = grad_norm_across_shards(params, norm_type=norm_type)
    for group in _grouped_params(params):
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, total.to(group[0].grad.device))
    return total


def clip_grad_value_across_shards(parameters: Iterable[Tensor], *, clip_value: float) -> None:
    """Clamp every gradient element to ``[-clip_value, clip_value]`` (elementwise, so shards need no talk)."""
    for group in _grouped_params(parameters):
        torch.nn.utils.clip_grad_value_(group, clip_value)
