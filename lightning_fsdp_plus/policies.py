"""Wrap-policy resolution: which submodules become FSDP units (and which get activation checkpointing).

Accepted ``auto_wrap_policy`` values:

- ``"auto"``: the classes in transformers' ``_no_split_modules`` of any ``PreTrainedModel`` inside the
  model; otherwise torch's own blocks (``nn.TransformerEncoderLayer``, ``nn.TransformerDecoderLayer``: an
  ``nn.Transformer`` has both) where the model has them, else the repeated module class with the most parameters
  per instance (a transformer block). With
  it the strategy also makes the input embeddings and output head units of their own
  (:func:`embedding_unit_paths`, applied in :func:`~lightning_fsdp_plus.pipeline.plan_model`).
- a list of module classes or class names, resolved against the model's own classes;
- ``{"min_num_params": N}``: bottom-up, a module becomes a unit when it holds at least N parameters
  not already in a nested unit (FSDP1's size-based policy);
- a callable ``(module) -> bool``;
- an FSDP1 policy (``ModuleWrapPolicy``, ``CustomPolicy``, ``functools.partial(transformer_auto_wrap_policy, ...)``,
  any ``(module, recurse, nonwrapped_numel) -> bool`` function), wrapped in :class:`FSDP1Policy`: the modules
  FSDP1 would wrap become units;
- ``None``: only the root is a unit.

The root is always a unit and is never returned here.
"""

from __future__ import annotations

import inspect
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Literal, TypeAlias

from torch import nn

WrapPolicy: TypeAlias = (
    Literal["auto"] | Sequence[type[nn.Module] | str] | Mapping[str, int] | Callable[[nn.Module], bool] | None
)
"""Everything ``auto_wrap_policy`` accepts."""

_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)
TORCH_BLOCKS: tuple[type[nn.Module], ...] = (nn.TransformerEncoderLayer, nn.TransformerDecoderLayer)
"""torch's transformer blocks: units under ``"auto"`` wherever a model has them (subclasses included)."""


def is_fsdp1_policy(value: Any) -> bool:
    """An FSDP1 ``_Policy`` object, or a function taking FSDP1's ``recurse`` / ``nonwrapped_numel`` arguments."""
    from lightning_fsdp_plus._private import fsdp1_policy_base

    if isinstance(value, fsdp1_policy_base()):
        return True
    if not callable(value) or isinstance(value, (type, FSDP1Policy)):
        return False
    try:
        parameters = inspect.signature(value).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.name in ("recurse", "nonwrapped_numel") or p.kind is p.VAR_KEYWORD for p in parameters)


class FSDP1Policy:
    """An FSDP1 auto-wrap policy; the modules FSDP1 would wrap (the root aside) become FSDP2 units.

    ``_Policy`` objects are run with their own ``_run_policy``; legacy functions with FSDP1's own recursive
    walk (``_recursive_wrap``), whose wrapper only records the modules it is handed.
    """

    def __init__(self, policy: Any) -> None:
        self.policy = policy

    def unit_paths(self, model: nn.Module) -> list[str]:
        """Module paths FSDP1 would wrap under this policy, root excluded."""
        from lightning_fsdp_plus._private import fsdp1_policy_base, fsdp1_recursive_wrap

        if isinstance(self.policy, fsdp1_policy_base()):
            chosen = set(self.policy._run_policy(model, set(), {}))
        else:
            chosen = set()

            def record(module: nn.Module, **_: Any) -> nn.Module:
                chosen.add(module)
                return module

            fsdp1_recursive_wrap()(model, self.policy, record, set(), set(), only_wrap_children=True)
        return [name for name, module in model.named_modules() if name and module in chosen]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, FSDP1Policy) and other.policy is self.policy

    def __hash__(self) -> int:
        return hash(id(self.policy))

    def __repr__(self) -> str:
        return f"FSDP1Policy({self.policy!r})"


def validate_wrap_policy(policy: Any, *, key: str = "auto_wrap_policy") -> None:
    """Check the shape of a policy without a model; raises ValueError naming ``key`` and the choices."""
    if policy is None or isinstance(policy, FSDP1Policy) or (callable(policy) and not isinstance(policy, type)):
        return
    if isinstance(policy, str) and policy == "auto":
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

    A name matches a class's ``__name__`` or its ``module.qualname``, or those of a class it derives from (a unit
    FSDP2 already sharded is an ``FSDP<Name>`` subclass: a fit after validate plans again). Unknown names raise a
    ValueError that lists the candidate classes found in the model.
    """
    present = {type(m) for m in model.modules()}
    resolved: set[type[nn.Module]] = set()
    for item in classes:
        if isinstance(item, type):
            resolved.add(item)
            continue
        # through the MRO: after a first setup FSDP2 has swapped each unit's class for its ``FSDP<Name>`` subclass
        matches = {c for c in present
                   if any(item in (k.__name__, f"{k.__module__}.{k.__qualname__}") for k in c.__mro__)}  # fmt: skip
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
    if isinstance(policy, FSDP1Policy):
        return policy.unit_paths(model)
    if isinstance(policy, Mapping):
        return _size_based_paths(model, min_num_params=policy["min_num_params"])
    if policy == "auto":
        names = [n for n in no_split_module_classes(model) if any(type(m).__name__ == n for m in model.modules())]
        torch_blocks = {cls for cls in TORCH_BLOCKS if any(isinstance(m, cls) for m in model.modules())}
        if names:
            classes = resolve_module_classes(model, names, key=key)
        elif torch_blocks:  # the largest repeated class would take only nn.Transformer's decoder layers
            classes = torch_blocks
        else:
            block = largest_repeated_block_class(model)
            classes = {block} if block is not None else set()
        return _paths_of_classes(model, classes)
    if callable(policy) and not isinstance(policy, type):
        return [name for name, module in model.named_modules() if name and policy(module)]
    items = [policy] if isinstance(policy, type) else list(policy)
    return _paths_of_classes(model, resolve_module_classes(model, items, key=key))


def embedding_unit_paths(model: nn.Module) -> list[str]:
    """Paths of the input embeddings and output head of every transformers-style model inside ``model``
    (``get_input_embeddings()`` / ``get_output_embeddings()``, when they are a ``nn.Embedding`` / ``nn.Linear``
    holding parameters), in module order."""
    found: set[int] = set()
    for module in model.modules():
        for getter, kind in (("get_input_embeddings", nn.Embedding), ("get_output_embeddings", nn.Linear)):
            fn = getattr(type(module), getter, None)
            if fn is None:
                continue
            try:
                layer = getattr(module, getter)()
            except (AttributeError, NotImplementedError):
                continue
            if isinstance(layer, kind) and any(True for _ in layer.parameters()):
                found.add(id(layer))
    return [name for name, module in model.named_modules() if name and id(module) in found]


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
