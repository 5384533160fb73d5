"""``FourBitLinear``: a frozen 4-bit (NF4 / FP4, QLoRA) linear layer whose packed weight and statistics FSDP2 shards.

bitsandbytes' ``Linear4bit`` keeps its packed weight in a ``Params4bit`` subclass, flattened to ``[numel / 2, 1]``,
and its statistics in a ``QuantState`` object beside it; FSDP2 can shard neither by rows. ``FourBitLinear`` holds
the same bytes as ordinary frozen tensors laid out by rows:

- ``weight``: ``uint8 [out_features, in_features / 2]``, two 4-bit codes per byte (bitsandbytes' packing); a
  quantization block of ``blocksize`` values lies inside one row when ``blocksize`` divides ``in_features``, so
  FSDP2 can shard it on dim 0 and all-gather it packed;
- ``weight_absmax``: the per-block absmax, ``[out_features, in_features / blocksize]``, sharded with the weight:
  fp32 values stored bit for bit as ``int32`` (no mixed-precision policy or ``module.to(dtype)`` can cast them), or
  with double quantization the 8-bit codes (``uint8``);
- double quantization's second-level statistics (one fp32 absmax per 256 first-level ones, their mean, the 8-bit
  code) span rows: frozen Parameters of their own (4 bytes per 16,384 weights at blocksize 64), which FSDP2 shards
  evenly and gathers whole with the unit;
- ``quant_map``: the type's 16 levels, a non-persistent buffer (a constant, not saved).

The forward pass rebuilds bitsandbytes' ``QuantState`` from these tensors and calls ``bnb.matmul_4bit`` as
``Linear4bit`` does, so outputs and input gradients are ``Linear4bit``'s (tested bit for bit).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from lightning_fsdp_plus.quantization.select import (
    is_bnb_layer,
    is_conv1d,
    layer_candidates,
    meta_shapes,
    replace_layers,
)

FOUR_BIT_TYPES = ("nf4", "fp4")
"""4-bit data types (bitsandbytes' ``quant_type``)."""
BLOCKSIZES = (32, 64, 128, 256, 512, 1024, 2048, 4096)
"""Quantization block sizes bitsandbytes supports."""
NESTED_BLOCKSIZE = 256
"""Block size of double quantization's second level (bitsandbytes' fixed value)."""


def check_four_bit(*, quant_type: str, blocksize: int, in_features: int | None = None, where: str = "") -> None:
    """Raise ValueError for an unknown type or block size, or a layer whose rows do not hold whole blocks."""
    if quant_type not in FOUR_BIT_TYPES:
        raise ValueError(
            f"quantize_base={quant_type!r} is not a 4-bit type; valid choices: {', '.join(FOUR_BIT_TYPES)}"
        )
    if blocksize not in BLOCKSIZES:
        raise ValueError(f"quantize_blocksize={blocksize!r} is not one of {', '.join(map(str, BLOCKSIZES))}")
    if in_features is not None and in_features % blocksize:
        name = next((part for part in reversed(where.split(".")) if part != "base_layer"), where)
        raise ValueError(
            f"{where or 'a layer'} has in_features={in_features}, not a multiple of quantize_blocksize={blocksize}:"
            " its 4-bit blocks would straddle rows, which FSDP2 shards separately. Choose a blocksize that divides"
            f" it, or leave the layer in float with quantize_skip=[{name!r}]"
        )


def _bits(tensor: Tensor) -> Tensor:
    """fp32 values as their int32 bit patterns (a view)."""
    return tensor.to(torch.float32).contiguous().view(torch.int32)


class FourBitLinear(nn.Module):
    """Frozen 4-bit linear layer (bitsandbytes NF4 / FP4) whose packed weight and statistics FSDP2 can shard.

    Arguments:
        in_features: Input size (a multiple of ``blocksize``).
        out_features: Output size.
        bias: Whether the layer has a (frozen, floating-point) bias.
        quant_type: ``"nf4"`` or ``"fp4"``.
        blocksize: Values per quantization block.
        double_quant: Quantize the block absmax values again (bitsandbytes' ``compress_statistics``).
        weight_dtype: dtype the weight was quantized from (what dequantization returns).
        compute_dtype: dtype of the matmul; ``None`` computes in the input's (``Linear4bit``'s default).
        bias_dtype: dtype of the bias.
        source_layout: ``"linear"`` (``[out, in]``) or ``"conv1d"`` (transformers ``Conv1D``, ``[in, out]``): the
            layout of the float weight it is quantized from; the layer itself always computes ``x @ W.T``.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        quant_type: str = "nf4",
        blocksize: int = 64,
        double_quant: bool = False,
        weight_dtype: torch.dtype = torch.float32,
        compute_dtype: torch.dtype | None = None,
        bias_dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        source_layout: str = "linear",
    ) -> None:
        super().__init__()
        check_four_bit(quant_type=quant_type, blocksize=blocksize, in_features=in_features)
        self.in_features, self.out_features = in_features, out_features
        self.quant_type, self.blocksize, self.double_quant = quant_type, blocksize, double_quant
        self.weight_dtype, self.compute_dtype, self.source_layout = weight_dtype, compute_dtype, source_layout
        blocks = in_features // blocksize

        def frozen(*shape: int, dtype: torch.dtype) -> nn.Parameter:
            return nn.Parameter(torch.zeros(*shape, dtype=dtype, device=device), requires_grad=False)

        self.weight = frozen(out_features, in_features // 2, dtype=torch.uint8)
        self.weight_absmax = frozen(out_features, blocks, dtype=torch.uint8 if double_quant else torch.int32)
        self.bias = frozen(out_features, dtype=bias_dtype) if bias else None
        # the type's 16 levels: a constant (bitsandbytes' get_4bit_type), kept out of checkpoints
        self.register_buffer("quant_map", torch.zeros(16, dtype=torch.int32, device=device), persistent=False)
        if double_quant:  # second-level statistics: frozen base state like the weight (FSDP2 gathers them whole)
            nested = -(-(out_features * blocks) // NESTED_BLOCKSIZE)
            self.nested_absmax = frozen(nested, dtype=torch.int32)
            self.nested_quant_map = frozen(256, dtype=torch.int32)
            self.nested_offset = frozen(1, dtype=torch.int32)

    def quant_state(self) -> object:
        """bitsandbytes' ``QuantState`` over this layer's (unsharded) tensors."""
        from bitsandbytes.functional import QuantState

        shape = torch.Size([self.out_features, self.in_features])
        code = self.quant_map.view(torch.float32)
        if not self.double_quant:
            absmax = self.weight_absmax.reshape(-1).view(torch.float32)
            return QuantState(absmax=absmax, shape=shape, code=code, blocksize=self.blocksize,
                              quant_type=self.quant_type, dtype=self.weight_dtype)  # fmt: skip
        nested = QuantState(absmax=self.nested_absmax.view(torch.float32),
                            code=self.nested_quant_map.view(torch.float32), blocksize=NESTED_BLOCKSIZE,
                            dtype=torch.float32)  # fmt: skip
        return QuantState(absmax=self.weight_absmax.reshape(-1), shape=shape, code=code, blocksize=self.blocksize,
                          quant_type=self.quant_type, dtype=self.weight_dtype,
                          offset=self.nested_offset.view(torch.float32)[0], state2=nested)  # fmt: skip

    def forward(self, x: Tensor) -> Tensor:
        """``x @ dequant(weight).T + bias`` through ``bnb.matmul_4bit``, cast as ``Linear4bit`` casts."""
        import bitsandbytes as bnb

        inp_dtype = x.dtype
        compute = self.compute_dtype
        if compute is None and x.dtype in (torch.float32, torch.bfloat16):
            compute = x.dtype  # Linear4bit adopts the first input's dtype when none is set
        if compute is not None:
            x = x.to(compute)
        bias = None if self.bias is None else self.bias.to(x.dtype)
        # transposed, as Linear4bit passes it through bitsandbytes 0.48 (0.49 and 0.50 accept this layout too)
        packed = self.weight.reshape(-1, 1).t()
        return bnb.matmul_4bit(x, packed, bias=bias, quant_state=self.quant_state()).to(inp_dtype)

    def dequantize(self) -> Tensor:
        """The float weight the packed one stands for (``[out, in]``, in ``weight_dtype``)."""
        from bitsandbytes.functional import dequantize_4bit

        return dequantize_4bit(self.weight.reshape(-1, 1), self.quant_state())

    @torch.no_grad()
    def load_quantized(self, packed: Tensor, state: object, bias: Tensor | None) -> FourBitLinear:
        """Fill from bitsandbytes' packed weight (``[numel / 2, 1]``) and its ``QuantState``; returns self."""
        self.weight.copy_(packed.reshape(self.out_features, -1))
        if self.double_quant:
            self.weight_absmax.copy_(state.absmax.reshape(self.out_features, -1))
            self.nested_absmax.copy_(_bits(state.state2.absmax))
            self.nested_quant_map.copy_(_bits(state.state2.code))
            self.nested_offset.copy_(_bits(state.offset.reshape(1)))
        else:
            self.weight_absmax.copy_(_bits(state.absmax).reshape(self.out_features, -1))
        self.quant_map.copy_(_bits(state.code))
        if self.bias is not None and bias is not None:
            self.bias.copy_(bias)
        return self

    @classmethod
    @torch.no_grad()
    def from_linear(
        cls,
        linear: nn.Module,
        *,
        quant_type: str = "nf4",
        blocksize: int = 64,
        double_quant: bool = False,
        compute_dtype: torch.dtype | None = None,
    ) -> FourBitLinear:
        """Quantize a float ``nn.Linear`` exactly as ``Linear4bit`` does (``quantize_4bit`` of the weight as is)."""
        from bitsandbytes.functional import quantize_4bit

        weight = linear.weight.detach()
        check_four_bit(quant_type=quant_type, blocksize=blocksize, in_features=weight.shape[1])
        packed, state = quantize_4bit(weight.contiguous(), blocksize=blocksize, compress_statistics=double_quant,
                                      quant_type=quant_type)  # fmt: skip
        bias = linear.bias
        layer = cls(weight.shape[1], weight.shape[0], bias is not None, quant_type=quant_type, blocksize=blocksize,
                    double_quant=double_quant, weight_dtype=weight.dtype, compute_dtype=compute_dtype,
                    bias_dtype=bias.dtype if bias is not None else torch.float32, device=weight.device)  # fmt: skip
        return layer.load_quantized(packed, state, None if bias is None else bias.detach())

    @classmethod
    @torch.no_grad()
    def from_conv1d(cls, conv: nn.Module, **kwargs: object) -> FourBitLinear:
        """Quantize a transformers ``Conv1D`` (``weight [in, out]``) through its transpose (``nn.Linear``'s layout)."""
        weight = conv.weight.detach()
        linear = nn.Linear(weight.shape[0], weight.shape[1], bias=conv.bias is not None, device="meta")
        linear.weight = nn.Parameter(weight.t(), requires_grad=False)
        linear.bias = None if conv.bias is None else nn.Parameter(conv.bias.detach(), requires_grad=False)
        layer = cls.from_linear(linear, **kwargs)  # type: ignore[arg-type]
        layer.source_layout = "conv1d"
        return layer

    @classmethod
    @torch.no_grad()
    def from_bnb(cls, layer: nn.Module) -> FourBitLinear:
        """Convert a quantized ``bnb.nn.Linear4bit`` (e.g. from ``load_in_4bit=True``) losslessly."""
        from bitsandbytes.nn.modules import _convert_weight_packed_for_cpu_inverse

        weight, state = layer.weight.data, layer.weight.quant_state
        if state is None or weight.dtype != torch.uint8:
            raise ValueError(
                f"{type(layer).__name__} is not quantized yet (no packed weight); move it to its device first"
            )
        if getattr(state, "packing_format_for_cpu", False):  # repacked for bitsandbytes' CPU inference kernel
            weight, state = _convert_weight_packed_for_cpu_inverse(weight, state)
        out_features, in_features = state.shape
        bias = layer.bias
        out = cls(in_features, out_features, bias is not None, quant_type=state.quant_type, blocksize=state.blocksize,
                  double_quant=state.nested, weight_dtype=state.dtype, compute_dtype=layer.compute_dtype,
                  bias_dtype=bias.dtype if bias is not None else torch.float32, device=weight.device)  # fmt: skip
        return out.load_quantized(weight, state, None if bias is None else bias.detach())

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None},"
            f" quant_type={self.quant_type}, blocksize={self.blocksize}, double_quant={self.double_quant}"
        )


