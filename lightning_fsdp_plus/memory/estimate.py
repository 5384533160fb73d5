"""Per-rank memory estimator: will this model fit, under which sharding strategy?

The estimate is arithmetic over the model's parameters grouped the way the strategy groups them
(the same wrap policy, LoRA application and int8 conversion, run on a FakeTensor model that takes no
memory), with bytes per element from :mod:`~lightning_fsdp_plus.memory.assumptions`. Per rank it gives:

* ``params`` / ``grads`` / ``optimizer``: sharded (÷ shard size) or replicated storage;
* ``unsharded_params``: compute copies alive from forward to backward (SHARD_GRAD_OP, NO_SHARD);
* ``model_state_bytes_per_rank``: the larger of the two moments a step peaks at — end of forward
  (stored + optimizer + kept compute copies) and end of backward (stored + optimizer + gradients);
* ``activation_bytes_per_rank``: storages autograd saves in one forward of ``batch_size x seq_len``,
  counted on a FakeTensor forward (CPU kernels' choices: fused CUDA attention saves less);
* ``largest_unit_transient_bytes``: what one unit adds while its backward runs (its all-gathered
  parameters for FULL/HYBRID_SHARD, and its unsharded gradients before the reduce-scatter);
* ``peak_bytes_per_rank``: max(end of forward + activations, end of backward) — what ``MemoryMonitor``
  measures as its tensor-accounted peak — and ``peak_with_transient_bytes_per_rank``.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins.precision.utils import _DtypeContextManager
from torch import nn

from lightning_fsdp_plus.lora import apply_lora, frozen_parameters
from lightning_fsdp_plus.memory.assumptions import OPTIMIZER_STATES, PRECISION_BYTES, PrecisionBytes
from lightning_fsdp_plus.memory.monitor import SavedActivations
from lightning_fsdp_plus.plan import (
    MeshLayout,
    ParamInfo,
    ShardingStrategy,
    build_sharding_plan,
    resolve_mesh_layout,
    sharded_numel,
)
from lightning_fsdp_plus.policies import WrapPolicy, select_unit_paths
from lightning_fsdp_plus.precision import FSDPPlusPrecision, compute_dtype
from lightning_fsdp_plus.sharding import apply_activation_checkpointing

STRATEGY_CHOICES = ("all", *ShardingStrategy.__members__)
"""Valid ``strategy`` values: a strategy name (any case) or ``all``."""


class EstimateError(ValueError):
    """Bad estimator input; the message names the key, the bad value and the valid choices."""


@dataclass(frozen=True)
class ModelDescription:
    """The model as the estimator sees it: parameters by FSDP unit, replicated ones apart."""

    units: tuple[tuple[ParamInfo, ...], ...]
    """Parameters of each FSDP unit (root last); ``ParamInfo.shape`` is the full shape."""
    replicated: tuple[ParamInfo, ...] = ()
    """Parameters kept whole on every rank (the frozen base under ``lora_only``)."""
    units_known: bool = True
    """False when only a parameter count was given (no per-unit transient then)."""
    activation_bytes: int | None = None
    """Saved-for-backward bytes of one forward at the requested batch x sequence, if counted."""
    recompute_bytes: int = 0
    """With activation checkpointing: what one checkpointed unit saves again while its backward recomputes it."""
    source: str = ""
    """Where the description came from (a config path, a module class, a parameter count)."""

    def _all(self) -> Iterable[ParamInfo]:
        return (p for unit in (*self.units, self.replicated) for p in unit)

    @property
    def total_params(self) -> int:
        """All parameter elements (int8 weights and their scales included)."""
        return sum(p.numel for p in self._all())

    @property
    def trainable_params(self) -> int:
        """Elements that train."""
        return sum(p.numel for p in self._all() if p.trainable)

    def to_dict(self) -> dict[str, Any]:
        """A summary for JSON output."""
        largest = max((sum(p.numel for p in u) for u in self.units), default=0) if self.units_known else None
        return {
            "source": self.source,
            "total_params": self.total_params,
            "trainable_params": self.trainable_params,
            "num_units": len(self.units) if self.units_known else None,
            "largest_unit_params": largest,
            "replicated_params": sum(p.numel for p in self.replicated),
            "activation_bytes": self.activation_bytes,
            "recompute_bytes": self.recompute_bytes,
        }


@dataclass(frozen=True)
class ModelSetup:
    """How the strategy prepares a config's model, and the batch one forward sees."""

    lora: Any = None
    """LoRA settings (``peft.LoraConfig`` or its fields); None trains every parameter."""
    lora_only: bool = False
    """Replicate the frozen base (``ignored_params``); shard only what trains."""
    quantize_base: str | None = None
    """``"int8"``: frozen linear layers become ``Int8Linear``."""
    quantize_skip: tuple[str, ...] = ("lm_head",)
    """Layers int8 leaves alone (as ``FSDPPlusStrategy.quantize_skip``)."""
    auto_wrap_policy: WrapPolicy = "auto"
    """How FSDP units are chosen (as ``FSDPPlusStrategy.auto_wrap_policy``)."""
    activation_checkpointing: bool = False
    """Checkpoint every unit but the root."""
    batch_size: int = 1
    """Sequences per rank in the forward that counts activations."""
    seq_len: int = 2048
    """Tokens per sequence in that forward."""
    padded: bool = False
    """Give that batch an attention mask with a padded position (the masked attention path)."""


