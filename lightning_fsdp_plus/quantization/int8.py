"""``Int8Linear``: a frozen LLM.int8 linear layer computed by bitsandbytes, stored as plain Parameters.

bitsandbytes' ``Linear8bitLt`` keeps its int8 weight in an ``Int8Params`` subclass and its per-row scale
(``SCB``) in side state, which FSDP cannot flatten (FSDP1: "Cannot flatten integer dtype tensors") or
shard. ``Int8Linear`` holds the same two tensors as ordinary frozen ``nn.Parameter``s:

- ``weight``: ``int8 [out_features, in_features]`` — FSDP2 shards it on dim 0 and all-gathers it as int8;
- ``weight_scale``: the fp32 per-row absmax scale stored *bit for bit* as ``int32 [out_features]``. As an
  integer tensor no mixed-precision policy and no ``module.to(dtype)`` can cast (and so degrade) it, and it
  is sharded row-wise together with the weight.

The forward pass rebuilds bitsandbytes' ``MatmulLtState`` from these tensors and calls ``bnb.matmul``, so
outputs and input gradients are those of ``Linear8bitLt`` (outlier threshold included) and gradients flow
to the input, letting LoRA layers before it train.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from lightning_fsdp_plus.quantization.select import (
    is_bnb_layer,
    is_conv1d,
    layer_candidates,
    meta_shapes,
    replace_layers,
)


def require_bitsandbytes(*, key: str = "quantize_base", value: str = "int8") -> None:
    """Raise an ImportError that says how to install bitsandbytes if it cannot be imported."""
    try:
        import bitsandbytes  # noqa: F401
    except Exception as err:  # bitsandbytes can fail at import with errors other than ImportError
        raise ImportError(
            f"{key}={value!r} needs bitsandbytes (its quantization kernels), which could not be imported: {err}."
            " Install it with: pip install 'bitsandbytes>=0.48'"
        ) from err


class _DropCastNotice(logging.Filter):
    """bitsandbytes logs "inputs will be cast ... to float16" on every eval forward; it is expected here."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "inputs will be cast from" not in record.getMessage()


_CAST_FILTER = _DropCastNotice()