def _is_bnb_4bit(module: nn.Module) -> bool:
    return is_bnb_layer(module, "Linear4bit")


def four_bit_candidates(model: nn.Module, *, skip: Sequence[str] = ("lm_head",)) -> list[str]:
    """Paths ``convert_to_4bit`` would convert: frozen ``nn.Linear`` / ``Conv1D`` layers and bitsandbytes
    ``Linear4bit`` ones, outside LoRA adapters and ``skip`` (the rule int8 uses)."""
    return layer_candidates(model, skip=skip, prequantized=_is_bnb_4bit)


def check_four_bit_layers(model: nn.Module, *, skip: Sequence[str], blocksize: int) -> None:
    """Every float layer ``convert_to_4bit`` would convert holds whole blocks per row (raises ValueError naming it)."""
    for path in four_bit_candidates(model, skip=skip):
        module = model.get_submodule(path)
        if not _is_bnb_4bit(module):
            in_features, _, _ = meta_shapes(module)
            check_four_bit(quant_type="nf4", blocksize=blocksize, in_features=in_features, where=path)


def convert_to_4bit(
    model: nn.Module,
    *,
    quant_type: str = "nf4",
    blocksize: int = 64,
    double_quant: bool = False,
    skip: Sequence[str] = ("lm_head",),
) -> list[str]:
    """Replace the ``four_bit_candidates`` with ``FourBitLinear`` in place; returns the converted module paths.

    Float layers are quantized like ``Linear4bit`` (from their own dtype); bitsandbytes layers are converted
    losslessly (keeping their own type and block size). Layers on the meta device become empty ones.
    """
    check_four_bit(quant_type=quant_type, blocksize=blocksize)
    check_four_bit_layers(model, skip=skip, blocksize=blocksize)
    settings = {"quant_type": quant_type, "blocksize": blocksize, "double_quant": double_quant}

    def convert(module: nn.Module) -> FourBitLinear:
        if _is_bnb_4bit(module):
            return FourBitLinear.from_bnb(module)
        if module.weight.is_meta:
            in_features, out_features, layout = meta_shapes(module)
            bias_dtype = module.bias.dtype if module.bias is not None else torch.float32
            return FourBitLinear(in_features, out_features, module.bias is not None, **settings,
                                 weight_dtype=module.weight.dtype, bias_dtype=bias_dtype, device="meta",
                                 source_layout=layout)  # fmt: skip
        if is_conv1d(module):
            return FourBitLinear.from_conv1d(module, **settings)
        return FourBitLinear.from_linear(module, **settings)

    return replace_layers(model, four_bit_candidates(model, skip=skip), convert)
