"""Per-rank memory estimator: will this model fit, under which sharding strategy?

The estimate is arithmetic over the model's parameters grouped the way the strategy groups them
(the same wrap policy, LoRA application and int8 conversion, run on a FakeTensor model that takes no
memory), with bytes per element from :mod:`~lightning_fsdp_plus.memory.assumptions`. Per rank it gives:

* ``params`` / ``grads`` / ``optimizer``: sharded (÷ shard size) or replicated storage;
* ``unsharded_params``: compute copies alive from forward to backward (every unit under SHARD_GRAD_OP and
  NO_SHARD; the root unit's under FULL/HYBRID_SHARD unless ``reshard_root_after_forward``);
* ``model_state_bytes_per_rank``: the larger of the two moments a step peaks at — end of forward
  (stored + optimizer + kept compute copies) and end of backward (stored + optimizer + gradients);
* ``activation_bytes_per_rank``: storages autograd saves in one forward of ``batch_size x seq_len``,
  counted on a FakeTensor forward (CPU kernels' choices: fused CUDA attention saves less);
* ``largest_unit_transient_bytes``: what backward adds around the largest unit: its all-gathered parameters
  (FULL/HYBRID_SHARD) and unsharded gradients, and as much again for its neighbours — the next unit's prefetched
  all-gather and the previous unit's reduce-scatter buffer still in flight (FSDP2's overlap; measured with torch's
  ``FSDPMemTracker``), with activation checkpointing what one unit saves again while its backward recomputes it
  (once: each recomputed tensor is freed when its backward node has used it; traced), two tensors of the largest
  saved activation's size (the gradient backward computes for it and the one beside it) and the largest quantized
  weight dequantized (bitsandbytes builds that copy for the matmul) — each part measured with
  ``benchmarks/memory_trace.py``;
* ``peak_bytes_per_rank``: max(end of forward + activations, end of backward) — what ``MemoryMonitor``
  measures as its tensor-accounted peak — and ``peak_with_transient_bytes_per_rank``: the larger of that peak
  plus the transient and the optimizer step (end of backward + the optimizer's temporaries): the live tensors at
  the step's peak;
* ``real_peak_bytes_per_rank``: what the process takes on its platform (:class:`~.allocator.Platform`): gloo's
  all-gather temporary of the largest unit on CPU, times what the allocator keeps beyond its live bytes (CPU
  ``malloc``: measured per allocator; CUDA: 1, its caching allocator's reserve is ``memory_margin``'s share), plus
  what the device runtime holds outside the allocator (CUDA: the context and a NCCL communicator per process group,
  as published; :mod:`~.allocator`). The auto plan budgets this figure against the device's total memory.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_fsdp_plus.memory.allocator import PLATFORMS, Platform
from lightning_fsdp_plus.memory.assumptions import (
    GRADIENT_TEMPORARIES,
    OPTIMIZER_STATES,
    OPTIMIZER_TEMPORARIES,
    PRECISION_BYTES,
    PrecisionBytes,
)
from lightning_fsdp_plus.memory.fake import EstimateError, ForwardBatch, config_source, fake_model
from lightning_fsdp_plus.memory.monitor import SavedActivations
from lightning_fsdp_plus.memory.timeline import Moment, UnitActivations, UnitCost, peak_moment, step_timeline
from lightning_fsdp_plus.options import FSDPPlusOptions
from lightning_fsdp_plus.pipeline import plan_model, tensor_parallel_layers
from lightning_fsdp_plus.plan import MeshLayout, ParamInfo, ShardingStrategy, resolve_mesh_layout, sharded_numel
from lightning_fsdp_plus.precision import FSDPPlusPrecision, compute_dtype
from lightning_fsdp_plus.sharding import apply_activation_checkpointing, selective_saved_ops

STRATEGY_CHOICES = ("all", *ShardingStrategy.__members__)
"""Valid ``strategy`` values: a strategy name (any case) or ``all``."""


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
    largest_activation_bytes: int = 0
    """The largest single tensor one forward saves (an MLP's intermediate, or the logits): backward computes its
    gradient and the next one beside it."""
    source: str = ""
    """Where the description came from (a config path, a module class, a parameter count)."""
    unit_paths: tuple[str, ...] = ()
    """Module path of each unit, aligned with ``units`` (the root, ``""``, last)."""
    unit_activations: tuple[int, ...] = ()
    """Saved-for-backward bytes each unit's own forward adds (aligned with ``units``; empty: not counted per unit,
    the step is then not laid out as a timeline)."""
    unit_recompute: tuple[int, ...] = ()
    """With activation checkpointing: what each unit's backward recomputes (aligned with ``units``)."""
    unit_largest: tuple[int, ...] = ()
    """The largest tensor each unit saves (aligned with ``units``)."""
    forward_order: tuple[int, ...] = ()
    """Indices into ``units`` of the non-root units in the order their forward runs."""
    loss_transient_bytes: int = 0
    """What computing the loss allocates beyond the saved activations (the chunked loss: one chunk's float32
    logits, their gradient and its cast)."""
    unit_loss_grads: tuple[int, ...] = ()
    """Per unit (aligned with ``units``): the gradients the chunked loss computes in forward and saves (the output
    head's weight and bias when they train, in the compute dtype)."""

    def _all(self) -> Iterable[ParamInfo]:
        return (p for unit in (*self.units, self.replicated) for p in unit)

    @property
    def total_params(self) -> int:
        """All stored parameter elements (int8 weights and scales included; a packed 4-bit byte holds two weights)."""
        return sum(p.numel for p in self._all())

    @property
    def total_weights(self) -> int:
        """The model's parameter count as its card gives it: float elements and quantized weights (two per packed
        4-bit byte), without quantization scales and block statistics."""
        return sum(weight_elements(p) for p in self._all())

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
            "total_weights": self.total_weights,
            "trainable_params": self.trainable_params,
            "num_units": len(self.units) if self.units_known else None,
            "largest_unit_params": largest,
            "replicated_params": sum(p.numel for p in self.replicated),
            "activation_bytes": self.activation_bytes,
            "recompute_bytes": self.recompute_bytes,
            "largest_activation_bytes": self.largest_activation_bytes,
        }


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
    """max(``peak_bytes_per_rank`` + the transient, end of backward + ``optimizer_temporary_bytes``)."""
    live_peak_bytes_per_rank: int | None = None
    """Every live tensor at the peak on ``platform``: ``peak_with_transient_bytes_per_rank`` + the platform's
    all-gather copies of the largest unit (gloo's temporary; none on NCCL)."""
    real_peak_bytes_per_rank: int | None = None
    """What the process really takes at the peak on ``platform``: ``live_peak_bytes_per_rank`` x the platform's
    allocator factor (what ``malloc`` keeps beyond its live bytes on CPU; :mod:`~.allocator`) +
    ``runtime_bytes_per_rank``."""
    runtime_bytes_per_rank: int = 0
    """What the device runtime holds outside the tensor allocator (CUDA: the context and NCCL's communicators)."""
    platform: str = "cuda"
    """The platform the real peak is for (``cuda``, ``cpu-tcmalloc``, ``cpu-glibc``, ``cpu-mmap``)."""
    optimizer_temporary_bytes: int = 0
    """What ``optimizer.step()`` allocates on the device beyond the state (Adam(W): one state-sized tensor)."""
    host_bytes_per_rank: int = 0
    """With ``cpu_offload``: the stored parameters, gradients and optimizer state in host memory."""
    simulated: dict[str, int] | None = field(default=None)
    """With ``simulate``: torch's FSDP2 memory tracker's peak by category on a fake process group."""
    peak_moment: str | None = None
    """The step's moment with the most live bytes (``forward <unit>``, ``loss``, ``backward <unit>``, ``optimizer
    step``; :mod:`~.timeline`); None when the units are not known."""
    timeline: tuple[dict[str, Any], ...] = ()
    """Every moment of the step: name, live bytes (without the platform's gather copies) and their parts."""
    tensor_parallel_size: int = 1
    """Ranks each planned layer is split over (``world_size / tensor_parallel_size`` data-parallel ranks)."""

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


