"""From a module to a sharded, materialized module, in stages every caller shares.

    prepare (LoRA, checks) -> quantize (int8) -> plan (pure data) -> shard (checkpointing, compile, fully_shard)
    -> materialize (load)

``FSDPPlusStrategy.setup`` runs all of them; the memory estimator runs the first three on a meta/FakeTensor
model, and ``--simulate`` shards that model on a fake process group. Each stage takes the one
:class:`~lightning_fsdp_plus.options.FSDPPlusOptions`, so the three can never prepare a model differently.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

from lightning_fsdp_plus._private import _materialize_distributed_module
from lightning_fsdp_plus.compile import compile_spec_from
from lightning_fsdp_plus.loading import load_pretrained_weights
from lightning_fsdp_plus.lora import apply_lora, check_frozen, check_trainable, frozen_parameters, init_meta_adapters
from lightning_fsdp_plus.options import FSDPPlusOptions
from lightning_fsdp_plus.plan import MeshLayout, ShardingPlan, build_sharding_plan, tied_parameters
from lightning_fsdp_plus.policies import embedding_unit_paths, resolve_module_classes, select_unit_paths
from lightning_fsdp_plus.precision import mixed_precision_policy
from lightning_fsdp_plus.quantization import (
    FOUR_BIT_TYPES,
    QUANTIZABLE,
    FourBitLinear,
    Int8Linear,
    check_four_bit_layers,
    convert_to_4bit,
    convert_to_int8,
    four_bit_candidates,
    frozen_layer_types,
    int8_candidates,
    kept_float,
)
from lightning_fsdp_plus.sharding import apply_sharding_plan, model_checkpointed_layers
from lightning_fsdp_plus.tensor_parallel import apply_tensor_parallel, resolve_plan


def prepare_model(model: nn.Module, options: FSDPPlusOptions) -> None:
    """Stage 1: apply LoRA if configured, and check what LoRA-only sharding and quantization need (idempotent).

    LoRA adapters on the meta device (PEFT applied to a deferred pretrained model) are initialized here, with the
    same values on every rank, before anything is sharded.
    """
    if options.lora is not None:
        apply_lora(model, options.lora)
    init_meta_adapters(model)
    if options.lora_only:
        check_trainable(model)
        check_frozen(model)
    kind = options.quantize_base
    if kind is None or any(isinstance(m, (Int8Linear, FourBitLinear)) for m in model.modules()):
        return
    four_bit = kind in FOUR_BIT_TYPES
    candidates = four_bit_candidates if four_bit else int8_candidates
    if not candidates(model, skip=options.quantize_skip):
        raise ValueError(
            f"quantize_base={kind!r} found no frozen layer it converts ({', '.join(QUANTIZABLE)}) outside LoRA"
            f" adapters and quantize_skip={list(options.quantize_skip)}; layer types with frozen weights here:"
            f" {frozen_layer_types(model) or 'none (nothing is frozen)'}. Freeze the base (e.g. apply LoRA) or set"
            " quantize_base=None"
        )
    if four_bit:  # blocks must lie inside rows: refused here, before any process group exists
        check_four_bit_layers(model, skip=options.quantize_skip, blocksize=options.quantize_blocksize)


def tensor_parallel_layers(model: nn.Module, options: FSDPPlusOptions) -> dict[str, str]:
    """``{module path: style}`` the options' tensor parallelism splits on ``model`` (empty at size 1); raises
    ``TensorParallelError`` when the plan does not resolve or its sizes do not divide."""
    if options.tensor_parallel_size == 1:
        return {}
    return resolve_plan(model, size=options.tensor_parallel_size, given=options.tensor_parallel_plan,
                        loss_parallel=options.loss_parallel)  # fmt: skip


def check_tensor_parallel(model: nn.Module, options: FSDPPlusOptions) -> None:
    """The plan tensor parallelism will apply resolves on ``model`` and its sizes divide (raises otherwise)."""
    tensor_parallel_layers(model, options)


def quantize_model(model: nn.Module, options: FSDPPlusOptions) -> list[str]:
    """Stage 2: frozen linear layers become ``Int8Linear`` or ``FourBitLinear`` (from float weights, or empty ones
    on meta)."""
    if options.quantize_base == "int8":
        return convert_to_int8(model, skip=options.quantize_skip, threshold=options.int8_threshold)
    if options.quantize_base in FOUR_BIT_TYPES:
        return convert_to_4bit(model, quant_type=options.quantize_base, blocksize=options.quantize_blocksize,
                               double_quant=options.quantize_double, skip=options.quantize_skip)  # fmt: skip
    return []


def replicated_params(model: nn.Module, options: FSDPPlusOptions) -> set[nn.Parameter]:
    """Parameters kept out of FSDP: the frozen base under ``lora_only``, and ``ignored_modules``."""
    replicated = frozen_parameters(model) if options.lora_only else set()
    for item in options.ignored_modules or ():
        if isinstance(item, nn.Parameter):
            replicated.add(item)
        elif isinstance(item, nn.Module):
            replicated.update(item.parameters())
        else:
            classes = tuple(resolve_module_classes(model, [item], key="ignored_modules"))
            replicated.update(p for m in model.modules() if isinstance(m, classes) for p in m.parameters())
    return replicated


def plan_model(
    model: nn.Module, options: FSDPPlusOptions, *, layout: MeshLayout, precision: str, device_type: str
) -> ShardingPlan:
    """Stage 3: the sharding plan — units, replicated parameters, checkpointing, policy, offload, prefetch."""
    replicated = replicated_params(model, options)
    blocks = select_unit_paths(model, options.auto_wrap_policy)
    return build_sharding_plan(
        model,
        unit_paths=blocks,
        edge_units=edge_unit_paths(model, blocks=blocks, replicated=replicated) if _is_auto(options) else (),
        sharding_strategy=options.sharding_strategy,
        mesh=layout,
        ignored_params=replicated,
        activation_checkpointing=checkpointed_paths(model, options),
        checkpointing_mode=options.activation_checkpointing_mode,
        reshard_after_forward=options.resharded_after_forward,
        reshard_root_after_forward=options.reshard_root_after_forward,
        mp_policy=mixed_precision_policy(precision=precision, mapping=options.mixed_precision),
        cpu_offload=options.cpu_offload and device_type != "cpu",  # on CPU the parameters already live there
        forward_prefetch=options.forward_prefetch,
        float_layers=kept_float(model, skip=options.quantize_skip).items() if options.quantize_base else (),
        compile=compile_spec_from(options.compile),
    )


def _is_auto(options: FSDPPlusOptions) -> bool:
    return isinstance(options.auto_wrap_policy, str) and options.auto_wrap_policy == "auto"


def edge_unit_paths(model: nn.Module, *, blocks: list[str], replicated: set[nn.Parameter]) -> list[str]:
    """The input embeddings and output head as units of their own (torchtitan's layout) under the ``auto`` policy:
    each is gathered only around its own forward (and backward) instead of through the whole step in the root, the
    difference that matters at 128k-152k vocabularies. Not when inside a block unit, when every parameter is
    replicated (nothing to shard), nor when tied (one tensor used at both ends stays in the unit above both)."""
    inside = tuple(f"{b}." for b in blocks)
    tied = {id(param) for param, _ in tied_parameters(model)}
    return [
        path for path in embedding_unit_paths(model)
        if not path.startswith(inside)
        and not any(id(p) in tied for p in model.get_submodule(path).parameters())
        and any(p not in replicated for p in model.get_submodule(path).parameters())
    ]  # fmt: skip


def checkpointed_paths(model: nn.Module, options: FSDPPlusOptions) -> list[str]:
    """The modules whose forward is recomputed in backward: ``activation_checkpointing``'s choice (the auto plan's
    too) and the layers the model's own ``gradient_checkpointing_enable()`` switched on, which the plan then
    checkpoints itself (one mechanism under FSDP2's hooks, counted by the estimator, never both at once)."""
    chosen = options.activation_checkpointing
    paths = select_unit_paths(model, chosen, key="activation_checkpointing") if chosen is not None else []
    return list(dict.fromkeys([*paths, *model_checkpointed_layers(model)]))


def batch_norms(model: nn.Module) -> list[str]:
    """Paths of the BatchNorm layers ``Trainer(sync_batchnorm=True)`` converts (not SyncBatchNorm already)."""
    norm = nn.modules.batchnorm._BatchNorm
    return [p for p, m in model.named_modules() if isinstance(m, norm) and not isinstance(m, nn.SyncBatchNorm)]


def sync_batch_norm(model: nn.Module, *, layer_sync: Any, device: torch.device) -> nn.Module:
    """``Trainer(sync_batchnorm=True)``: BatchNorm layers become ``SyncBatchNorm`` (Lightning's ``layer_sync``),
    before sharding as Lightning's ``FSDPStrategy`` does. torch's SyncBatchNorm runs on accelerators only: on CPU
    a model with BatchNorm layers is refused here, before any step, instead of failing in its first forward."""
    norms = batch_norms(model)
    if norms and device.type == "cpu":
        raise ValueError(
            f"Trainer(sync_batchnorm=True) on CPU: torch's SyncBatchNorm runs on GPU/XPU only ({norms[0]} is a"
            " BatchNorm). Drop sync_batchnorm on CPU (each rank then normalizes over its own batch)"
        )
    return layer_sync.apply(model) if norms else model


def sync_module_states(model: nn.Module, *, device: torch.device) -> None:
    """Rank 0's parameters and buffers on every rank, one tensor at a time (before sharding)."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            if tensor.is_meta:
                continue
            staged = tensor.detach().to(device)  # nccl needs device tensors; gloo takes CPU ones as they are
            dist.broadcast(staged, src=0)
            tensor.copy_(staged)


def shard_model(model: nn.Module, plan: ShardingPlan, *, mesh: DeviceMesh) -> list[FSDPModule]:
    """Stage 4: ``fully_shard`` every unit of the plan (:func:`~lightning_fsdp_plus.sharding.apply_sharding_plan`)."""
    return apply_sharding_plan(model, plan, mesh=mesh)


def materialize_model(
    model: nn.Module,
    *,
    device: torch.device,
    param_init_fn: Callable[[nn.Module], Any] | None = None,
    report: Callable[[str], Any] = lambda _: None,
) -> None:
    """Stage 5: tensors still on the meta device become real. Deferred pretrained models are loaded from their
    checkpoints, each rank reading its shards (:func:`~lightning_fsdp_plus.loading.load_pretrained_weights`); the
    rest get ``param_init_fn`` per module (FSDP1's contract), else ``to_empty`` + ``reset_parameters``
    (Lightning's helper)."""
    load_pretrained_weights(model, device=device, report=report)
    if param_init_fn is None:
        without_reset = _meta_modules_without_reset(model)
        _materialize_distributed_module(model, device)
        _init_transformers_modules(model, without_reset)
        return
    for module in model.modules():
        own = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
        if any(t.is_meta for t in own):
            param_init_fn(module)


def _meta_modules_without_reset(model: nn.Module) -> list[nn.Module]:
    """Modules with meta tensors of their own and no ``reset_parameters``: ``to_empty`` leaves them garbage."""
    return [m for m in model.modules() if not callable(getattr(m, "reset_parameters", None))
            and any(t.is_meta for t in (*m.parameters(recurse=False), *m.buffers(recurse=False)))]  # fmt: skip


def _init_transformers_modules(model: nn.Module, modules: list[nn.Module]) -> None:
    """Initialize ``modules`` that belong to a transformers model with its own ``_init_weights`` (a model built on
    the meta device, e.g. under ``fabric.init_module(empty_init=True)``: its rotary ``inv_freq`` buffer and RMSNorm
    weights have no ``reset_parameters``; left to ``to_empty`` they are garbage and the first loss is NaN)."""
    if not modules:
        return
    owners = {id(m): owner for owner in model.modules() if callable(getattr(owner, "_init_weights", None))
              and hasattr(owner, "config") for m in owner.modules()}  # fmt: skip
    with torch.no_grad():
        for module in modules:
            owner = owners.get(id(module))
            if owner is not None:
                owner._init_weights(module)


def build_sharded_model(
    model: nn.Module,
    options: FSDPPlusOptions,
    *,
    mesh: DeviceMesh,
    layout: MeshLayout,
    precision: Any,
    device: torch.device,
    report: Callable[[str], Any] = lambda _: None,
) -> tuple[nn.Module, ShardingPlan]:
    """Every stage in order; ``precision`` is the precision plugin (its ``convert_now`` runs after int8 so that
    quantization reads the float weights). Returns the (converted) model and the plan it was sharded by."""
    prepare_model(model, options)
    converted = quantize_model(model, options)
    if converted:
        kind = "int8 (LLM.int8)" if options.quantize_base == "int8" else f"4-bit {options.quantize_base}"
        report(f"fsdp_plus: {len(converted)} frozen linear layers now {kind}")
    model = precision.convert_now(model)
    if options.sync_module_states:
        sync_module_states(model, device=device)
    if options.tensor_parallel_size > 1:  # torchtitan's order: tensor parallel, checkpointing, compile, FSDP
        layers = tensor_parallel_layers(model, options)
        apply_tensor_parallel(model, layers, mesh=mesh["tensor"])
        head = " (the output head over the vocabulary: loss parallel)" if options.loss_parallel else ""
        report(f"fsdp_plus: {len(layers)} linear layers split over {mesh['tensor'].size()} tensor-parallel"
               f" ranks{head}")  # fmt: skip
    plan = plan_model(model, options, layout=layout, precision=str(precision.precision), device_type=device.type)
    report(plan.format_table())
    shard_model(model, plan, mesh=mesh)
    # shards live in host memory under CPU offload: materialize (and load) them there, as torchtitan does
    shards_on = torch.device("cpu") if plan.cpu_offload else device
    materialize_model(model, device=shards_on, param_init_fn=options.param_init_fn, report=report)
    return model, plan


def user_sharding_plan(model: nn.Module, options: FSDPPlusOptions, *, layout: MeshLayout) -> ShardingPlan:
    """The plan that describes a model the user sharded (``fully_shard`` in ``configure_model`` or before
    ``fabric.setup``): its ``FSDPModule`` units as they are, for the table and ``strategy.sharding_plan``."""
    return build_sharding_plan(
        model,
        unit_paths=[n for n, m in model.named_modules() if n and isinstance(m, FSDPModule)],
        sharding_strategy=options.sharding_strategy,
        mesh=layout,
        keep_tied_together=False,  # describes the units the user made
    )


def refuse_fsdp1(model: nn.Module) -> None:
    """A model with FSDP1's ``FullyShardedDataParallel`` anywhere in it is refused (both strategies use FSDP2)."""
    if any(isinstance(m, FullyShardedDataParallel) for m in model.modules()):
        raise TypeError(
            "Found modules that are wrapped with `torch.distributed.fsdp.FullyShardedDataParallel` (FSDP1)."
            " fsdp_plus shards with FSDP2 (`fully_shard`): remove the FSDP1 wrapping and let auto_wrap_policy"
            " choose the units"
        )
