"""The sharding plan: which modules become FSDP units, on which mesh, and what each rank holds.

The plan is pure data computed from the unwrapped model (`build_sharding_plan`), printed as a table on
rank 0 and then applied by `lightning_fsdp_plus.sharding.apply_sharding_plan`. Keeping it as data makes it
testable without process groups.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, field
from enum import Enum, EnumMeta
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy

from lightning_fsdp_plus.compile import compiled_paths

AUTO = "auto"
"""The ``sharding_strategy`` value that lets the auto plan (:mod:`lightning_fsdp_plus.autoplan`) choose."""


class _CaseInsensitiveNames(EnumMeta):
    """``ShardingStrategy["full_shard"]`` works too: OmegaConf looks enum members up by name this way."""

    def __getitem__(cls, name: str):  # type: ignore[override]
        return super().__getitem__(name.upper() if isinstance(name, str) else name)


class ShardingStrategy(str, Enum, metaclass=_CaseInsensitiveNames):
    """Sharding strategies, with the same names as Lightning's / FSDP1's ``ShardingStrategy``.

    How each maps onto FSDP2 (``fully_shard``):

    ============== ============================ ======================= ==================================
    strategy       device mesh                  reshard_after_forward   what each rank keeps between steps
    ============== ============================ ======================= ==================================
    FULL_SHARD     1-D ``(shard=N,)``           True                    1/N of params, grads, optimizer
    SHARD_GRAD_OP  1-D ``(shard=N,)``           False                   1/N at rest; full params from
                                                                        forward until backward (ZeRO-2)
    NO_SHARD       2-D ``(replicate=N, shard=1)`` False                 everything (DDP-like)
    HYBRID_SHARD   2-D ``(replicate=N/S, shard=S)`` True                1/S, replicated across N/S groups
    ============== ============================ ======================= ==================================
    """

    FULL_SHARD = "FULL_SHARD"
    SHARD_GRAD_OP = "SHARD_GRAD_OP"
    NO_SHARD = "NO_SHARD"
    HYBRID_SHARD = "HYBRID_SHARD"

    @classmethod
    def parse(cls, value: str | ShardingStrategy, *, key: str = "sharding_strategy") -> ShardingStrategy:
        """Parse a strategy name case-insensitively; the error names ``key``, the value and the choices."""
        if isinstance(value, cls):
            return value
        if isinstance(value, str) and value.upper() in cls.__members__:
            return cls[value]
        choices = ", ".join(cls.__members__)
        raise ValueError(f"{key}={value!r} is not one of {choices}")

    @property
    def reshard_after_forward(self) -> bool:
        """Whether FSDP2 frees the unsharded parameters after each unit's forward."""
        return self in (ShardingStrategy.FULL_SHARD, ShardingStrategy.HYBRID_SHARD)


@dataclass(frozen=True)
class MeshLayout:
    """Shape of the device mesh: ``replicate`` groups of ``shard`` ranks each (the data-parallel ranks), each rank
    one of ``tensor`` ranks that split every layer the tensor-parallel plan names."""

    replicate: int
    """Number of replica groups (1 for a 1-D mesh)."""
    shard: int
    """Ranks across which each parameter is sharded."""
    two_d: bool = False
    """Build a 2-D ``(replicate, shard)`` mesh (NO_SHARD, HYBRID_SHARD) rather than a 1-D ``(shard,)`` one."""
    tensor: int = 1
    """Tensor-parallel ranks (the innermost mesh dimension: neighbouring ranks, on one node)."""

    @property
    def data_parallel(self) -> int:
        """Data-parallel ranks: ``replicate x shard`` (each sees its own batches)."""
        return self.replicate * self.shard

    @property
    def world_size(self) -> int:
        """Total number of ranks in the mesh."""
        return self.replicate * self.shard * self.tensor