def bytes_per_element(info: ParamInfo, float_bytes: int) -> int:
    """``float_bytes`` for a floating-point parameter (its precision's stored or compute size), else its dtype's."""
    return float_bytes if info.dtype.is_floating_point else info.dtype.itemsize


def unit_reshards(sharding_strategy: ShardingStrategy, *, root: bool, reshard_root: bool) -> bool:
    """Whether a unit frees its gathered parameters after forward (and gathers them again for backward): the
    strategy's rule, for the root only with ``reshard_root``."""
    return sharding_strategy.reshard_after_forward and (reshard_root or not root)


def weight_elements(info: ParamInfo) -> int:
    """Weights a parameter holds: float elements, int8 weights, two per packed 4-bit byte; scales and block
    statistics (int32) hold none."""
    if info.dtype.is_floating_point:
        return info.numel
    if info.name.endswith("weight") and info.dtype in (torch.int8, torch.uint8):
        return info.numel * (2 if info.dtype == torch.uint8 else 1)
    return 0


def is_quantized(info: ParamInfo) -> bool:
    """An int8 or packed 4-bit weight."""
    return not info.dtype.is_floating_point and weight_elements(info) > 0


def dequantized_weight_bytes(model: ModelDescription, *, compute_bytes: int) -> int:
    """The largest quantized weight dequantized to the compute dtype: bitsandbytes' int8 and 4-bit layers build that
    copy for every backward (and on CPU every forward too) and free it after the matmul; 0 without quantization."""
    infos = (p for unit in (*model.units, model.replicated) for p in unit if is_quantized(p))
    return max((weight_elements(p) for p in infos), default=0) * compute_bytes


