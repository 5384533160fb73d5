"""PEFT LoRA helpers: apply LoRA from a config, check trainable parameters, export the adapter.

LoRA itself is PEFT's: ``peft.get_peft_model`` wraps the model and adapter parameter names stay PEFT's.
The export writes PEFT's own format (``adapter_config.json`` + ``adapter_model.safetensors``) from a
sharded model, so ``peft.PeftModel.from_pretrained`` loads it onto a plain base in one process.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from lightning_fsdp_plus._dist import barrier, rank
from lightning_fsdp_plus._private import parse_to

_ALIASES = {"alpha": "lora_alpha", "dropout": "lora_dropout"}
DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""LoRA's default ``target_modules``: every attention and MLP projection of Llama-style models."""


def make_lora_config(lora: Any, *, key: str = "lora") -> Any:
    """A ``peft.LoraConfig`` from one, or from a mapping (``r``, ``alpha``, ``dropout``, ``target_modules``, ...)."""
    from peft import LoraConfig

    if lora is None or isinstance(lora, LoraConfig):
        return lora
    if not isinstance(lora, Mapping):
        raise ValueError(f"{key}={lora!r} must be a peft.LoraConfig or a mapping of LoraConfig fields")
    fields = {_ALIASES.get(k, k): (list(v) if k == "target_modules" and not isinstance(v, str) else v)
              for k, v in lora.items()}  # fmt: skip
    known = {name for name, f in LoraConfig.__dataclass_fields__.items() if f.init}
    unknown = [k for k in lora if _ALIASES.get(k, k) not in known]
    if unknown:
        valid = ", ".join(sorted(known | set(_ALIASES)))  # each key once: our short names beside PEFT's own
        raise ValueError(f"{key} has {', '.join(map(repr, unknown))}, which is not a LoraConfig field; valid keys:"
                         f" {valid}")  # fmt: skip
    _check_lora_numbers(fields, key=key)
    return LoraConfig(**fields)


def _check_lora_numbers(fields: Mapping[str, Any], *, key: str) -> None:
    """PEFT checks these only when it wraps the model; here they fail before any process starts."""
    rank, alpha, dropout = fields.get("r", 8), fields.get("lora_alpha", 8), fields.get("lora_dropout", 0.0)
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(f"{key}.r={rank!r} must be a positive integer (the rank of the low-rank update)")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or alpha <= 0:
        raise ValueError(f"{key}.alpha={alpha!r} must be a positive number (the update is scaled by alpha / r)")
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0 <= dropout < 1:
        raise ValueError(f"{key}.dropout={dropout!r} must be a probability in [0, 1)")


def linear_module_names(model: nn.Module) -> list[str]:
    """Distinct last-name components of the linear layers in ``model`` (what ``target_modules`` matches).

    Layers already wrapped by LoRA count under their own name, not as ``base_layer`` or ``lora_A``.
    """
    names = set()
    for path, module in model.named_modules():
        parts = path.split(".")
        if path and _is_linear(module) and not any(p == "base_layer" or p.startswith("lora_") for p in parts):
            names.add(parts[-1])
    return sorted(names)


def _is_linear(module: nn.Module) -> bool:
    from peft.tuners.lora import LoraLayer

    from lightning_fsdp_plus.quantization.int8 import Int8Linear

    linear_types = (nn.Linear, Int8Linear, LoraLayer)
    return isinstance(module, linear_types) or type(module).__name__ in ("Linear8bitLt", "Conv1D")


def check_target_modules(model: nn.Module, config: Any, *, key: str = "lora.target_modules") -> None:
    """Raise a ValueError listing the model's linear layer names if ``target_modules`` matches none of them."""
    targets = config.target_modules
    if targets is None or targets == "all-linear":
        return
    found = linear_module_names(model)
    if isinstance(targets, str):  # PEFT treats a string as a regex over full module paths
        import re

        matched = any(re.fullmatch(targets, path) for path, _ in model.named_modules())
    else:
        matched = bool(set(targets) & set(found))
    if not matched:
        shown = targets if isinstance(targets, str) else sorted(targets)
        raise ValueError(f"{key}={shown!r} matches no module; linear layers in the model: {', '.join(found)}")


def find_peft_model(module: nn.Module) -> tuple[str, nn.Module] | None:
    """``(path, PeftModel)`` of the first PEFT model inside ``module``, or None."""
    from peft import PeftModel

    for path, sub in module.named_modules():
        if isinstance(sub, PeftModel):
            return path, sub
    return None


def _lora_host(module: nn.Module) -> tuple[str, nn.Module]:
    """The submodule LoRA wraps: the first transformers ``PreTrainedModel``, else the first child."""
    try:
        from transformers import PreTrainedModel
    except ImportError:  # pragma: no cover - transformers is a dependency
        PreTrainedModel = ()  # type: ignore[assignment]
    for path, sub in module.named_modules():
        if path and isinstance(sub, PreTrainedModel):
            return path, sub
    for name, child in module.named_children():
        return name, child
    raise ValueError(f"lora: {type(module).__name__} has no submodule to adapt")


def with_task_type(config: Any, model: nn.Module) -> Any:
    """``config`` with PEFT's ``task_type`` set for ``model`` when it has none: ``CAUSAL_LM`` for a model that
    generates (``PeftModelForCausalLM``), none for others (a masked LM, an encoder: the plain ``PeftModel``)."""
    if config.task_type is not None or not callable(getattr(model, "prepare_inputs_for_generation", None)):
        return config
    return dataclasses.replace(config, task_type="CAUSAL_LM")