@dataclass(frozen=True)
class MemoryEstimate:
    """Estimated bytes per rank for one strategy at one world size (see the module docstring)."""

    sharding_strategy: str
    """The strategy name."""
    world_size: int
    """Ranks in the job."""
    shard_size: int
    """Ranks each parameter is sharded across (1 for NO_SHARD, S for HYBRID_SHARD)."""
    params: int
    """Stored parameters: local shards plus replicated parameters."""
    unsharded_params: int
    """Compute copies kept from forward to backward."""
    grads: int
    """Gradient shards."""
    optimizer: int
    """Optimizer state shards."""
    model_state_bytes_per_rank: int
    """Peak of parameters + unsharded copies + gradients + optimizer state over the step."""
    activation_bytes_per_rank: int | None
    """Saved activations of one forward (None: no architecture to run)."""
    largest_unit_transient_bytes: int | None
    """Extra bytes while the largest unit's backward runs (None: units unknown)."""
    peak_bytes_per_rank: int | None
    """max(end of forward + activations, end of backward): the tensor-accounted peak."""
    peak_with_transient_bytes_per_rank: int | None
    """``peak_bytes_per_rank`` plus the transient."""
    host_bytes_per_rank: int = 0
    """With ``cpu_offload``: the stored parameters, gradients and optimizer state in host memory."""
    simulated: dict[str, int] | None = field(default=None)
    """With ``simulate``: torch's FSDP2 memory tracker's peak by category on a fake process group."""

    def to_dict(self) -> dict[str, Any]:
        """All fields (bytes as integers)."""
        return asdict(self)


def _precision_bytes(precision: str) -> PrecisionBytes:
    if precision not in PRECISION_BYTES:
        raise EstimateError(f"precision={precision!r} is not one of {', '.join(PRECISION_BYTES)}")
    return PRECISION_BYTES[precision]


def _optimizer_states(optimizer: str) -> int:
    if optimizer.lower() not in OPTIMIZER_STATES:
        raise EstimateError(f"optimizer={optimizer!r} is not one of {', '.join(OPTIMIZER_STATES)}")
    return OPTIMIZER_STATES[optimizer.lower()]