def estimate_strategy(
    model: ModelDescription,
    *,
    sharding_strategy: ShardingStrategy,
    world_size: int,
    precision: str = "bf16-mixed",
    optimizer: str = "adamw",
    hybrid_shard_size: int | None = None,
    cpu_offload: bool = False,
    reshard_root: bool = False,
    platform: Platform = PLATFORMS["cuda"],
    tensor_parallel_size: int = 1,
) -> MemoryEstimate:
    """Bytes per rank for one strategy at one world size; the root unit (the last) reshards after forward only
    with ``reshard_root`` (``reshard_root_after_forward``) — else its gathered copy counts at the end of forward
    when the strategy reshards the others (a model known only by its size has no root apart: nothing added).
    With ``tensor_parallel_size``, FSDP2 shards over ``world_size / tensor_parallel_size`` ranks and ``model``
    describes one tensor rank's share (:func:`describe_module`)."""
    check_positive(world_size, key="world_size", meaning="the number of ranks")
    pb, states = _precision_bytes(precision), _optimizer_states(optimizer)
    if world_size % tensor_parallel_size:
        raise EstimateError(f"tensor_parallel_size={tensor_parallel_size} does not divide world_size={world_size}")
    try:
        layout = resolve_mesh_layout(
            sharding_strategy=sharding_strategy, world_size=world_size // tensor_parallel_size,
            hybrid_shard_size=hybrid_shard_size,
        )  # fmt: skip
    except ValueError as err:
        raise EstimateError(str(err)) from None
    shard = layout.shard
    runtime = platform.runtime_bytes(group_sizes=(world_size, layout.shard, layout.replicate))
    managed = [(p, shard) for unit in model.units for p in unit]
    kept_whole = [(p, 1) for p in model.replicated]

    def state(pairs: list[tuple[ParamInfo, int]]) -> tuple[int, int, int]:
        stored = sum(_elements(p, s) * bytes_per_element(p, pb.stored) for p, s in pairs)
        grads = sum(_elements(p, s) * pb.grad for p, s in pairs if p.trainable)
        return stored, grads, sum(_elements(p, s) * states * pb.state for p, s in pairs if p.trainable)

    (stored, grads, opt), (r_stored, r_grads, r_opt) = state(managed), state(kept_whole)

    def compute_copy(unit: Iterable[ParamInfo]) -> int:
        return sum(p.numel * bytes_per_element(p, pb.compute) for p in unit)

    def unsharded_grads(unit: Iterable[ParamInfo]) -> int:
        return sum(p.numel * pb.compute for p in unit if p.trainable)

    last = len(model.units) - 1
    lean_root = reshard_root or not model.units_known  # a size-only model's one block stands for every unit
    regathered = [unit_reshards(sharding_strategy, root=i == last, reshard_root=lean_root) for i in range(last + 1)]
    kept = sum(compute_copy(u) for u, again in zip(model.units, regathered, strict=True) if not again)
    transient = None
    if model.units_known and model.units:
        # the unit whose backward runs (its gathered copy when re-gathered, its unsharded gradients) and as much
        # again for its neighbours: the next unit's prefetched all-gather, the last one's reduce-scatter buffer
        transient = 2 * max(
            unsharded_grads(u) + (compute_copy(u) if again else 0)
            for u, again in zip(model.units, regathered, strict=True)
        )
        transient += model.recompute_bytes  # a checkpointed unit's recomputed activations, freed as backward uses them
        transient += GRADIENT_TEMPORARIES * model.largest_activation_bytes + dequantized_weight_bytes(
            model, compute_bytes=pb.compute)  # fmt: skip
    temporaries = 0 if cpu_offload else opt // max(states, 1) * OPTIMIZER_TEMPORARIES[optimizer.lower()]
    temporaries += r_opt // max(states, 1) * OPTIMIZER_TEMPORARIES[optimizer.lower()]
    host = 0
    if cpu_offload:  # FSDP2's CPUOffloadPolicy keeps the state of the parameters it manages in host memory
        host, stored, grads, opt = stored + grads + opt, 0, 0, 0
    stored, grads, opt = stored + r_stored, grads + r_grads, opt + r_opt  # parameters FSDP ignores stay put
    end_of_forward, end_of_backward = stored + opt + kept, stored + opt + grads
    act = model.activation_bytes
    peak = None if act is None else max(end_of_forward + act, end_of_backward)
    with_transient = None if peak is None or transient is None else max(peak + transient, end_of_backward + temporaries)
    moments: list[Moment] = []
    if with_transient is not None and model.unit_activations:
        costs = [
            UnitCost(path=path, gathered=compute_copy(unit), unsharded_grads=unsharded_grads(unit),
                     grad_shards=sum(_elements(p, shard) * pb.grad for p in unit if p.trainable and p.sharded),
                     reshards=again, activations=act_i, recompute=recompute_i, largest_activation=largest_i,
                     loss_grads=loss_i)
            for path, unit, again, act_i, recompute_i, largest_i, loss_i in zip(
                model.unit_paths, model.units, regathered, model.unit_activations, model.unit_recompute,
                model.unit_largest, model.unit_loss_grads or (0,) * len(model.units), strict=True)
        ]  # fmt: skip
        ordered = [costs[i] for i in model.forward_order]
        if ordered and not any(p.trainable for p in model.units[model.forward_order[0]]):
            ordered[0] = replace(ordered[0], in_backward=False)  # a frozen first unit: nothing flows back to it
        timeline = {
            "units": ordered, "root": costs[-1], "stored": stored, "optimizer": opt,
            "loss_transient": model.loss_transient_bytes, "dequantized": dequantized_weight_bytes(
                model, compute_bytes=pb.compute), "optimizer_temporaries": temporaries, "prefetch": shard > 1,
        }  # fmt: skip
        moments = step_timeline(**timeline)
        with_transient = peak_moment(moments).bytes
        live_moments = step_timeline(**timeline, gather_copies=platform.gather_copies if shard > 1 else 0)
        live = peak_moment(live_moments).bytes
        real = math.ceil(live * platform.allocator_factor) + runtime
    elif with_transient is not None:
        gathered = max((compute_copy(u) for u in model.units), default=0) if shard > 1 else 0
        live = with_transient + platform.gather_copies * gathered
        real = math.ceil(live * platform.allocator_factor) + runtime
    else:
        live = real = None
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
        largest_unit_transient_bytes=transient if not moments or peak is None else with_transient - peak,
        peak_bytes_per_rank=peak,
        peak_with_transient_bytes_per_rank=with_transient,
        live_peak_bytes_per_rank=live,
        real_peak_bytes_per_rank=real,
        runtime_bytes_per_rank=runtime if real is not None else 0,
        platform=platform.name,
        optimizer_temporary_bytes=temporaries,
        host_bytes_per_rank=host,
        peak_moment=peak_moment(moments).name if moments else None,
        timeline=tuple(m.to_dict() for m in moments),
        tensor_parallel_size=tensor_parallel_size,
    )


