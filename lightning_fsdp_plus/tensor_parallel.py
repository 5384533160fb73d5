"""Tensor parallelism from the plan a model declares: transformers' ``config.base_model_tp_plan`` (or the user's
``tensor_parallel_plan``), applied with torch's ``parallelize_module`` on the mesh's ``tensor`` dimension, before
FSDP2 shards over the data-parallel dimensions (torchtitan's order: TP, activation checkpointing, compile, FSDP).

Why torch's ``parallelize_module`` rather than transformers' own ``from_pretrained(tp_plan="auto")``: ours receives
a model already built (often on the meta device, with PEFT's LoRA wrappers around the planned layers) and must
give FSDP2, ``torch.distributed.checkpoint`` and the per-rank loader plain DTensor parameters; transformers' path
shards at load time with its own mesh and hooks and knows nothing of the adapters. The plan's meaning is the same:
``colwise`` splits a linear layer's output features (each rank computes some heads, or some of the MLP's hidden
units), ``rowwise`` its input features and sums the partial outputs (one all-reduce per block's attention and MLP).
transformers' attention reshapes with ``-1`` heads, so each rank runs its share of the query and key/value heads.

LoRA adapters follow their base layer (Megatron's layout): on a column-wise layer ``lora_A`` is replicated and
``lora_B`` column-wise, on a row-wise one ``lora_A`` is row-wise and ``lora_B`` replicated, so ``base(x) +
B(A(x))`` adds tensors of the same local shape and no extra collective runs. Replicated parameters get the same
gradient on every tensor-parallel rank (their inputs and output gradients are replicated: torch's styles all-reduce
the input gradient of a column-wise layer).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

STYLE_NAMES = ("colwise", "rowwise", "colwise_gather_output")
"""Plan styles this module applies: transformers' names (torch's ``ColwiseParallel``, ``RowwiseParallel``, and a
column-wise layer whose output is gathered back to full width)."""


LOSS_PARALLEL = "loss_parallel"
"""The style ``loss_parallel=True`` gives the output head (not a plan style): column-wise over the vocabulary, its
logits left as a DTensor sharded on the vocabulary dimension for torch's ``loss_parallel`` cross-entropy."""

_WHOLE_ADAPTERS = {"colwise_gather_output": "colwise", LOSS_PARALLEL: "colwise"}
"""Styles that split a layer as another style in :data:`SPLIT` does but leave its adapters whole."""


def _styles() -> dict[str, Callable[[], Any]]:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {
        "colwise": ColwiseParallel,
        "rowwise": RowwiseParallel,
        "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
        LOSS_PARALLEL: lambda: ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
    }


class TensorParallelError(ValueError):
    """A tensor-parallel plan that cannot be applied to the model: no plan, a pattern that matches nothing, a layer
    that is not a linear layer, or sizes (heads, features) the tensor-parallel ranks do not divide."""


def check_tensor_parallel_plan(plan: Any) -> dict[str, str]:
    """``{module path pattern: style}`` with known styles (a ``TensorParallelError`` lists them otherwise)."""
    if not isinstance(plan, Mapping) or not plan:
        raise TensorParallelError(
            f"tensor_parallel_plan={plan!r} must be a non-empty mapping {{module path pattern: style}}, e.g."
            " {'layers.*.self_attn.q_proj': 'colwise', 'layers.*.self_attn.o_proj': 'rowwise'}"
        )
    checked = {}
    for pattern, style in plan.items():
        if style not in STYLE_NAMES:
            raise TensorParallelError(
                f"tensor_parallel_plan[{pattern!r}]={style!r} is not one of {', '.join(STYLE_NAMES)}"
            )
        checked[str(pattern)] = str(style)
    return checked


def declared_plan(model: nn.Module) -> dict[str, str] | None:
    """The tensor-parallel plan the model declares: the first ``config.base_model_tp_plan`` found on it or a
    submodule (a transformers model; its keys are relative to the base model, matched as path suffixes)."""
    for module in model.modules():
        plan = getattr(getattr(module, "config", None), "base_model_tp_plan", None)
        if plan:
            return dict(plan)
    return None


def _pattern(key: str) -> re.Pattern[str]:
    parts = (r"[^.]+" if part == "*" else re.escape(part) for part in key.split("."))
    return re.compile(r"(?:^|\.)" + r"\.".join(parts) + "$")


def planned_layers(model: nn.Module, plan: Mapping[str, str]) -> dict[str, str]:
    """``{module path: style}`` for every module a plan key matches (as a path suffix, ``*`` one component)."""
    matched: dict[str, str] = {}
    for key, style in plan.items():
        pattern = _pattern(key)
        hits = [path for path, _ in model.named_modules() if path and pattern.search(path)]
        if not hits:
            raise TensorParallelError(f"tensor-parallel plan key {key!r} matches no module of {type(model).__name__}")
        matched.update(dict.fromkeys(hits, style))
    return matched


