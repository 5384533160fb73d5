"""8-bit and 4-bit base weights that FSDP2 can shard."""

from lightning_fsdp_plus.quantization.fourbit import BLOCKSIZES, FOUR_BIT_TYPES, FourBitLinear, check_four_bit
from lightning_fsdp_plus.quantization.int8 import (
    QUANTIZABLE,
    Int8Linear,
    convert_to_int8,
    frozen_layer_types,
    int8_candidates,
    quantize_rows,
    require_bitsandbytes,
)

QUANTIZE_CHOICES = ("int8",)
"""Values ``quantize_base`` accepts (besides ``None``)."""

__all__ = [
    "BLOCKSIZES",
    "FOUR_BIT_TYPES",
    "QUANTIZABLE",
    "QUANTIZE_CHOICES",
    "FourBitLinear",
    "Int8Linear",
    "check_four_bit",
    "check_quantize_base",
    "convert_to_int8",
    "frozen_layer_types",
    "int8_candidates",
    "quantize_rows",
    "require_bitsandbytes",
]


def check_quantize_base(value: str | None, *, key: str = "quantize_base") -> None:
    """Raise for anything but None and "int8" (4-bit is refused explicitly rather than half-supported)."""
    if value is None or value in QUANTIZE_CHOICES:
        if value == "int8":
            require_bitsandbytes(key=key)
        return
    if value in ("nf4", "fp4", "int4", "4bit"):
        raise ValueError(
            f"{key}={value!r} is not supported yet: 4-bit weights are packed two per byte with per-block"
            " quantization state that FSDP2 cannot shard row-wise; valid choices: None, int8"
        )
    raise ValueError(f"{key}={value!r} is not one of None, int8")