# ---- describing a model ------------------------------------------------------------------------------
def describe_module(
    model: nn.Module,
    *,
    options: FSDPPlusOptions | None = None,
    activation_bytes: int | None = None,
    source: str = "",
) -> ModelDescription:
    """Group a (real or fake) model's parameters as the strategy would (the pipeline's plan stage: units from the
    wrap policy, replicated parameters under ``lora_only``). Apply LoRA / int8 before calling. With
    ``options.tensor_parallel_size``, the layers of the tensor-parallel plan have one tensor rank's share
    (:func:`tensor_parallel_shapes`)."""
    options = options or FSDPPlusOptions()
    plan = plan_model(model, options, layout=MeshLayout(replicate=1, shard=1), precision="32-true", device_type="cpu")
    split = tensor_parallel_shapes(model, options)
    return ModelDescription(
        units=tuple(tuple(replace(p, shape=split.get(p.name, p.shape)) for p in u.params) for u in plan.units),
        replicated=plan.replicated,
        activation_bytes=activation_bytes,
        source=source or type(model).__name__,
        unit_paths=tuple(u.path for u in plan.units),
    )


def describe_param_count(
    params: float,
    *,
    trainable_fraction: float = 1.0,
    quantize_base: str | None = None,
    lora_only: bool = False,
) -> ModelDescription:
    """A model known only by its size: one block of ``params`` elements, ``trainable_fraction`` of them train.

    With ``quantize_base="int8"`` the frozen part is int8 (scales ignored: < 0.1% for hidden sizes ≥ 4096); with
    ``"nf4"``/``"fp4"`` it is packed 4-bit plus one fp32 absmax per 64 values (``quantize_blocksize``'s default).
    """
    if isinstance(params, bool) or not isinstance(params, (int, float)) or not params >= 1:
        raise EstimateError(f"params={params!r} must be a positive number of parameters (e.g. 7.5e9)")
    if not 0.0 <= trainable_fraction <= 1.0:
        raise EstimateError(f"trainable_fraction={trainable_fraction!r} must be between 0 and 1")
    total = int(params)
    trainable = round(total * trainable_fraction)
    infos = [ParamInfo("trainable", (trainable,), torch.float32, True, True, 0)] if trainable else []
    frozen = _frozen_infos(total - trainable, quantize_base=quantize_base, sharded=not lora_only)
    return ModelDescription(
        units=(tuple(infos + ([] if lora_only else frozen)),),
        replicated=tuple(frozen if lora_only else []),
        units_known=False,
        source=f"--params {params:g}",
    )


