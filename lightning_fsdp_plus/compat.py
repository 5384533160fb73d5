"""Lightning's ``FSDPStrategy`` and FSDP1 arguments, mapped onto FSDP2.

``FSDPPlusOptions`` calls these converters while it validates, so ``strategy="fsdp"`` -> ``strategy="fsdp_plus"``
(or ``FSDPStrategy(...)`` -> ``FSDPPlusStrategy(...)`` with the same arguments) needs nothing else. Only what has
no FSDP2 meaning is refused, with the reason and the FSDP2 way. :data:`LIGHTNING_ARGUMENTS` documents every
mapping (rendered into docs/migrating.md by :func:`compat_markdown`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy

from lightning_fsdp_plus.plan import AUTO, ShardingStrategy
from lightning_fsdp_plus.policies import FSDP1Policy, is_fsdp1_policy
from lightning_fsdp_plus.precision import mixed_precision_from_mapping

BACKWARD_PREFETCH = ("BACKWARD_PRE", "BACKWARD_POST")
"""Values ``backward_prefetch`` accepts (names of FSDP1's ``BackwardPrefetch``)."""

LIGHTNING_ARGUMENTS: dict[str, str] = {
    "accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin":
        "as in every Lightning strategy; `FSDPPrecision` becomes `FSDPPlusPrecision` with the same preset",
    "process_group_backend, timeout": "the same (`timeout` defaults to 10 minutes instead of 30)",
    "sharding_strategy": "the same names, strings or FSDP1's enum; `_HYBRID_SHARD_ZERO2` = `HYBRID_SHARD` with"
        " `reshard_after_forward=False`",
    "auto_wrap_policy": "a set of classes, `ModuleWrapPolicy`, `CustomPolicy`, `transformer_auto_wrap_policy`,"
        " `size_based_auto_wrap_policy`, `lambda_auto_wrap_policy` or any FSDP1 policy: the modules it selects"
        " become FSDP2 units (`None` means the root only; our default is `\"auto\"`)",
    "activation_checkpointing, activation_checkpointing_policy":
        "the modules they select are checkpointed (torch's composable `checkpoint`)",
    "mixed_precision": "FSDP1's `MixedPrecision` -> `MixedPrecisionPolicy(param_dtype, reduce_dtype,"
        " cast_forward_inputs)`; FSDP2 does not cast buffers, so `buffer_dtype` is not applied (a warning says so);"
        " `keep_low_precision_grads=True` is refused",
    "cpu_offload": "`True` or `CPUOffload(offload_params=True)` -> `CPUOffloadPolicy`",
    "state_dict_type": "the same (`full` or `sharded`); our default is `sharded`",
    "device_mesh": "a `(replicate, shard)` tuple or a `DeviceMesh`",
    "process_group": "one group -> a 1-D mesh over it; `(intra-node, inter-node)` -> the 2-D HYBRID_SHARD mesh",
    "use_orig_params": "`True` only: FSDP2 always keeps the original parameters (`False` is refused)",
    "forward_prefetch": "explicit forward (and backward) prefetch of the neighbouring unit",
    "backward_prefetch": "`BACKWARD_PRE`/`BACKWARD_POST`: FSDP2's own backward prefetch; `None` is refused (FSDP2"
        " always prefetches one unit in backward)",
    "limit_all_gathers": "accepted; FSDP2 always limits in-flight all-gathers",
    "sync_module_states": "rank 0's parameters and buffers are broadcast before sharding",
    "param_init_fn": "called on every module still on the meta device after sharding",
    "ignored_modules, ignored_states": "FSDP2 `ignored_params`: replicated, not managed, gradients not reduced",
    "device_id": "must be the strategy's root device (FSDP2 places shards on the mesh's device)",
}  # fmt: skip
"""Each Lightning ``FSDPStrategy`` (or FSDP1 keyword) argument and what it means here."""

ALIASES = {
    "activation_checkpointing_policy": "activation_checkpointing",
    "process_group": "device_mesh",
    "ignored_states": "ignored_modules",
}
"""Lightning/FSDP1 argument names that set an option of another name."""


def options_kwargs(kwargs: Mapping[str, Any], *, fields: Iterable[str]) -> dict[str, Any]:
    """Rename aliases to option names; an unknown key raises a TypeError listing the valid ones."""
    known = set(fields)
    out: dict[str, Any] = {}
    given: dict[str, str] = {}  # option -> the argument that set it
    for key, value in kwargs.items():
        name = ALIASES.get(key, key)
        if name not in known:
            valid = ", ".join(sorted(known | set(ALIASES) | {"device_id"}))
            raise TypeError(f"FSDPPlusStrategy got an unexpected argument {key!r}; valid arguments: {valid}")
        if name in out:
            raise ValueError(
                f"{given[name]}=... and {key}=... are mutually exclusive (both set {name}); pass only one of them"
            )
        given[name] = key
        out[name] = value
    return out


def sharding_strategy_from(value: Any) -> tuple[ShardingStrategy | str, bool | None]:
    """Our strategy from a name, our enum or FSDP1's enum, and the ``reshard_after_forward`` it implies;
    ``"auto"`` (any case) stays ``"auto"`` (the auto plan chooses)."""
    from torch.distributed.fsdp import ShardingStrategy as FSDP1Strategy

    if isinstance(value, FSDP1Strategy):
        value = value.name
    if isinstance(value, str) and value.upper() == "_HYBRID_SHARD_ZERO2":
        return ShardingStrategy.HYBRID_SHARD, False
    if isinstance(value, str) and value.lower() == AUTO:
        return AUTO, None
    try:
        return ShardingStrategy.parse(value), None
    except ValueError as err:
        raise ValueError(f"{err}, or {AUTO} (the fastest that fits memory_budget)") from None


def wrap_policy_from(value: Any, *, key: str) -> Any:
    """Sets of classes become lists; ``ModuleWrapPolicy`` its classes; other FSDP1 policies an :class:`FSDP1Policy`."""
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    if isinstance(value, (set, frozenset)):
        return list(value)
    if isinstance(value, ModuleWrapPolicy):
        return list(value._module_classes)
    if is_fsdp1_policy(value):
        return FSDP1Policy(value)
    return value


def mixed_precision_from(value: Any) -> MixedPrecisionPolicy | None:
    """FSDP2's policy from a policy, FSDP1's ``MixedPrecision`` or a mapping (``None`` stays ``None``)."""
    from torch.distributed.fsdp import MixedPrecision

    if value is None or isinstance(value, MixedPrecisionPolicy):
        return value
    if isinstance(value, MixedPrecision):
        if value.keep_low_precision_grads:
            raise ValueError(
                "mixed_precision.keep_low_precision_grads=True has no FSDP2 meaning: gradients take the sharded"
                " parameters' dtype; store parameters in low precision instead (precision='bf16-true')"
            )
        if value.buffer_dtype is not None:
            rank_zero_warn(
                f"mixed_precision.buffer_dtype={value.buffer_dtype} is not applied: FSDP2 does not cast buffers"
            )
        return MixedPrecisionPolicy(param_dtype=value.param_dtype, reduce_dtype=value.reduce_dtype,
                                    cast_forward_inputs=value.cast_forward_inputs)  # fmt: skip
    return mixed_precision_from_mapping(value)


def cpu_offload_from(value: Any) -> Any:
    """``CPUOffload(offload_params=...)`` as a bool; other values are returned for the bool check."""
    from torch.distributed.fsdp import CPUOffload

    return value.offload_params if isinstance(value, CPUOffload) else value


def backward_prefetch_from(value: Any) -> str:
    """``BACKWARD_PRE``/``BACKWARD_POST`` from a name or FSDP1's enum; ``None`` has no FSDP2 meaning."""
    name = getattr(value, "name", value)
    if isinstance(name, str) and name.upper() in BACKWARD_PREFETCH:
        return name.upper()
    if value is None:
        raise ValueError(
            "backward_prefetch=None is not supported: FSDP2 always prefetches the next unit's all-gather in"
            f" backward; valid choices: {', '.join(BACKWARD_PREFETCH)}"
        )
    raise ValueError(f"backward_prefetch={value!r} is not one of {', '.join(BACKWARD_PREFETCH)}")


def device_mesh_from(value: Any) -> Any:
    """``None``, a ``(replicate, shard)`` tuple of positive ints, a ``DeviceMesh``, or process group(s)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    if value is None or isinstance(value, DeviceMesh):
        return value
    groups = value if isinstance(value, (tuple, list)) else (value,)
    if all(isinstance(g, dist.ProcessGroup) for g in groups) and len(groups) in (1, 2):
        return tuple(groups)
    positive = all(isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in groups)
    if isinstance(value, (tuple, list)) and len(value) == 2 and positive:
        return tuple(value)
    raise ValueError(
        f"device_mesh={value!r} must be a (replicate, shard) tuple of positive integers, a DeviceMesh,"
        " a process group or an (intra-node, inter-node) pair of them, or None"
    )


def ignored_from(value: Any) -> tuple[Any, ...] | None:
    """``ignored_modules`` / ``ignored_states`` as a tuple of modules, class names and parameters."""
    if value is None:
        return None
    items = [value] if isinstance(value, (nn.Module, str)) else list(value)
    for item in items:
        if not isinstance(item, (nn.Module, nn.Parameter, str)):
            raise ValueError(f"ignored_modules entry {item!r} is neither a module, a parameter nor a class name")
    return tuple(items)


def compat_markdown() -> str:
    """The docs' table of Lightning ``FSDPStrategy`` arguments and their meaning here (docs/migrating.md)."""
    rows = ["| `FSDPStrategy` argument | in fsdp_plus (FSDP2) |", "|---|---|"]
    for names, meaning in LIGHTNING_ARGUMENTS.items():
        rows.append(f"| {', '.join(f'`{n}`' for n in names.split(', '))} | {meaning} |")
    return "\n".join(rows) + "\n"
