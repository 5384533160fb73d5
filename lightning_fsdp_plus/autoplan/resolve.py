"""The auto plan inside the strategy: from the LightningModule to the chosen options.

Two steps, so that a budget nothing fits fails before any process exists: :func:`predict_for_module` (memory only,
in ``Trainer.fit`` before the launch, or in ``setup`` for a model built in ``configure_model``) and
:func:`decide` (after the process group exists: a probe of the real devices and link, step times, the choice,
and a check that every rank chose the same).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lightning_fsdp_plus._dist import all_gather_object
from lightning_fsdp_plus.autoplan.budget import device_memory, parse_budget
from lightning_fsdp_plus.autoplan.choose import AutoPlan, agree_on_choice, predict_memory
from lightning_fsdp_plus.autoplan.probe import probe_hardware
from lightning_fsdp_plus.lora import find_peft_model
from lightning_fsdp_plus.memory.allocator import platform_for
from lightning_fsdp_plus.memory.fake import ForwardBatch
from lightning_fsdp_plus.options import FSDPPlusOptions


def find_transformers_model(module: nn.Module) -> nn.Module | None:
    """The outermost transformers ``PreTrainedModel`` inside ``module`` (the module itself included)."""
    from transformers import PreTrainedModel

    return next((m for m in module.modules() if isinstance(m, PreTrainedModel)), None)


def planning_options(module: nn.Module, options: FSDPPlusOptions) -> tuple[Any, FSDPPlusOptions, bool]:
    """``(transformers config, options to build the fake model with, whether this is a LoRA run)``.

    LoRA comes from ``options.lora`` or from the PEFT model the LightningModule holds; a run with LoRA (frozen base)
    gets ``lora_only`` and quantization candidates.
    """
    found = find_transformers_model(module)
    if found is None:
        raise ValueError(
            f"sharding_strategy='auto' predicts memory from the transformers model's config, and"
            f" {type(module).__name__} holds no transformers PreTrainedModel; choose a sharding_strategy"
            " (fsdp-plus-estimate prints per-strategy memory for any config)"
        )
    lora = options.lora
    peft = find_peft_model(module)
    if lora is None and peft is not None:
        model = peft[1]
        lora = model.peft_config[model.active_adapter]
    return found.config, options.replace(lora=lora), lora is not None


def quantize_kinds(options: FSDPPlusOptions, *, lora_run: bool) -> tuple[str | None, ...]:
    """The base's quantizations to consider: the user's pinned ``quantize_base``, else none plus ``allow_quantize``."""
    if options.quantize_base is not None:
        return (options.quantize_base,)
    if options.allow_quantize and not lora_run:
        raise ValueError(
            f"allow_quantize={list(options.allow_quantize)} quantizes a frozen base, and this run trains every"
            " parameter: configure lora (or apply PEFT in the LightningModule), or leave allow_quantize empty"
        )
    return (None, *options.allow_quantize)


def predict_for_module(
    module: nn.Module,
    options: FSDPPlusOptions,
    *,
    world_size: int,
    precision: str,
    device: torch.device,
    ranks_per_node: int,
) -> AutoPlan:
    """Every candidate's memory for the model inside ``module``; :class:`NoFitError` when none fits."""
    config, build_options, lora_run = planning_options(module, options)
    budget = parse_budget(options.memory_budget, device_memory=device_memory(device, ranks_per_node=ranks_per_node))
    assert options.plan_batch_size is not None and options.plan_seq_len is not None
    plan = predict_memory(
        config,
        options=build_options.replace(sharding_strategy="FULL_SHARD"),
        world_size=world_size,
        precision=precision,
        batch=ForwardBatch(
            batch_size=options.plan_batch_size, seq_len=options.plan_seq_len, packed=bool(options.plan_packed)
        ),
        budget=budget,
        margin=float(options.memory_margin),
        quantize=quantize_kinds(options, lora_run=lora_run),
        lora_run=lora_run,
        accelerator=device.type == "cuda",
        budget_text=str(options.memory_budget),
        platform=platform_for(device.type),
    )
    plan.require_fit()
    return plan


def decide(plan: AutoPlan, options: FSDPPlusOptions, *, config: Any, device: torch.device) -> AutoPlan:
    """Probe the devices and link (every rank), time every candidate, choose, and check all ranks agree."""
    hidden = int(config.hidden_size)
    intermediate = int(getattr(config, "intermediate_size", None) or 4 * hidden)
    kinds = sorted({p.candidate.quantize_base for p in plan.predictions if p.candidate.quantize_base})
    hardware = probe_hardware(features=(hidden, intermediate), tokens=plan.batch.batch_size * plan.batch.seq_len,
                              precision=plan.precision, device=device, quantize=kinds)  # fmt: skip
    decided = plan.with_hardware(hardware.with_link_bandwidth(options.link_bandwidth))
    agree_on_choice(decided, gather=all_gather_object)
    return decided