def apply_lora(module: nn.Module, lora: Any) -> str:
    """Wrap the model inside ``module`` with ``peft.get_peft_model`` in place; returns the wrapped path.

    Does nothing (and returns the existing path) when a PEFT model is already there, so that calling it
    again for ``validate`` then ``fit`` is harmless.
    """
    from peft import get_peft_model

    existing = find_peft_model(module)
    if existing is not None:
        return existing[0]
    path, host = _lora_host(module)
    config = with_task_type(make_lora_config(lora), host)
    check_target_modules(host, config)
    # PEFT asks for transformers' deprecated `is_gradient_checkpointing`: a FutureWarning no user can act on
    with adapters_stay_real(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing", category=FutureWarning)
        module.set_submodule(path, get_peft_model(host, config))
    return path


class _NothingRealToMeta(TorchFunctionMode):
    """``Tensor.to("meta")`` of a real tensor keeps it where it is (a dtype change still applies)."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.Tensor.to and not args[0].is_meta:
            device, dtype, *_ = parse_to(*args[1:], **kwargs)
            if device is not None and torch.device(device).type == "meta":
                return args[0] if dtype is None else args[0].to(dtype=dtype)
        return func(*args, **kwargs)


@contextmanager
def adapters_stay_real() -> Iterator[None]:
    """Within it, adapters PEFT creates for a base layer on the meta device stay on the CPU.

    PEFT creates and initializes each adapter on the CPU, then moves it to its base layer's device and dtype; for a
    base built on meta (streaming loading) the move would drop the initial values. Within this context nothing
    real moves to meta, so each adapter holds exactly what it would hold on a loaded base (same random draws,
    same dtype), and the loader has nothing to invent.
    """
    with _NothingRealToMeta():
        yield


def init_meta_adapters(module: nn.Module) -> list[str]:
    """Materialize (on the CPU) and initialize, with PEFT's own init, LoRA adapters left on the meta device.

    That happens when PEFT was applied to a model built on meta outside :func:`adapters_stay_real` (e.g. in the
    user's LightningModule). Returns ``"path[adapter]"`` of each adapter initialized.
    """
    from peft.tuners.lora import LoraLayer

    found = find_peft_model(module)
    configs = found[1].peft_config if found is not None else {}
    done = []
    for path, layer in module.named_modules():
        if not isinstance(layer, LoraLayer):
            continue
        for name in list(layer.lora_A):
            adapters = [layer.lora_A[name], layer.lora_B[name]]
            if not any(t.is_meta for a in adapters for t in a.parameters()):
                continue
            init = getattr(configs.get(name), "init_lora_weights", True)
            if not (isinstance(init, bool) or init == "gaussian"):
                raise ValueError(
                    f"lora.init_lora_weights={init!r} initializes {path} from its base weights, which are not loaded"
                    " yet (the base is built on meta); apply LoRA through FSDPPlusStrategy(lora=...), use True or"
                    " 'gaussian', or load with model.low_memory_load=false"
                )
            for adapter in adapters:
                adapter.to_empty(device="cpu")
                if init is False:
                    adapter.reset_parameters()  # PEFT's init_lora_weights=False keeps nn.Linear's own init
            layer.reset_lora_parameters(name, init)
            done.append(f"{path}[{name}]")
    return done


def check_trainable(module: nn.Module, *, key: str = "lora_only") -> None:
    """Raise a ValueError when ``lora_only=True`` would shard nothing (no trainable parameters)."""
    if not any(p.requires_grad for p in module.parameters()):
        raise ValueError(
            f"{key}=True shards the trainable (LoRA) parameters, but the model has none: apply LoRA"
            " (peft.get_peft_model, or FSDPPlusStrategy(lora={...})) or set lora_only=False"
        )


def check_frozen(module: nn.Module, *, key: str = "lora_only") -> None:
    """Raise a ValueError when ``lora_only=True`` would replicate nothing: no parameter is frozen, so every one
    would be sharded and trained as without it."""
    params = list(module.parameters())
    if params and all(p.requires_grad for p in params):
        count = sum(p.numel() for p in params)
        raise ValueError(
            f"{key}=True replicates the frozen base and shards the trainable (LoRA) parameters, but nothing in the"
            f" model is frozen: all {count:,} parameters would be sharded and trained. Give lora={{...}} (e.g."
            " lora={'r': 16}; in Hydra strategy.lora.r=16) or apply LoRA yourself (peft.get_peft_model), or set"
            f" {key}=False for a full fine-tune"
        )


def frozen_parameters(module: nn.Module) -> set[nn.Parameter]:
    """Parameters with ``requires_grad=False`` (the base that ``lora_only=True`` replicates)."""
    return {p for p in module.parameters() if not p.requires_grad}


def full_tensor(tensor: Tensor) -> Tensor:
    """The whole tensor on every rank (all-gathers a DTensor; a plain tensor is returned as is)."""
    gather = getattr(tensor, "full_tensor", None)
    return (gather() if gather is not None else tensor).detach()


def export_adapter(module: nn.Module, directory: str | Path) -> Path | None:
    """Save the LoRA adapter of the PEFT model inside ``module`` in PEFT's format; call on every rank.

    Every rank takes part in gathering the sharded adapter weights; global rank 0 writes
    ``adapter_config.json`` and ``adapter_model.safetensors``. Returns the directory (on every rank).
    """
    found = find_peft_model(module)
    if found is None:
        raise ValueError("export_adapter: the model has no PEFT adapter (apply LoRA first)")
    _, peft_model = found
    state = {name: full_tensor(p).cpu() for name, p in peft_model.named_parameters() if p.requires_grad}
    directory = Path(directory)
    if rank() == 0:
        directory.mkdir(parents=True, exist_ok=True)
        state = {k: v.to(torch.float32) if v.is_floating_point() else v for k, v in state.items()}
        peft_model.save_pretrained(str(directory), state_dict=state, safe_serialization=True)
    barrier()
    return directory