class Int8Linear(nn.Module):
    """Frozen 8-bit linear layer (LLM.int8) whose weight and scale FSDP2 can shard.

    Arguments:
        in_features: Input size.
        out_features: Output size.
        bias: Whether the layer has a (frozen, floating-point) bias.
        threshold: LLM.int8 outlier threshold on activations (bitsandbytes' ``threshold``; 0 disables it).
        bias_dtype: dtype of the bias.
        source_layout: Layout of the float weight it is quantized from: ``"linear"`` (``[out, in]``) or
            ``"conv1d"`` (transformers ``Conv1D``, ``[in, out]``); the weight here is always ``[out, in]``.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        threshold: float = 6.0,
        bias_dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        source_layout: str = "linear",
    ) -> None:
        super().__init__()
        self.source_layout = source_layout
        logging.getLogger("bitsandbytes.autograd._functions").addFilter(_CAST_FILTER)  # idempotent
        self.in_features, self.out_features, self.threshold = in_features, out_features, float(threshold)
        self.weight = nn.Parameter(torch.zeros(out_features, in_features, dtype=torch.int8, device=device),
                                   requires_grad=False)  # fmt: skip
        self.weight_scale = nn.Parameter(torch.zeros(out_features, dtype=torch.int32, device=device),
                                         requires_grad=False)  # fmt: skip
        self.bias = (
            nn.Parameter(torch.zeros(out_features, dtype=bias_dtype, device=device), requires_grad=False)
            if bias
            else None
        )

    @property
    def scale(self) -> Tensor:
        """The fp32 per-row scale (absmax of each weight row), a view of ``weight_scale``'s bits."""
        return self.weight_scale.view(torch.float32)

    def forward(self, x: Tensor) -> Tensor:
        """``x @ dequant(weight).T + bias`` through bitsandbytes' LLM.int8 matmul (in training on CPU/XPU, its
        dequantize-then-matmul path without keeping ``x``: :class:`_DequantizedMatmul`)."""
        import bitsandbytes as bnb

        bias = self.bias
        if bias is not None and bias.dtype != x.dtype:
            bias = bias.to(x.dtype)
        if self.training and x.device.type in ("cpu", "xpu"):
            if torch.compiler.is_compiling():  # the same operations, traced (see _compiled_int8_linear)
                return _compiled_int8_linear(x, self.weight, self.scale, bias)
            return _DequantizedMatmul.apply(x, self.weight, self.scale, bias)
        state = bnb.MatmulLtState()
        state.CB, state.SCB = self.weight, self.scale
        state.has_fp16_weights = False
        state.threshold = self.threshold
        state.use_pool = self.threshold > 0.0
        state.is_training = self.training
        return bnb.matmul(x, self.weight, bias=bias, state=state)

    def dequantize(self) -> Tensor:
        """The float weight the int8 weight stands for (``weight * scale / 127``)."""
        return self.weight.float() * (self.scale.unsqueeze(1) / 127.0)

    @torch.no_grad()
    def load_quantized(self, weight: Tensor, scale: Tensor, bias: Tensor | None) -> Int8Linear:
        """Fill from an int8 weight, its fp32 per-row scale and an optional bias; returns self."""
        self.weight.copy_(weight.to(torch.int8))
        self.weight_scale.copy_(scale.to(torch.float32).contiguous().view(torch.int32))
        if self.bias is not None and bias is not None:
            self.bias.copy_(bias)
        return self

    @classmethod
    @torch.no_grad()
    def from_linear(cls, linear: nn.Linear, *, threshold: float = 6.0) -> Int8Linear:
        """Quantize a float ``nn.Linear`` exactly as ``Linear8bitLt`` does (fp16, row-wise absmax)."""
        weight = linear.weight.detach()
        cb, scb = quantize_rows(weight)
        bias = linear.bias
        layer = cls(linear.in_features, linear.out_features, bias is not None, threshold=threshold,
                    bias_dtype=bias.dtype if bias is not None else torch.float32, device=weight.device)  # fmt: skip
        return layer.load_quantized(cb, scb, None if bias is None else bias.detach())

    @classmethod
    @torch.no_grad()
    def from_conv1d(cls, conv: nn.Module, *, threshold: float = 6.0) -> Int8Linear:
        """Quantize a transformers ``Conv1D`` (GPT-2 style: ``weight [in, out]``, ``y = x @ weight + bias``).

        The result holds the weight transposed, as ``nn.Linear`` does, and computes the same function.
        """
        weight = conv.weight.detach()
        linear = nn.Linear(weight.shape[0], weight.shape[1], bias=conv.bias is not None, device="meta")
        linear.weight = nn.Parameter(weight.t(), requires_grad=False)
        linear.bias = None if conv.bias is None else nn.Parameter(conv.bias.detach(), requires_grad=False)
        layer = cls.from_linear(linear, threshold=threshold)
        layer.source_layout = "conv1d"
        return layer

    @classmethod
    @torch.no_grad()
    def from_bnb(cls, layer: nn.Module) -> Int8Linear:
        """Convert a quantized ``bnb.nn.Linear8bitLt`` (e.g. from ``load_in_8bit=True``) losslessly."""
        state = layer.state
        cb = state.CB if state.CB is not None else layer.weight.data
        scb = state.SCB if state.SCB is not None else getattr(layer.weight, "SCB", None)
        if scb is None or cb.dtype != torch.int8:
            raise ValueError(
                f"{type(layer).__name__} is not quantized yet (no int8 weight / SCB); move it to its device first"
            )
        bias = layer.bias
        out = cls(layer.in_features, layer.out_features, bias is not None, threshold=state.threshold,
                  bias_dtype=bias.dtype if bias is not None else torch.float32, device=cb.device)  # fmt: skip
        return out.load_quantized(cb, scb, None if bias is None else bias.detach())

    def extra_repr(self) -> str:
        layout = ", source_layout=conv1d" if self.source_layout == "conv1d" else ""
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, threshold={self.threshold}{layout}"
        )


def _dequantized(weight: Tensor, scale: Tensor, *, dtype: torch.dtype) -> Tensor:
    """``weight * scale / 127`` in ``dtype``, as bitsandbytes' ``MatMul8bitFp`` computes it (a fresh tensor)."""
    return weight.to(dtype, copy=True).mul_(scale.unsqueeze(1).mul(1.0 / 127.0))


def _compiled_int8_linear(x: Tensor, weight: Tensor, scale: Tensor, bias: Tensor | None) -> Tensor:
    """The training matmul as torch.compile traces it: plain operations (fused by inductor), with the dequantization
    marked for recomputation. Traced, :class:`_DequantizedMatmul`'s forward and backward dequantize the same weight,
    and AOTAutograd's partitioner kept the forward's float weight for backward instead of dequantizing again: every
    int8 layer's weight in bf16 until backward (LoRA + int8 on a 135M Llama: tensor peak 245 -> 471 MiB). Inside
    ``checkpoint`` it is recomputed from the int8 weight (221 MiB, eager 245; step 0.72x eager's; docs/compile.md)."""
    dequantized = checkpoint(functools.partial(_dequantized, dtype=x.dtype), weight, scale, use_reentrant=False)
    return torch.nn.functional.linear(x, dequantized, bias)