def check_positive(value: Any, *, key: str, meaning: str) -> int:
    """A positive integer, or an EstimateError naming the key and what it counts."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise EstimateError(f"{key}={value!r} must be a positive integer ({meaning})")
    return value


def parse_strategies(value: str | Sequence[str]) -> list[ShardingStrategy]:
    """``all``, one name or several (any case) as strategies; an EstimateError lists the choices."""
    names = [value] if isinstance(value, str) else list(value)
    if any(str(n).lower() == "all" for n in names):
        return list(ShardingStrategy)
    try:
        return [ShardingStrategy.parse(n, key="strategy") for n in names]
    except ValueError as err:
        raise EstimateError(f"{err} (or all)") from None


def _elements(info: ParamInfo, shard: int) -> int:
    """Elements of ``info`` one rank stores: its padded dim-0 shard, or all of it when replicated."""
    return sharded_numel(info.shape, shard) if info.sharded else info.numel


def _per_element(info: ParamInfo, float_bytes: int) -> int:
    return float_bytes if info.dtype.is_floating_point else info.dtype.itemsize


def estimate_strategy(
    model: ModelDescription,
    *,
    sharding_strategy: ShardingStrategy,
    world_size: int,
    precision: str = "bf16-mixed",
    optimizer: str = "adamw",
    hybrid_shard_size: int | None = None,
    cpu_offload: bool = False,
) -> MemoryEstimate:
    """Bytes per rank for one strategy at one world size."""
    check_positive(world_size, key="world_size", meaning="the number of ranks")
    pb, states = _precision_bytes(precision), _optimizer_states(optimizer)
    try:
        shard = resolve_mesh_layout(
            sharding_strategy=sharding_strategy, world_size=world_size, hybrid_shard_size=hybrid_shard_size
        ).shard
    except ValueError as err:
        raise EstimateError(str(err)) from None
    everything = [(p, shard) for unit in model.units for p in unit] + [(p, 1) for p in model.replicated]
    stored = sum(_elements(p, s) * _per_element(p, pb.stored) for p, s in everything)
    grads = sum(_elements(p, s) * pb.grad for p, s in everything if p.trainable)
    opt = sum(_elements(p, s) * states * pb.state for p, s in everything if p.trainable)

    def compute_copy(unit: Iterable[ParamInfo]) -> int:
        return sum(p.numel * _per_element(p, pb.compute) for p in unit)

    def unsharded_grads(unit: Iterable[ParamInfo]) -> int:
        return sum(p.numel * pb.compute for p in unit if p.trainable)

    kept = 0 if sharding_strategy.reshard_after_forward else sum(compute_copy(u) for u in model.units)
    transient = None
    if model.units_known and model.units:
        regather = sharding_strategy.reshard_after_forward
        transient = max(unsharded_grads(u) + (compute_copy(u) if regather else 0) for u in model.units)
        transient += model.recompute_bytes
    host = 0
    if cpu_offload:  # FSDP2's CPUOffloadPolicy keeps the sharded state in host memory
        host, stored, grads, opt = stored + grads + opt, 0, 0, 0
    end_of_forward, end_of_backward = stored + opt + kept, stored + opt + grads
    act = model.activation_bytes
    peak = None if act is None else max(end_of_forward + act, end_of_backward)
    return MemoryEstimate(
        sharding_strategy=sharding_strategy.value,
        world_size=world_size,
        shard_size=shard,
        params=stored,
        unsharded_params=kept,
        grads=grads,
        optimizer=opt,
        model_state_bytes_per_rank=max(end_of_forward, end_of_backward),
        activation_bytes_per_rank=act,
        largest_unit_transient_bytes=transient,
        peak_bytes_per_rank=peak,
        peak_with_transient_bytes_per_rank=None if peak is None or transient is None else peak + transient,
        host_bytes_per_rank=host,
    )


# ---- describing a model ------------------------------------------------------------------------------
def describe_module(
    model: nn.Module,
    *,
    lora_only: bool = False,
    auto_wrap_policy: WrapPolicy = "auto",
    activation_bytes: int | None = None,
    source: str = "",
) -> ModelDescription:
    """Group a (real or fake) model's parameters as the strategy would: units from the wrap policy,
    the frozen parameters replicated under ``lora_only``. Apply LoRA / int8 before calling."""
    plan = build_sharding_plan(
        model,
        unit_paths=select_unit_paths(model, auto_wrap_policy),
        sharding_strategy=ShardingStrategy.FULL_SHARD,
        mesh=MeshLayout(replicate=1, shard=1),
        ignored_params=frozen_parameters(model) if lora_only else (),
    )
    return ModelDescription(
        units=tuple(u.params for u in plan.units),
        replicated=plan.replicated,
        activation_bytes=activation_bytes,
        source=source or type(model).__name__,
    )


def describe_param_count(
    params: float,
    *,
    trainable_fraction: float = 1.0,
    quantize_base: str | None = None,
    lora_only: bool = False,
) -> ModelDescription:
    """A model known only by its size: one block of ``params`` elements, ``trainable_fraction`` of them train.

    With ``quantize_base="int8"`` the frozen part is int8 (scales ignored: < 0.1% for hidden sizes ≥ 4096).
    """
    if isinstance(params, bool) or not isinstance(params, (int, float)) or not params >= 1:
        raise EstimateError(f"params={params!r} must be a positive number of parameters (e.g. 7.5e9)")
    if not 0.0 <= trainable_fraction <= 1.0:
        raise EstimateError(f"trainable_fraction={trainable_fraction!r} must be between 0 and 1")
    total = int(params)
    trainable = round(total * trainable_fraction)
    frozen_dtype = torch.int8 if quantize_base == "int8" else torch.float32
    infos = [ParamInfo("trainable", (trainable,), torch.float32, True, True, 0)] if trainable else []
    frozen = (
        [ParamInfo("frozen", (total - trainable,), frozen_dtype, False, not lora_only, 0)] if trainable < total else []
    )
    return ModelDescription(
        units=(tuple(infos + ([] if lora_only else frozen)),),
        replicated=tuple(frozen if lora_only else []),
        units_known=False,
        source=f"--params {params:g}",
    )


def build_meta_model(hf_config: Any, *, dtype: torch.dtype, setup: ModelSetup) -> nn.Module:
    """The config's causal LM on the meta device, prepared as the strategy prepares it: LoRA applied
    (or everything trainable), the int8 candidates swapped for ``Int8Linear`` of the same shapes."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"), _DtypeContextManager(dtype):
        model = AutoModelForCausalLM.from_config(hf_config)
        if setup.lora is not None:  # as the strategy does it: on the model inside a (Lightning) module
            holder = nn.Module()
            holder.model = model
            apply_lora(holder, setup.lora)
            model = holder.model
        else:
            model.requires_grad_(True)
        if setup.quantize_base == "int8":
            _int8_skeleton(model, skip=setup.quantize_skip)
    return model