def resolve_mesh_layout(
    *, sharding_strategy: ShardingStrategy, world_size: int, hybrid_shard_size: int | None = None
) -> MeshLayout:
    """Mesh layout for a strategy at a world size; ``hybrid_shard_size`` must divide the world size."""
    if sharding_strategy is ShardingStrategy.NO_SHARD:
        return MeshLayout(replicate=world_size, shard=1, two_d=True)
    if sharding_strategy is ShardingStrategy.HYBRID_SHARD:
        size = world_size if hybrid_shard_size is None else hybrid_shard_size
        check_hybrid_shard_size(hybrid_shard_size=size, world_size=world_size)
        return MeshLayout(replicate=world_size // size, shard=size, two_d=True)
    return MeshLayout(replicate=1, shard=world_size)


def node_boundaries(layout: MeshLayout, *, ranks_per_node: int) -> str:
    """Where the mesh lies across nodes, for the plan's printout: ``2 node(s) x 1 rank(s): each shard group (1 rank)
    inside one node, replicas across nodes`` (or shard groups that span nodes: their all-gathers cross the link)."""
    nodes = max(1, layout.world_size // max(ranks_per_node, 1))
    head = f"{nodes} node(s) x {ranks_per_node} rank(s)"
    if layout.shard <= ranks_per_node and ranks_per_node % layout.shard == 0:
        return f"{head}: each shard group ({layout.shard} rank(s)) inside one node, replicas across nodes"
    return f"{head}: shard groups of {layout.shard} ranks span nodes (their all-gathers cross the inter-node link)"


def check_hybrid_shard_size(*, hybrid_shard_size: int, world_size: int) -> None:
    """Raise a ValueError naming the key, the value and the valid choices if it does not divide the world."""
    if isinstance(hybrid_shard_size, bool) or not isinstance(hybrid_shard_size, int) or hybrid_shard_size < 1:
        raise ValueError(f"hybrid_shard_size={hybrid_shard_size!r} must be a positive integer")
    if world_size % hybrid_shard_size:
        divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
        raise ValueError(
            f"hybrid_shard_size={hybrid_shard_size} does not divide the world size {world_size};"
            f" valid choices: {', '.join(map(str, divisors))}"
        )


@dataclass(frozen=True)
class ParamInfo:
    """One parameter as the plan sees it (names are those of the unwrapped model)."""

    name: str
    """Fully qualified parameter name."""
    shape: tuple[int, ...]
    """Full (unsharded) shape."""
    dtype: torch.dtype
    """Storage dtype."""
    trainable: bool
    """``requires_grad`` of the parameter."""
    sharded: bool
    """False when the parameter is kept out of FSDP (``ignored_params``) and replicated on every rank."""
    bytes_per_rank: int
    """Bytes each rank stores for it: the padded dim-0 chunk when sharded, everything when replicated."""

    @property
    def numel(self) -> int:
        """Number of elements of the full parameter."""
        return math.prod(self.shape)

    @property
    def kind(self) -> str:
        """``trainable``, ``frozen``, ``int8`` (LLM.int8 weights) or ``4bit`` (packed NF4/FP4 weights, two per byte)."""
        if self.trainable:
            return "trainable"
        return {torch.int8: "int8", torch.uint8: "4bit"}.get(self.dtype, "frozen")


@dataclass(frozen=True)
class FSDPUnit:
    """One ``fully_shard`` call: a module and the parameters it manages (not those of nested units)."""

    path: str
    """Module path inside the root (``""`` is the root)."""
    module_class: str
    """Class name of the module."""
    params: tuple[ParamInfo, ...]
    """Parameters owned by this unit."""
    reshard_after_forward: bool
    """FSDP2's ``reshard_after_forward`` for this unit."""

    @property
    def num_params(self) -> int:
        """Elements managed by this unit."""
        return sum(p.numel for p in self.params)

    @property
    def bytes_per_rank(self) -> int:
        """Parameter bytes each rank stores for this unit between steps."""
        return sum(p.bytes_per_rank for p in self.params)

    @property
    def dtypes(self) -> tuple[str, ...]:
        """Distinct storage dtypes, sorted."""
        return tuple(sorted({str(p.dtype).removeprefix("torch.") for p in self.params}))

    @property
    def kinds(self) -> tuple[str, ...]:
        """Distinct parameter kinds (trainable / frozen / int8 / 4bit), sorted."""
        return tuple(sorted({p.kind for p in self.params}))


@dataclass(frozen=True)
class TiedGroup:
    """Parameters that are one tensor under several names (tied weights) and the one unit that holds them.

    FSDP2 shards a parameter in the unit that manages it and swaps it in that unit's modules only, so every module
    using a tied tensor must sit in the same unit: the innermost unit holding all of them (at or above their lowest
    common ancestor). Units the wrap policy chose below it, around one of the names, are not made units.
    """

    names: tuple[str, ...]
    """Every name of the tensor (``named_parameters(remove_duplicate=False)`` order)."""
    unit: str
    """Path of the unit holding it (``""``: the root)."""
    merged: tuple[str, ...] = ()
    """Module paths the wrap policy chose that were left in ``unit`` because they would split the names."""


@dataclass(frozen=True)
class ShardingPlan:
    """Everything the strategy will do to the model, computed before anything is done."""

    sharding_strategy: ShardingStrategy
    """The strategy the plan implements."""
    mesh: MeshLayout
    """Device-mesh layout."""
    units: tuple[FSDPUnit, ...]
    """FSDP units in application order: children before parents, the root last."""
    replicated: tuple[ParamInfo, ...] = ()
    """Parameters kept out of FSDP and replicated on every rank."""
    activation_checkpointing: tuple[str, ...] = field(default=())
    """Module paths whose forward is recomputed in backward."""
    checkpointing_mode: str = "full"
    """``full`` (recompute each checkpointed module's whole forward) or ``selective`` (keep matmul and attention
    outputs, recompute the rest)."""
    mp_policy: MixedPrecisionPolicy = field(default_factory=MixedPrecisionPolicy)
    """FSDP2's mixed-precision policy for every unit."""
    cpu_offload: bool = False
    """FSDP2's ``CPUOffloadPolicy`` for every unit (only ever true on an accelerator)."""
    forward_prefetch: bool = False
    """Explicit prefetch of the neighbouring unit in forward and backward."""
    tied: tuple[TiedGroup, ...] = ()
    """Tied parameters (one tensor, several names) and the unit each group was kept in."""
    float_layers: tuple[tuple[str, str], ...] = ()
    """With ``quantize_base``: ``(path, why)`` of every frozen linear layer left in float (an output head, a tied
    weight, a ``quantize_skip`` match, a ``nn.Linear`` subclass with its own forward)."""
    compile: Any = None
    """The :class:`~lightning_fsdp_plus.compile.CompileSpec` units are compiled with (``None``: eager)."""
    compiled: tuple[str, ...] = ()
    """Paths of the unit modules whose ``forward`` is compiled (every unit but the root, or the root alone)."""
    edge_units: tuple[str, ...] = ()
    """Units the ``auto`` policy made of the input embeddings and the output head (torchtitan's layout)."""
    auto_plan: Any = None
    """With ``sharding_strategy="auto"``: the :class:`~lightning_fsdp_plus.autoplan.AutoPlan` this plan was chosen by
    (every candidate, its predictions, the choice)."""

    @property
    def bytes_per_rank(self) -> int:
        """Parameter bytes per rank between steps, sharded and replicated together."""
        return sum(u.bytes_per_rank for u in self.units) + sum(p.bytes_per_rank for p in self.replicated)

    def unit(self, path: str) -> FSDPUnit:
        """The unit at ``path``; KeyError lists the unit paths."""
        for unit in self.units:
            if unit.path == path:
                return unit
        raise KeyError(f"no FSDP unit at {path!r}; units: {[u.path for u in self.units]}")

    def to_dict(self) -> dict:
        """JSON-friendly description (for logs, metrics and tests)."""
        return {
            "sharding_strategy": self.sharding_strategy.value,
            "mesh": {"replicate": self.mesh.replicate, "shard": self.mesh.shard, "tensor": self.mesh.tensor},
            "units": [
                {
                    "path": u.path or "<root>",
                    "class": u.module_class,
                    "num_params": u.num_params,
                    "dtypes": list(u.dtypes),
                    "kinds": list(u.kinds),
                    "bytes_per_rank": u.bytes_per_rank,
                    "reshard_after_forward": u.reshard_after_forward,
                }
                for u in self.units
            ],
            "replicated": [{"name": p.name, "bytes_per_rank": p.bytes_per_rank} for p in self.replicated],
            "activation_checkpointing": list(self.activation_checkpointing),
            "checkpointing_mode": self.checkpointing_mode,
            "mixed_precision": {k: _dtype_name(getattr(self.mp_policy, k)) for k in _POLICY_FIELDS},
            "cpu_offload": self.cpu_offload,
            "forward_prefetch": self.forward_prefetch,
            "tied": [{"names": list(t.names), "unit": t.unit or "<root>", "merged": list(t.merged)} for t in self.tied],
            "float_layers": dict(self.float_layers),
            "compile": None if self.compile is None else self.compile.describe(),
            "compiled": [p or "<root>" for p in self.compiled],
            "edge_units": list(self.edge_units),
            "bytes_per_rank": self.bytes_per_rank,
            "auto_plan": None if self.auto_plan is None else self.auto_plan.to_dict(),
        }

    def format_table(self) -> str:
        """The plan as a fixed-width table, one row per unit plus one for replicated parameters."""
        header = ("unit", "class", "params", "dtypes", "kinds", "placement", "bytes/rank", "reshard")
        placement = "sharded" if self.mesh.shard > 1 else "replicated"
        rows = [
            (
                u.path or "<root>",
                u.module_class,
                f"{u.num_params:,}",
                ",".join(u.dtypes),
                ",".join(u.kinds),
                f"{placement} 1/{self.mesh.shard}",
                f"{u.bytes_per_rank:,}",
                "yes" if u.reshard_after_forward else "no",
            )
            for u in self.units
        ]
        if self.replicated:
            rows.append(
                (
                    "<ignored by FSDP>",
                    "-",
                    f"{sum(p.numel for p in self.replicated):,}",
                    ",".join(sorted({str(p.dtype).removeprefix("torch.") for p in self.replicated})),
                    ",".join(sorted({p.kind for p in self.replicated})),
                    "replicated",
                    f"{sum(p.bytes_per_rank for p in self.replicated):,}",
                    "-",
                )
            )
        widths = [max(len(str(r[i])) for r in (header, *rows)) for i in range(len(header))]
        line = lambda r: "  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()  # noqa: E731
        mesh = f"replicate={self.mesh.replicate} x shard={self.mesh.shard}"
        if self.mesh.tensor > 1:
            mesh += f" x tensor={self.mesh.tensor}"
        title = f"Sharding plan: {self.sharding_strategy.value}, mesh {mesh}, {len(self.units)} FSDP units"
        body = [line(header), line(tuple("-" * w for w in widths)), *map(line, rows)]
        root = self.units[-1]
        if not root.reshard_after_forward and any(u.reshard_after_forward for u in self.units[:-1]):
            body.append(
                f"root kept gathered from forward to backward: +{root.num_params:,} params' gathered copy at the"
                " end of forward, one all-gather fewer per step (reshard_root_after_forward=True frees it)"
            )
        if self.edge_units:
            body.append(f"embeddings and output head in units of their own: {', '.join(self.edge_units)}")
        if self.activation_checkpointing:
            selective = (
                " (selective: matmul and attention outputs kept)" if self.checkpointing_mode == "selective" else ""
            )
            body.append(f"activation checkpointing{selective}: {', '.join(self.activation_checkpointing)}")
        if self.compile is not None:
            body.append(f"compiled ({self.compile.describe()}, each unit's forward):"
                        f" {', '.join(p or '<root>' for p in self.compiled)}")  # fmt: skip
        for group in self.tied:
            merged = f" ({', '.join(group.merged)}: not a unit, it would split them)" if group.merged else ""
            body.append(f"tied weights: {' = '.join(group.names)} in unit {group.unit or '<root>'}{merged}")
        if self.float_layers:
            kept = "; ".join(f"{path} ({why})" for path, why in self.float_layers)
            body.append(f"not quantized (frozen, kept in float): {kept}")
        policy = ", ".join(f"{k} {_dtype_name(getattr(self.mp_policy, k))}" for k in _POLICY_FIELDS[:2])
        prefetch = "explicit" if self.forward_prefetch else "implicit"
        offload = "yes" if self.cpu_offload else "no"
        body.append(f"mixed precision: {policy}; cpu offload: {offload}; prefetch: {prefetch}")
        body.append(f"total parameter bytes per rank: {self.bytes_per_rank:,}")
        return "\n".join([title, *body])


_POLICY_FIELDS = ("param_dtype", "reduce_dtype", "output_dtype", "cast_forward_inputs")


def _dtype_name(value: object) -> object:
    """``bfloat16`` for a dtype, ``-`` for None (the stored dtype), the value otherwise."""
    if value is None:
        return "-"
    return str(value).removeprefix("torch.") if isinstance(value, torch.dtype) else value


def sharded_numel(shape: Sequence[int], shard: int) -> int:
    """Elements one rank stores for a parameter sharded on dim 0 across ``shard`` ranks (FSDP2 pads dim 0)."""
    dims = tuple(shape) or (1,)
    return math.ceil(dims[0] / shard) * math.prod(dims[1:])


def _local_shape(param: torch.Tensor) -> tuple[int, ...]:
    """A tensor-parallel (DTensor) parameter's share on this rank, which FSDP2 then shards; else the whole shape."""
    from torch.distributed.tensor import DTensor

    return tuple(param.to_local().shape if isinstance(param, DTensor) else param.shape)


def sharded_bytes(shape: Sequence[int], dtype: torch.dtype, shard: int) -> int:
    """Bytes one rank stores for a parameter sharded on dim 0 across ``shard`` ranks (FSDP2 pads dim 0)."""
    return sharded_numel(shape, shard) * dtype.itemsize


def build_sharding_plan(
    model: nn.Module,
    *,
    unit_paths: Iterable[str],
    edge_units: Iterable[str] = (),
    sharding_strategy: ShardingStrategy,
    mesh: MeshLayout,
    ignored_params: Collection[nn.Parameter] = (),
    activation_checkpointing: Iterable[str] = (),
    checkpointing_mode: str = "full",
    reshard_after_forward: bool | None = None,
    reshard_root_after_forward: bool = False,
    mp_policy: MixedPrecisionPolicy | None = None,
    cpu_offload: bool = False,
    forward_prefetch: bool = False,
    keep_tied_together: bool = True,
    float_layers: Iterable[tuple[str, str]] = (),
    compile: Any = None,
) -> ShardingPlan:
    """Compute the plan: ``unit_paths`` (besides the root, which is always a unit) become FSDP units.

    A parameter belongs to the innermost unit whose subtree holds it, as with nested ``fully_shard`` calls.
    Parameters in ``ignored_params`` are replicated and listed separately. ``reshard_after_forward`` defaults
    to the strategy's rule; the root reshards too only with ``reshard_root_after_forward`` (else FSDP2 keeps it
    gathered from forward to backward, its default for the root); the policy, offload and prefetch settings travel
    with the plan to ``fully_shard``.
    Tied parameters stay in one unit (:class:`TiedGroup`): unit paths that would split them are dropped, unless
    ``keep_tied_together`` is false (describing units that exist already). ``float_layers`` (the frozen linear
    layers quantization left in float, with why) are recorded and printed. ``edge_units`` (the embeddings and the
    output head) become units like ``unit_paths`` but are not compiled.
    """
    reshard = sharding_strategy.reshard_after_forward if reshard_after_forward is None else reshard_after_forward
    edges = [p for p in edge_units if p]
    paths = {p for p in [*unit_paths, *edges] if p}
    modules = dict(model.named_modules())
    unknown = sorted(paths - modules.keys())
    if unknown:
        raise ValueError(f"unit paths not found in the model: {unknown}")
    ignored_ids = {id(p) for p in ignored_params}
    paths, tied = keep_tied_in_one_unit(model, paths, ignored_ids=ignored_ids, merge=keep_tied_together)
    owner: dict[str, list[ParamInfo]] = {path: [] for path in [*paths, ""]}
    replicated: list[ParamInfo] = []
    for name, param in model.named_parameters():
        is_ignored = id(param) in ignored_ids
        info = ParamInfo(
            name=name,
            shape=tuple(param.shape),
            dtype=param.dtype,
            trainable=param.requires_grad,
            sharded=not is_ignored,
            bytes_per_rank=(
                param.numel() * param.element_size()
                if is_ignored
                else sharded_bytes(_local_shape(param), param.dtype, mesh.shard)
            ),
        )
        if is_ignored:
            replicated.append(info)
            continue
        owner[_innermost_unit(name, paths)].append(info)
    # post-order: deeper units first so that nested fully_shard calls happen before their parents'
    ordered = sorted(paths, key=lambda p: (-p.count("."), list(modules).index(p)))
    units = tuple(
        FSDPUnit(
            path=path,
            module_class=type(modules[path]).__name__,
            params=tuple(owner[path]),
            reshard_after_forward=reshard and (bool(path) or reshard_root_after_forward),
        )
        for path in [*ordered, ""]
    )
    return ShardingPlan(
        sharding_strategy=sharding_strategy,
        mesh=mesh,
        units=units,
        replicated=tuple(replicated),
        activation_checkpointing=tuple(activation_checkpointing),
        checkpointing_mode=checkpointing_mode,
        mp_policy=mp_policy or MixedPrecisionPolicy(),
        cpu_offload=cpu_offload,
        forward_prefetch=forward_prefetch,
        tied=tied,
        float_layers=tuple(float_layers),
        compile=compile,
        compiled=compiled_paths(u.path for u in units if u.path not in edges) if compile is not None else (),
        edge_units=tuple(p for p in edges if p in paths),
    )


def tied_parameters(model: nn.Module) -> list[tuple[nn.Parameter, tuple[str, ...]]]:
    """Every parameter known under more than one name, with its names."""
    names: dict[int, list[str]] = {}
    params: dict[int, nn.Parameter] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
        params[id(param)] = param
    return [(params[key], tuple(group)) for key, group in names.items() if len(group) > 1]


def keep_tied_in_one_unit(
    model: nn.Module, paths: set[str], *, ignored_ids: Collection[int] = (), merge: bool = True
) -> tuple[set[str], tuple[TiedGroup, ...]]:
    """``paths`` without the units that would split a tied parameter's names (when ``merge``), and the groups.

    A unit path below the names' lowest common ancestor that holds one of them is dropped: its parameters then
    belong to the unit above, where every module using the tensor is. Replicated (ignored) parameters are not
    sharded by FSDP and need nothing.
    """
    found = [(param, names) for param, names in tied_parameters(model) if id(param) not in ignored_ids]
    merged: list[tuple[str, ...]] = []
    for _, names in found:
        owners = [name.rpartition(".")[0] for name in names]
        ancestor = _common_ancestor(owners)
        split = sorted(p for p in paths if _strictly_below(p, ancestor) and any(_within(o, p) for o in owners))
        if merge:
            paths = paths - set(split)
        merged.append(tuple(split) if merge else ())
    groups = tuple(
        TiedGroup(names=names, unit=_innermost_unit(names[0], paths), merged=split)
        for (_, names), split in zip(found, merged, strict=True)
    )
    return paths, groups


def _common_ancestor(paths: Sequence[str]) -> str:
    """The deepest module path that every one of ``paths`` is at or below (``""``: the root)."""
    parts = [p.split(".") if p else [] for p in paths]
    common = []
    for level in zip(*parts, strict=False):
        if len(set(level)) != 1:
            break
        common.append(level[0])
    return ".".join(common)


def _within(path: str, ancestor: str) -> bool:
    """Whether module ``path`` is ``ancestor`` or inside it."""
    return not ancestor or path == ancestor or path.startswith(ancestor + ".")


def _strictly_below(path: str, ancestor: str) -> bool:
    return path != ancestor and _within(path, ancestor)


def _innermost_unit(param_name: str, unit_paths: Collection[str]) -> str:
    parts = param_name.split(".")[:-1]
    for depth in range(len(parts), 0, -1):
        candidate = ".".join(parts[:depth])
        if candidate in unit_paths:
            return candidate
    return ""
