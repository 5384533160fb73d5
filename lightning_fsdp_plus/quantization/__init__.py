"""8-bit and 4-bit base weights that FSDP2 can shard."""

from lightning_fsdp_plus.quantization.fourbit import (
    BLOCKSIZES,
    FOUR_BIT_TYPES,
    FourBitLinear,
    check_four_bit,
    check_four_bit_layers,
    convert_to_4bit,
    four_bit_candidates,
)
from lightning_fsdp_plus.quantization.int8 import (
    QUANTIZABLE,
    Int8Linear,
    convert_to_int8,
    frozen_layer_types,
    int8_candidates,
    quantize_rows,
    require_bitsandbytes,
)
from lightning_fsdp_plus.quantization.select import PLAIN_LINEAR_SUBCLASSES, kept_float

QUANTIZE_CHOICES = ("int8", *FOUR_BIT_TYPES)
"""Values ``quantize_base`` accepts (besides ``None``)."""

__all__ = [
    "BLOCKSIZES",
    "FOUR_BIT_TYPES",
    "PLAIN_LINEAR_SUBCLASSES",
    "QUANTIZABLE",
    "QUANTIZE_CHOICES",
    "FourBitLinear",
    "Int8Linear",
    "check_four_bit",
    "check_four_bit_layers",
    "check_quantize_base",
    "convert_to_4bit",
    "convert_to_int8",
    "four_bit_candidates",
    "frozen_layer_types",
    "int8_candidates",
    "kept_float",
    "quantize_rows",
    "require_bitsandbytes",
]


def check_quantize_base(value: str | None, *, key: str = "quantize_base") -> None:
    """Raise for anything but None, "int8", "nf4" and "fp4" (and when bitsandbytes cannot be imported)."""
    if value is None:
        return
    if value not in QUANTIZE_CHOICES:
        raise ValueError(f"{key}={value!r} is not one of None, {', '.join(QUANTIZE_CHOICES)}")
    require_bitsandbytes(key=key, value=value)