def _frozen_infos(count: int, *, quantize_base: str | None, sharded: bool) -> list[ParamInfo]:
    """The frozen part of a size-only model: float, int8, or 4-bit (packed bytes and per-block absmax)."""
    if count <= 0:
        return []
    if quantize_base in ("nf4", "fp4"):
        return [ParamInfo("frozen", (-(-count // 2),), torch.uint8, False, sharded, 0),
                ParamInfo("frozen_absmax", (-(-count // 64),), torch.int32, False, sharded, 0)]  # fmt: skip
    dtype = torch.int8 if quantize_base == "int8" else torch.float32
    return [ParamInfo("frozen", (count,), dtype, False, sharded, 0)]


def saved_activations(run_forward: Callable[[], Any], *, precision: str) -> SavedActivations:
    """What autograd saves while ``run_forward`` runs in the precision plugin's forward context (CPU)."""
    with SavedActivations() as counter, FSDPPlusPrecision(precision).forward_context():  # type: ignore[arg-type]
        run_forward()
    return counter


def count_activations(run_forward: Callable[[], Any], *, precision: str) -> int:
    """Bytes autograd saves while ``run_forward`` runs in the precision plugin's forward context (CPU)."""
    return saved_activations(run_forward, precision=precision).bytes


def describe_config(
    config: Any, *, precision: str, options: FSDPPlusOptions, batch: ForwardBatch, chunked_loss: bool = True
) -> ModelDescription:
    """Build the config's model on FakeTensors (no memory), prepared by the pipeline as the strategy prepares it
    (LoRA, int8), count one forward's activations, and describe it.

    With ``options.activation_checkpointing`` the plan's checkpointed modules are checkpointed and the forward
    counted again; what one of them recomputes in backward is the saved bytes it no longer keeps, per module.
    """
    checkpointed = options.activation_checkpointing is not None
    variants = describe_config_variants(config, precision=precision, options=options, batch=batch,
                                        lora_only=(options.lora_only,), checkpointing=(checkpointed,),
                                        chunked_loss=chunked_loss)  # fmt: skip
    return variants[options.lora_only, checkpointed]


def describe_config_variants(
    config: Any,
    *,
    precision: str,
    options: FSDPPlusOptions,
    batch: ForwardBatch,
    lora_only: Sequence[bool] = (False,),
    checkpointing: Sequence[bool] = (False,),
    chunked_loss: bool = True,
) -> dict[tuple[bool, bool], ModelDescription]:
    """``(lora_only, checkpointed) -> description`` for every pair asked, from one FakeTensor build (the auto plan
    describes many candidates; only quantization needs another build). ``config``: a ``config.json`` path or a
    transformers config object. Checkpointing uses ``options.activation_checkpointing``, else the wrap policy's
    units (every unit but the root), in ``options.activation_checkpointing_mode``. The forward computes the loss
    as the app does (:func:`~lightning_fsdp_plus.loss.causal_lm_loss`, chunked unless ``chunked_loss=False``); what
    it saves is counted per unit (the step's timeline needs it)."""
    from lightning_fsdp_plus.loss import default_chunk_tokens, output_head

    built = options.replace(lora_only=False, activation_checkpointing=None)
    policy = options.activation_checkpointing if options.activation_checkpointing is not None else (
        options.auto_wrap_policy)  # fmt: skip
    selective = options.activation_checkpointing_mode == "selective"
    one_unit = MeshLayout(replicate=1, shard=1)
    with fake_model(config, dtype=compute_dtype(precision), options=built, batch=batch) as (model, inputs):
        plain = {mode: describe_module(model, options=built.replace(lora_only=mode), source=config_source(config))
                 for mode in lora_only}  # fmt: skip
        modules = dict(model.named_modules())
        unit_paths = sorted({p for d in plain.values() for p in d.unit_paths if p})
        paths: tuple[str, ...] = ()
        if True in checkpointing:
            paths = plan_model(model, built.replace(activation_checkpointing=policy), layout=one_unit,
                               precision=precision, device_type="cpu").activation_checkpointing  # fmt: skip
        counter = UnitActivations({modules[p]: p for p in unit_paths}, checkpointed={modules[p]: p for p in paths},
                                  saved_ops=selective_saved_ops() if selective else frozenset())  # fmt: skip

        def forward() -> Any:
            return model(chunked_loss=chunked_loss, **inputs)

        with FSDPPlusPrecision(precision).forward_context(), counter:  # type: ignore[arg-type]
            forward()
        activations, largest = counter.bytes, counter.largest
        plain_units, largest_units, order = counter.by_unit(), counter.largest_by_unit(), list(counter.order)
        kept_ops = dict(counter.op_outputs)
        config_obj = getattr(getattr(model, "model", model), "config", None)  # the causal LM inside the root
        vocab, hidden = getattr(config_obj, "vocab_size", 0) or 0, getattr(config_obj, "hidden_size", 0) or 0
        loss_transient = 0
        size = torch.empty((), dtype=compute_dtype(precision)).element_size()
        head = output_head(getattr(model, "model", model)) if chunked_loss else None
        trained_head = {id(p) for p in head.parameters() if p.requires_grad} if head is not None else set()
        head_names = {name for name, p in model.named_parameters() if id(p) in trained_head}
        if chunked_loss and vocab and hidden:
            chunk = default_chunk_tokens(tokens=batch.batch_size * batch.seq_len, hidden=hidden, vocab=vocab)
            # a chunk's float32 logits, cross-entropy's log-probabilities, the softmax that becomes the gradient,
            # and below float32 the logits in the compute dtype before their upcast (traced with
            # benchmarks/memory_trace.py at a 128k vocabulary in float32: 3 x 62.6 MiB alive at the step's peak)
            loss_transient = chunk * vocab * (12 + (size if size < 4 else 0))
            if size < 4:  # a trained head's gradient is summed in float32 before it is saved in the compute dtype
                loss_transient += 4 * sum(p.numel() for p in head.parameters() if id(p) in trained_head) if head else 0

        def laid_out(d: ModelDescription, saved: dict[str, int], recompute: dict[str, int]) -> ModelDescription:
            own = set(d.unit_paths)
            folded = {p: v for p, v in saved.items() if p in own}
            folded[""] = saved.get("", 0) + sum(v for p, v in saved.items() if p not in own)  # outside: the root's
            return replace(
                d, unit_activations=tuple(folded.get(p, 0) for p in d.unit_paths),
                unit_recompute=tuple(recompute.get(p, 0) for p in d.unit_paths),
                unit_largest=tuple(largest_units.get(p, 0) if p in own and p else max(
                    (v for q, v in largest_units.items() if q not in own or not q), default=0) for p in d.unit_paths),
                forward_order=tuple(d.unit_paths.index(p) for p in order if p in own and p),
                loss_transient_bytes=loss_transient,
                unit_loss_grads=tuple(sum(p.numel for p in unit if p.name in head_names) * size for unit in d.units),
            )  # fmt: skip

        plain = {mode: replace(d, largest_activation_bytes=largest) for mode, d in plain.items()}
        out = {(mode, False): laid_out(replace(d, activation_bytes=activations), plain_units, {})
               for mode, d in plain.items()}  # fmt: skip
        if True in checkpointing:
            apply_activation_checkpointing(model, paths)  # full: what each unit keeps is its inputs
            full = UnitActivations({modules[p]: p for p in unit_paths})
            with FSDPPlusPrecision(precision).forward_context(), full:  # type: ignore[arg-type]
                forward()
            kept_units = full.by_unit()
            if selective:  # the matmul and attention outputs are kept as well
                kept_units = {p: min(plain_units.get(p, 0), v + kept_ops.get(p, 0)) for p, v in kept_units.items()}
            kept = sum(kept_units.values())
            recompute_units = {p: max(plain_units.get(p, 0) - kept_units.get(p, 0), 0) for p in plain_units}
            recompute = (activations - kept) // max(len(paths), 1)
            out |= {(mode, True): laid_out(replace(d, activation_bytes=kept, recompute_bytes=recompute), kept_units,
                                           recompute_units) for mode, d in plain.items()}  # fmt: skip
    return {key: value for key, value in out.items() if key[1] in checkpointing}


def tensor_parallel_shapes(model: nn.Module, options: FSDPPlusOptions) -> dict[str, tuple[int, ...]]:
    """``{parameter name: one tensor rank's shape}`` for the parameters ``options.tensor_parallel_size`` splits
    (:func:`~lightning_fsdp_plus.tensor_parallel.local_shapes`); plan errors as :class:`EstimateError`."""
    from lightning_fsdp_plus.tensor_parallel import local_shapes

    try:
        layers = tensor_parallel_layers(model, options)
    except ValueError as err:
        raise EstimateError(str(err)) from None
    return local_shapes(model, layers, size=options.tensor_parallel_size) if layers else {}


def estimate_options(options: FSDPPlusOptions | None, **fields: Any) -> FSDPPlusOptions:
    """``options`` (default ones if None) with ``fields`` changed; bad keys or values as :class:`EstimateError`."""
    try:
        return (options or FSDPPlusOptions()).replace(**fields)
    except TypeError as err:
        valid = ", ".join(f.name for f in FSDPPlusOptions.__dataclass_fields__.values())
        raise EstimateError(f"{err}; valid options: {valid}") from None
    except ValueError as err:
        raise EstimateError(str(err)) from None


def estimate_memory(
    *,
    params: float | None = None,
    config: str | Path | None = None,
    world_size: int | Sequence[int],
    strategy: str | Sequence[str] = "all",
    precision: str = "bf16-mixed",
    optimizer: str = "adamw",
    options: FSDPPlusOptions | None = None,
    trainable_fraction: float | None = None,
    activation_checkpointing: bool = False,
    batch_size: int = 1,
    seq_len: int = 2048,
    padded: bool = False,
    packed: bool = False,
    simulate: bool = False,
    platform: Platform = PLATFORMS["cuda"],
    chunked_loss: bool = True,
    **option_fields: Any,
) -> tuple[ModelDescription, list[MemoryEstimate]]:
    """Estimates for every (world size, strategy) pair, from a parameter count or a transformers config.

    The model is prepared with ``options`` (:class:`~lightning_fsdp_plus.options.FSDPPlusOptions`; any of its
    fields may also be given as a keyword, e.g. ``lora=``, ``lora_only=``, ``quantize_base=``,
    ``hybrid_shard_size=``, ``cpu_offload=``); ``activation_checkpointing=True`` checkpoints every FSDP unit but
    the root. Every argument is checked before any model is built; errors are :class:`EstimateError` naming the
    key. ``simulate`` adds torch's FSDP2 memory tracker's peak (fake process group, FakeTensors) to each;
    ``platform`` is what the real peak is for; ``chunked_loss=False`` counts the model's own loss (the batch's
    float32 logits) instead of the app's chunked one, as ``loss_parallel=True`` does (logits counted whole: an upper
    bound, each tensor rank holds ``1/tensor_parallel_size`` of them).
    """
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
    opts = estimate_options(options, **option_fields)
    if activation_checkpointing:
        opts = opts.replace(activation_checkpointing=opts.auto_wrap_policy)
    if params is not None and opts.tensor_parallel_size > 1:
        raise EstimateError("tensor_parallel_size needs config=... (the layers its plan splits)")
    if params is not None and opts.lora is not None:
        raise EstimateError("lora (rank, targets) needs config=...; with params=... give trainable_fraction")
    if config is not None and trainable_fraction is not None:
        raise EstimateError("trainable_fraction is for params=...; with config=... give lora (rank, targets)")
    if opts.activation_checkpointing is not None and config is None:
        raise EstimateError("activation_checkpointing needs config=... (the layers to checkpoint)")
    if simulate and config is None:
        raise EstimateError("simulate=True builds the model: give config=... (a transformers config.json)")
    if padded and packed:
        raise EstimateError("padded=True and packed=True: a batch is rows of single examples padded to the longest,"
                            " or packed rows (data.pack) with no attention mask; give one")  # fmt: skip
    batch = ForwardBatch(batch_size=batch_size, seq_len=seq_len, padded=padded, packed=packed)
    chunked_loss = chunked_loss and not opts.loss_parallel  # the model's own loss on vocabulary-sharded logits
    if params is not None:
        model = describe_param_count(
            params, trainable_fraction=1.0 if trainable_fraction is None else trainable_fraction,
            quantize_base=opts.quantize_base, lora_only=opts.lora_only,
        )  # fmt: skip
    else:
        model = describe_config(config, precision=precision, options=opts, batch=batch, chunked_loss=chunked_loss)
    common = {"precision": precision, "optimizer": optimizer, "hybrid_shard_size": opts.hybrid_shard_size,
              "reshard_root": opts.reshard_root_after_forward, "platform": platform,
              "tensor_parallel_size": opts.tensor_parallel_size}  # fmt: skip
    estimates = [
        estimate_strategy(model, sharding_strategy=name, world_size=size, cpu_offload=opts.cpu_offload, **common)
        for size in sizes
        for name in strategies
        # "all" without a group size: HYBRID_SHARD would only repeat FULL_SHARD
        if not (name is ShardingStrategy.HYBRID_SHARD and opts.hybrid_shard_size is None and len(strategies) > 1)
    ]
    if simulate:
        from lightning_fsdp_plus.memory.simulate import simulate_peak

        estimates = [
            replace(e, simulated=simulate_peak(config, options=opts.replace(sharding_strategy=e.sharding_strategy),
                                               world_size=e.world_size, batch=batch, precision=precision,
                                               optimizer=optimizer, chunked_loss=chunked_loss))
            for e in estimates
        ]  # fmt: skip
    return model, estimates