def _linear(module: nn.Module) -> nn.Module:
    """The linear layer a planned module stands for: itself, or PEFT's ``base_layer`` of a LoRA wrapper."""
    return getattr(module, "base_layer", module)


def resolve_plan(
    model: nn.Module, *, size: int, given: Mapping[str, str] | None = None, loss_parallel: bool = False
) -> dict[str, str]:
    """The layers tensor parallelism splits, ``{module path: style}``, checked against ``size`` ranks: the given
    plan, else the declared one; a ``TensorParallelError`` that says what to give when there is neither, and names
    the numbers when heads or features do not divide. With ``loss_parallel``, the output head too
    (:data:`LOSS_PARALLEL`, :func:`loss_parallel_head`)."""
    plan = dict(given) if given is not None else declared_plan(model)
    if not plan:
        raise TensorParallelError(
            f"tensor_parallel_size={size}: {type(model).__name__} declares no tensor-parallel plan (transformers'"
            " config.base_model_tp_plan) and tensor_parallel_plan is not set. Give tensor_parallel_plan="
            "{'<path>.q_proj': 'colwise', ..., '<path>.o_proj': 'rowwise'} naming its linear layers (each block's"
            " first projections column-wise, the ones after them row-wise; '*' matches one path component), or"
            " split it yourself in configure_model with parallelize_module on device_mesh['tensor_parallel']"
        )
    layers = planned_layers(model, plan)
    for path, style in layers.items():
        linear = _linear(model.get_submodule(path))
        if not isinstance(linear, nn.Linear):
            raise TensorParallelError(
                f"tensor-parallel plan: {path} is a {type(linear).__name__}, not an nn.Linear; {style!r} splits"
                " linear layers only"
            )
        features = linear.in_features if style == "rowwise" else linear.out_features
        if features % size:
            which = "in_features" if style == "rowwise" else "out_features"
            raise TensorParallelError(
                f"tensor_parallel_size={size} does not divide {path}.{which}={features} ({style}); valid sizes:"
                f" {_common_divisors(model, layers)}"
            )
    _check_heads(model, size=size)
    if loss_parallel:
        layers[loss_parallel_head(model, size=size)] = LOSS_PARALLEL
    return layers


def loss_parallel_head(model: nn.Module, *, size: int) -> str:
    """The path of the output head ``loss_parallel=True`` splits over the vocabulary: the ``get_output_embeddings()``
    of the first transformers model in ``model``; a ``TensorParallelError`` when there is none, when it is not a
    ``nn.Linear``, when its weight is the input embedding's (tied), or when ``size`` does not divide the
    vocabulary."""
    found = next(((path, module, head) for path, module in model.named_modules() if (head := _output_head(module))),
                 None)  # fmt: skip
    if found is None:
        raise TensorParallelError(
            f"loss_parallel=True: {type(model).__name__} has no output head (no transformers model with"
            " get_output_embeddings()); use loss_parallel=False, or apply torch's loss_parallel yourself"
        )
    path, module, head = found
    name = next(f"{path}.{n}".lstrip(".") for n, m in module.named_modules() if m is head)
    if not isinstance(head, nn.Linear):  # FSDP2's subclass of a sharded head is one
        raise TensorParallelError(
            f"loss_parallel=True: the output head {name} is a {type(head).__name__}, not an nn.Linear (an adapter"
            " wrapper cannot be split over the vocabulary); use loss_parallel=False"
        )
    embeddings = module.get_input_embeddings() if callable(getattr(module, "get_input_embeddings", None)) else None
    if embeddings is not None and getattr(embeddings, "weight", None) is head.weight:
        raise TensorParallelError(
            f"loss_parallel=True: the output head {name} shares its weight with the input embedding"
            " (tie_word_embeddings); splitting it over the vocabulary would split the embedding too. Use"
            " loss_parallel=False (the head stays whole on each tensor-parallel rank) or an untied model"
        )
    if head.out_features % size:
        raise TensorParallelError(
            f"loss_parallel=True: tensor_parallel_size={size} does not divide the vocabulary of {name}"
            f" (out_features={head.out_features})"
        )
    return name


def _output_head(module: nn.Module) -> nn.Module | None:
    """A transformers model's ``get_output_embeddings()``; None for other modules."""
    getter = getattr(module, "get_output_embeddings", None)
    return getter() if callable(getter) and hasattr(module, "config") else None


def is_loss_parallel_head(module: nn.Module) -> bool:
    """Whether :func:`apply_tensor_parallel` split ``module`` over the vocabulary (its logits are a DTensor)."""
    return bool(getattr(module, "_fsdp_plus_loss_parallel", False))