@contextmanager
def fake_model(config: str | Path, *, dtype: torch.dtype, setup: ModelSetup) -> Iterator[tuple[nn.Module, dict]]:
    """``(model, batch)`` on CPU FakeTensors inside ``FakeTensorMode``: the prepared model in ``dtype`` and
    one example batch of the setup's size."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    hf_config = load_config(config)
    model = build_meta_model(hf_config, dtype=dtype, setup=setup)
    with FakeTensorMode():
        to_fake(model)
        model.train()
        yield model, example_batch(
            vocab_size=hf_config.vocab_size, batch_size=setup.batch_size, seq_len=setup.seq_len, padded=setup.padded
        )


def to_fake(model: nn.Module) -> nn.Module:
    """Replace meta parameters and buffers by CPU FakeTensors of the same shapes (call in ``FakeTensorMode``).

    Fake CPU tensors run the CPU kernels' shape logic (which tensors autograd saves), unlike meta ones.
    Tied parameters stay tied.
    """
    memo: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for name, tensor in table.items():
                if tensor is None:
                    continue
                if id(tensor) not in memo:
                    fake = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu")
                    is_param = isinstance(tensor, nn.Parameter)
                    memo[id(tensor)] = nn.Parameter(fake, requires_grad=tensor.requires_grad) if is_param else fake
                table[name] = memo[id(tensor)]
    return model


def load_config(path: str | Path) -> Any:
    """A transformers config from ``config.json`` or a directory holding one (local files only)."""
    from transformers import AutoConfig

    target = Path(path)
    file = target / "config.json" if target.is_dir() else target
    try:
        values = json.loads(file.read_text())
        model_type = values.pop("model_type")
        return AutoConfig.for_model(model_type, **values)
    except (OSError, ValueError, KeyError) as err:
        reason = "no model_type" if isinstance(err, KeyError) else f"{type(err).__name__}: {err}"
        raise EstimateError(f"config={str(path)!r} is not a readable transformers config.json ({reason})") from None


def _int8_skeleton(model: nn.Module, *, skip: Sequence[str]) -> list[str]:
    """Swap the int8 candidates for empty ``Int8Linear`` layers of the same shape (no quantization)."""
    from lightning_fsdp_plus.quantization.int8 import Int8Linear, int8_candidates

    paths = int8_candidates(model, skip=skip)
    for path in paths:
        parent_path, _, name = path.rpartition(".")
        old = model.get_submodule(path)
        bias_dtype = old.bias.dtype if old.bias is not None else torch.float32
        new = Int8Linear(old.in_features, old.out_features, bias=old.bias is not None, bias_dtype=bias_dtype)
        setattr(model.get_submodule(parent_path) if parent_path else model, name, new)
    return paths


def count_activations(run_forward: Callable[[], Any], *, precision: str) -> int:
    """Bytes autograd saves while ``run_forward`` runs in the precision plugin's forward context (CPU)."""
    with SavedActivations() as counter, FSDPPlusPrecision(precision).forward_context():  # type: ignore[arg-type]
        run_forward()
    return counter.bytes