class _DequantizedMatmul(torch.autograd.Function):
    """bitsandbytes' CPU/XPU training matmul (``MatMul8bitFp``: the int8 weight dequantized, then a float matmul),
    operation for operation, minus its ``ctx.A``. bitsandbytes keeps the input as a context attribute for a weight
    gradient a frozen int8 weight never has; an attribute, unlike a saved tensor, is invisible to activation
    checkpointing, so every checkpointed int8 layer's input stayed alive until backward (LoRA + int8 + checkpointing
    on a 135M Llama: 11-15% above the planned peak)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, scale: Tensor, bias: Tensor | None) -> Tensor:
        dequantized = _dequantized(weight, scale, dtype=x.dtype)
        ctx.save_for_backward(weight, scale)
        ctx.input_shape, ctx.input_dtype = x.shape, x.dtype
        return torch.nn.functional.linear(x, dequantized, bias)

    @staticmethod
    def backward(ctx: Any, grad_output: Tensor) -> tuple[Tensor | None, None, None, Tensor | None]:
        weight, scale = ctx.saved_tensors
        flat = grad_output.reshape(-1, grad_output.shape[-1]).contiguous()
        grad_bias = flat.sum(0) if ctx.needs_input_grad[3] else None
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = torch.matmul(flat.to(ctx.input_dtype), _dequantized(weight, scale, dtype=ctx.input_dtype))
            grad_x = grad_x.view(ctx.input_shape)
        return grad_x, None, None, grad_bias


@torch.no_grad()
def quantize_rows(weight: Tensor) -> tuple[Tensor, Tensor]:
    """LLM.int8 row-wise quantization as ``Linear8bitLt`` does it: ``(int8 weight, fp32 absmax per row)``.

    Each row is quantized on its own, so quantizing a block of rows equals quantizing the whole weight and
    slicing (what streaming loading relies on).
    """
    from bitsandbytes.functional import int8_vectorwise_quant

    cb, scb, _ = int8_vectorwise_quant(weight.to(torch.float16).contiguous())
    return cb, scb


def _is_bnb_int8(module: nn.Module) -> bool:
    return is_bnb_layer(module, "Linear8bitLt")


QUANTIZABLE = ("nn.Linear (and subclasses with its forward)", "transformers Conv1D",
               "bitsandbytes Linear8bitLt / Linear4bit")  # fmt: skip
"""The layer types ``quantize_base`` converts (float ones when frozen; bitsandbytes ones of the same kind)."""


def int8_candidates(model: nn.Module, *, skip: Sequence[str] = ("lm_head",)) -> list[str]:
    """Paths ``convert_to_int8`` would convert.

    Every ``nn.Linear`` (and subclass computing the same map, e.g. Falcon's ``FalconLinear``) and transformers
    ``Conv1D`` whose parameters are all frozen, and every bitsandbytes ``Linear8bitLt``, unless it is a LoRA adapter
    (``lora_`` in its path), its path or name matches a ``skip`` pattern (``fnmatch``, e.g. ``"lm_head"``,
    ``"*.mlp.down_proj"``), it is the model's output head (``get_output_embeddings``) or its weight is tied to
    another module's (:func:`~lightning_fsdp_plus.quantization.select.kept_float` says which and why).
    """
    return layer_candidates(model, skip=skip, prequantized=_is_bnb_int8)


def frozen_layer_types(model: nn.Module) -> list[str]:
    """Class names of the modules that hold frozen parameters of their own (for errors that find nothing)."""
    return sorted(
        {type(m).__name__ for m in model.modules() if any(not p.requires_grad for p in m.parameters(recurse=False))}
    )


def convert_to_int8(model: nn.Module, *, skip: Sequence[str] = ("lm_head",), threshold: float = 6.0) -> list[str]:
    """Replace the ``int8_candidates`` with ``Int8Linear`` in place; returns the converted module paths.

    Float layers are quantized like ``Linear8bitLt``; bitsandbytes layers are converted losslessly. Layers on
    the meta device (a model built without weights) become empty ``Int8Linear`` layers of the same shapes.
    """
    require_bitsandbytes()

    def convert(module: nn.Module) -> Int8Linear:
        if _is_bnb_int8(module):
            return Int8Linear.from_bnb(module)
        if module.weight.is_meta:
            bias_dtype = module.bias.dtype if module.bias is not None else torch.float32
            in_features, out_features, layout = meta_shapes(module)
            return Int8Linear(in_features, out_features, module.bias is not None, threshold=threshold,
                              bias_dtype=bias_dtype, device="meta", source_layout=layout)  # fmt: skip
        if is_conv1d(module):
            return Int8Linear.from_conv1d(module, threshold=threshold)
        return Int8Linear.from_linear(module, threshold=threshold)

    return replace_layers(model, int8_candidates(model, skip=skip), convert)