@contextmanager
def loss_parallel_context(enabled: bool) -> Iterator[None]:
    """torch's ``loss_parallel()`` when ``enabled`` (cross-entropy on vocabulary-sharded logits, forward and
    backward), else nothing."""
    if not enabled:
        yield
        return
    from torch.distributed.tensor.parallel import loss_parallel

    with loss_parallel():
        yield


def gathered(tensor: Any) -> Any:
    """A DTensor made whole on every rank (``full_tensor()``, e.g. loss-parallel logits for decoding); anything
    else as it is."""
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def local_loss(output: Any) -> Any:
    """A step's output with a DTensor loss (replicated, from loss-parallel cross-entropy) made a plain tensor, the
    gradient still flowing: what Lightning's loops and the user's logging expect. Other outputs as they are."""
    from torch.distributed.tensor import DTensor

    if isinstance(output, DTensor):
        return output.to_local()
    if isinstance(output, Mapping) and isinstance(output.get("loss"), DTensor):
        return {**output, "loss": output["loss"].to_local()}
    return output


def _check_heads(model: nn.Module, *, size: int) -> None:
    for module in model.modules():
        config = getattr(module, "config", None)
        heads = getattr(config, "num_attention_heads", None)
        if not isinstance(heads, int):
            continue
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        for name, count in (("num_attention_heads", heads), ("num_key_value_heads", kv_heads)):
            if count % size:
                raise TensorParallelError(
                    f"tensor_parallel_size={size} does not divide {name}={count} of {type(module).__name__}: each"
                    f" tensor-parallel rank runs whole heads (valid sizes: divisors of {heads} and {kv_heads})"
                )
        return


def _common_divisors(model: nn.Module, layers: Mapping[str, str]) -> str:
    sizes = []
    for path, style in layers.items():
        linear = _linear(model.get_submodule(path))
        sizes.append(linear.in_features if style == "rowwise" else linear.out_features)
    top = min(sizes)
    return ", ".join(str(d) for d in range(1, top + 1) if all(s % d == 0 for s in sizes))


SPLIT = {"colwise": (("weight", 0), ("bias", 0), ("lora_B", 0)), "rowwise": (("weight", 1), ("lora_A", 1))}
"""Per style, the parameters a layer splits and their split dimension: a column-wise layer's weight rows, bias and
LoRA ``lora_B`` (:func:`apply_tensor_parallel` makes it column-wise too); a row-wise layer's weight columns and its
``lora_A`` (row-wise too). ``colwise_gather_output`` and :data:`LOSS_PARALLEL` split like ``colwise`` and leave
their adapters whole."""


def local_shapes(model: nn.Module, layers: Mapping[str, str], *, size: int) -> dict[str, tuple[int, ...]]:
    """``{parameter name: one tensor rank's shape}`` for the parameters the planned ``layers`` split over ``size``
    ranks (:data:`SPLIT`), without splitting anything: what the memory estimator counts."""
    shapes: dict[str, tuple[int, ...]] = {}
    for path, style in layers.items():
        module = model.get_submodule(path)
        linear = _linear(module)
        owned = {"weight": linear.weight, "bias": linear.bias}
        if style in _WHOLE_ADAPTERS:
            split = SPLIT[_WHOLE_ADAPTERS[style]][:2]
        else:
            split = SPLIT[style]
            adapter = split[-1][0]
            owned |= {f"{adapter}.{k}": m.weight for k, m in getattr(module, adapter, {}).items()}
        dims = dict(split)
        for name, param in owned.items():
            if param is None:
                continue
            dim = dims.get(name.split(".")[0])
            if dim is None:
                continue
            shape = list(param.shape)
            shape[dim] //= size
            full = next(n for n, p in model.named_parameters() if p is param)
            shapes[full] = tuple(shape)
    return shapes


def apply_tensor_parallel(model: nn.Module, layers: Mapping[str, str], *, mesh: DeviceMesh) -> None:
    """Split each planned layer over the 1-D tensor-parallel ``mesh`` in place (:func:`resolve_plan`'s layers);
    a LoRA wrapper's adapters follow their base layer (see the module docstring)."""
    from torch.distributed.tensor.parallel import parallelize_module

    styles = _styles()
    for path, style in layers.items():
        module = model.get_submodule(path)
        parallelize_module(_linear(module), mesh, styles[style]())
        if style == LOSS_PARALLEL:
            module._fsdp_plus_loss_parallel = True  # read by is_loss_parallel_head (the app's loss)
        if style in SPLIT:  # the adapter on the split side takes its layer's style (SPLIT); the other stays whole
            for adapter in getattr(module, SPLIT[style][-1][0], {}).values():
                parallelize_module(adapter, mesh, styles[style]())