def example_batch(*, vocab_size: int, batch_size: int, seq_len: int, padded: bool) -> dict[str, torch.Tensor]:
    """Token ids (and labels) for one forward; ``padded`` adds an attention mask with one padded position,
    as padding collators produce: attention then takes its masked path, which saves more for backward."""
    ids = torch.randint(0, vocab_size, (batch_size, seq_len))
    batch = {"input_ids": ids, "labels": ids}
    if padded:
        mask = torch.ones(batch_size, seq_len, dtype=torch.long)
        mask[0, -1] = 0
        batch["attention_mask"] = mask
    return batch


def describe_config(config: str | Path, *, precision: str, setup: ModelSetup) -> ModelDescription:
    """Build the config's model on FakeTensors (no memory), prepared as the strategy prepares it
    (LoRA, int8 skeleton), count one forward's activations, and describe it.

    ``setup.activation_checkpointing`` checkpoints every FSDP unit but the root (the decoder layers under
    the ``auto`` policy, as ``activation_checkpointing=[<layer class>]`` does) and counts again; what a unit
    recomputes in backward is the saved bytes it no longer keeps, per unit.
    """
    with fake_model(config, dtype=compute_dtype(precision), setup=setup) as (model, batch):
        description = describe_module(
            model, lora_only=setup.lora_only, auto_wrap_policy=setup.auto_wrap_policy, source=str(config)
        )
        activations = count_activations(lambda: model(**batch).loss, precision=precision)
        recompute = 0
        if setup.activation_checkpointing:
            paths = [p for p in select_unit_paths(model, setup.auto_wrap_policy) if p]
            apply_activation_checkpointing(model, paths)
            kept = count_activations(lambda: model(**batch).loss, precision=precision)
            recompute, activations = (activations - kept) // max(len(paths), 1), kept
    return replace(description, activation_bytes=activations, recompute_bytes=recompute)


