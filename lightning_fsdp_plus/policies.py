"""Wrap-policy resolution: which submodules become FSDP units (and which get activation checkpointing).

Accepted ``auto_wrap_policy`` values:

- ``"auto"``: the classes in transformers' ``_no_split_modules`` of any ``PreTrainedModel`` inside the
  model; otherwise the repeated module class with the most parameters per instance (a transformer block).
- a list of module classes or class names, resolved against the model's own classes;
- ``{"min_num_params": N}``: bottom-up, a module becomes a unit when it holds at least N parameters
  not already in a nested unit (FSDP1's size-based policy);
- a callable ``(module) -> bool``;
- ``None``: only the root is a unit.

The root is always a unit and is never returned here.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Literal, TypeAlias

from torch import nn

WrapPolicy: TypeAlias = (
    Literal["auto"] | Sequence[type[nn.Module] | str] | Mapping[str, int] | Callable[[nn.Module], bool] | None
)
"""Everything ``auto_wrap_policy`` accepts."""

_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)


def validate_wrap_policy(policy: Any, *, key: str = "auto_wrap_policy") -> None:
    """Check the shape of a policy without a model; raises ValueError naming ``key`` and the choices."""
    if policy is None or policy == "auto" or (callable(policy) and not isinstance(policy, type)):
        return
    if isinstance(policy, Mapping):
        if set(policy) != {"min_num_params"}:
            raise ValueError(f"{key}={dict(policy)!r}: a mapping policy takes exactly one key, 'min_num_params'")
        value = policy["min_num_params"]
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{key}.min_num_params={value!r} must be a positive integer")
        return
    if isinstance(policy, str):
        raise ValueError(
            f"{key}={policy!r} is not valid: use 'auto', a list of module classes or class names,"
            " {'min_num_params': N}, a callable (module) -> bool, or None"
        )
    items = [policy] if isinstance(policy, type) else list(policy)
    for item in items:
        if not (isinstance(item, str) or (isinstance(item, type) and issubclass(item, nn.Module))):
            raise ValueError(f"{key} entry {item!r} is neither an nn.Module subclass nor a class name")


def resolve_module_classes(
    model: nn.Module, classes: Iterable[type[nn.Module] | str], *, key: str
) -> set[type[nn.Module]]:
    """Resolve classes and class names against the classes present in ``model``.

    A name matches a class's ``__name__`` or its ``module.qualname``. Unknown names raise a ValueError
    that lists the candidate classes found in the model.
    """
    present = {type(m) for m in model.modules()}
    resolved: set[type[nn.Module]] = set()
    for item in classes:
        if isinstance(item, type):
            resolved.add(item)
            continue
        matches = {c for c in present if item in (c.__name__, f"{c.__module__}.{c.__qualname__}")}
        if not matches:
            candidates = ", ".join(sorted({c.__name__ for c in present}))
            raise ValueError(f"{key}: module class {item!r} is not in the model; candidates: {candidates}")
        resolved |= matches
    return resolved


def no_split_module_classes(model: nn.Module) -> list[str]:
    """transformers' ``_no_split_modules`` of every ``PreTrainedModel`` inside ``model`` (empty if none)."""
    names: list[str] = []
    for module in model.modules():
        for name in getattr(module, "_no_split_modules", None) or ():
            if name not in names:
                names.append(name)
    return names


def largest_repeated_block_class(model: nn.Module) -> type[nn.Module] | None:
    """The class that occurs at least twice and has the most parameters per instance (containers excluded)."""
    counts = Counter(type(m) for m in model.modules() if not isinstance(m, _CONTAINERS))
    best: tuple[int, type[nn.Module]] | None = None
    for module in model.modules():
        cls = type(module)
        if counts.get(cls, 0) < 2 or module is model:
            continue
        size = sum(p.numel() for p in module.parameters())
        if size and (best is None or size > best[0]):
            best = (size, cls)
    return None if best is None else best[1]


def select_unit_paths(model: nn.Module, policy: WrapPolicy, *, key: str = "auto_wrap_policy") -> list[str]:
    """Module paths (root excluded) that become FSDP units under ``policy``."""
    validate_wrap_policy(policy, key=key)
    if policy is None:
        return []
    if isinstance(policy, Mapping):
        return _size_based_paths(model, min_num_params=policy["min_num_params"])
    if policy == "auto":
        names = [n for n in no_split_module_classes(model) if any(type(m).__name__ == n for m in model.modules())]
        if names:
            classes = resolve_module_classes(model, names, key=key)
        else:
            block = largest_repeated_block_class(model)
            classes = {block} if block is not None else set()
        return _paths_of_classes(model, classes)
    if callable(policy) and not isinstance(policy, type):
        return [name for name, module in model.named_modules() if name and policy(module)]
    items = [policy] if isinstance(policy, type) else list(policy)
    return _paths_of_classes(model, resolve_module_classes(model, items, key=key))


def _paths_of_classes(model: nn.Module, classes: set[type[nn.Module]]) -> list[str]:
    return [name for name, module in model.named_modules() if name and isinstance(module, tuple(classes))]


def _size_based_paths(model: nn.Module, *, min_num_params: int) -> list[str]:
    selected: list[str] = []
    remaining: dict[str, int] = {}
    # named_modules is pre-order; reversed gives children before parents
    for name, module in reversed(list(model.named_modules())):
        own = sum(p.numel() for p in module.parameters(recurse=False))
        from_children = sum(remaining.get(f"{name}.{c}" if name else c, 0) for c, _ in module.named_children())
        total = own + from_children
        if name and total >= min_num_params:
            selected.append(name)
            total = 0
        remaining[name] = total
    return selected
