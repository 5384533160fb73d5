"""A decoder layer's key/value cache while gradients are computed: left out (a forward pre-hook).

Activation checkpointing (:mod:`~lightning_fsdp_plus.sharding`) and compile (:mod:`~lightning_fsdp_plus.compile`)
both need it; generation, under ``no_grad``, keeps its cache.
"""

from __future__ import annotations

import functools
import inspect
import logging

import torch
from torch import nn

log = logging.getLogger(__name__)

CACHE_ARGUMENTS = ("cache", "past_key_values", "past_key_value", "layer_past")
"""The names transformers layers take their key/value cache by (renamed over versions; GPT-2 passes it by
position)."""


@functools.cache
def _forward_signature(cls: type) -> inspect.Signature:
    return inspect.signature(cls.forward)


def drop_cache_under_grad(module: nn.Module, *, why: str) -> None:
    """While gradients are computed, ``module`` (a decoder layer) runs without its key/value cache (a forward
    pre-hook; registered once, before any hook registered after it). ``why`` is logged once per layer class.

    Checkpointed layers need it (their forward runs again in backward and would write the cache twice), and so do
    compiled ones: a layer given a cache reads its ``layer_idx``, and dynamo would compile it once per layer.
    """
    if getattr(module, "_fsdp_plus_drops_cache", False):
        return
    module.register_forward_pre_hook(functools.partial(_without_cache_under_grad, why=why), with_kwargs=True)
    module._fsdp_plus_drops_cache = True


def _without_cache_under_grad(module: nn.Module, args: tuple, kwargs: dict, *, why: str) -> tuple[tuple, dict] | None:
    if not torch.is_grad_enabled() or getattr(module, "_can_checkpoint_with_cache", False):
        return None  # no backward, no recomputation; or a layer that only reads its cache
    if len(args) <= 1 and not kwargs.get("use_cache") and all(kwargs.get(n) is None for n in CACHE_ARGUMENTS):
        return None  # nothing to drop (the app's use_cache=False): no signature binding per layer call
    try:
        bound = _forward_signature(type(module)).bind(module, *args, **kwargs)
    except TypeError:
        return None  # the call itself is wrong: let forward say so
    dropped = [name for name in CACHE_ARGUMENTS if bound.arguments.get(name) is not None]
    if not dropped and not bound.arguments.get("use_cache"):
        return None
    for name in dropped:
        bound.arguments[name] = None
    if "use_cache" in bound.arguments:
        bound.arguments["use_cache"] = False
    _note_cache_dropped(type(module).__name__, why)
    return bound.args[1:], bound.kwargs


@functools.cache
def _note_cache_dropped(layer: str, why: str) -> None:
    log.info(f"{layer} runs without its key/value cache while computing gradients ({why})")