def estimate_memory(
    *,
    params: float | None = None,
    config: str | Path | None = None,
    world_size: int | Sequence[int],
    strategy: str | Sequence[str] = "all",
    precision: str = "bf16-mixed",
    optimizer: str = "adamw",
    hybrid_shard_size: int | None = None,
    lora: Any = None,
    trainable_fraction: float | None = None,
    lora_only: bool = False,
    quantize_base: str | None = None,
    quantize_skip: Sequence[str] = ("lm_head",),
    cpu_offload: bool = False,
    auto_wrap_policy: WrapPolicy = "auto",
    activation_checkpointing: bool = False,
    batch_size: int = 1,
    seq_len: int = 2048,
    padded: bool = False,
    simulate: bool = False,
) -> tuple[ModelDescription, list[MemoryEstimate]]:
    """Estimates for every (world size, strategy) pair, from a parameter count or a transformers config.

    Every argument is checked before any model is built; errors are :class:`EstimateError` naming the key.
    ``simulate`` adds torch's FSDP2 memory tracker's peak (fake process group, FakeTensors) to each.
    """
    from lightning_fsdp_plus.quantization import check_quantize_base

    if (params is None) == (config is None):
        raise EstimateError("give exactly one of params (a parameter count) or config (a config.json path)")
    sizes = [world_size] if isinstance(world_size, int) else list(world_size)
    if not sizes:
        raise EstimateError("world_size=[] needs at least one positive integer")
    for size in sizes:
        check_positive(size, key="world_size", meaning="the number of ranks")
    check_positive(batch_size, key="batch_size", meaning="sequences per rank")
    check_positive(seq_len, key="seq_len", meaning="tokens per sequence")
    strategies = parse_strategies(strategy)
    _precision_bytes(precision)
    _optimizer_states(optimizer)
    try:
        check_quantize_base(quantize_base)
    except ValueError as err:
        raise EstimateError(str(err)) from None
    if params is not None and lora is not None:
        raise EstimateError("lora (rank, targets) needs config=...; with params=... give trainable_fraction")
    if config is not None and trainable_fraction is not None:
        raise EstimateError("trainable_fraction is for params=...; with config=... give lora (rank, targets)")
    if activation_checkpointing and config is None:
        raise EstimateError("activation_checkpointing needs config=... (the layers to checkpoint)")
    if simulate and config is None:
        raise EstimateError("simulate=True builds the model: give config=... (a transformers config.json)")
    if params is not None:
        model = describe_param_count(
            params, trainable_fraction=1.0 if trainable_fraction is None else trainable_fraction,
            quantize_base=quantize_base, lora_only=lora_only,
        )  # fmt: skip
    else:
        setup = ModelSetup(
            lora=lora, lora_only=lora_only, quantize_base=quantize_base, quantize_skip=tuple(quantize_skip),
            auto_wrap_policy=auto_wrap_policy, activation_checkpointing=activation_checkpointing,
            batch_size=batch_size, seq_len=seq_len, padded=padded,
        )  # fmt: skip
        model = describe_config(config, precision=precision, setup=setup)
    common = {"precision": precision, "optimizer": optimizer, "hybrid_shard_size": hybrid_shard_size}
    estimates = [
        estimate_strategy(model, sharding_strategy=name, world_size=size, cpu_offload=cpu_offload, **common)
        for size in sizes
        for name in strategies
        # "all" without a group size: HYBRID_SHARD would only repeat FULL_SHARD
        if not (name is ShardingStrategy.HYBRID_SHARD and hybrid_shard_size is None and len(strategies) > 1)
    ]
    if simulate:
        from lightning_fsdp_plus.memory.simulate import simulate_peak

        strategy_of = {s.value: s for s in ShardingStrategy}
        estimates = [
            replace(e, simulated=simulate_peak(config, sharding_strategy=strategy_of[e.sharding_strategy],
                                               world_size=e.world_size, setup=setup, **common))
            for e in estimates
        ]  # fmt: skip
    return model, estimates
