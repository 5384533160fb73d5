"""bitsandbytes' notice about an optional hub kernel, kept out of every start.

bitsandbytes 0.50, on a CPU with AVX512-BF16, tries at import to fetch a faster 4-bit CPU kernel through the optional
``kernels`` package (which downloads it from the Hugging Face Hub) and, when the package is not installed, logs
``Failed to load CPU gemm_4bit_forward from kernels-community: No module named 'kernels'...`` as a warning — which
``import lightning_fsdp_plus`` (peft and transformers import bitsandbytes) then printed at every start. Nothing failed:
the kernel serves only ``gemv_4bit`` (a 4-bit layer's forward on one token, without grad: single-sequence decoding),
and bitsandbytes falls back to its own compiled CPU kernel; training never takes that path. Installing ``kernels``
does not help offline (it fetches the kernel at import). So that one message, with that one cause, is dropped from
that one logger; every other bitsandbytes warning, this message with another cause included, still shows.
"""

from __future__ import annotations

import logging

BNB_CPU_OPS_LOGGER = "bitsandbytes.backends.cpu.ops"
"""The logger bitsandbytes' CPU backend logs the notice on."""
NOTICE = "Failed to load CPU gemm_4bit_forward from kernels-community"
"""The start of the notice."""
CAUSE = "No module named 'kernels'"
"""The only cause dropped: the optional package is not installed."""


class OptionalKernelNotice(logging.Filter):
    """Drops bitsandbytes' "Failed to load CPU gemm_4bit_forward ... No module named 'kernels'" record; passes every
    other record."""

    def filter(self, record: logging.LogRecord) -> bool:
        """False for the notice about the missing optional package, True for anything else."""
        message = record.getMessage()
        return not (message.startswith(NOTICE) and CAUSE in message)


def drop_optional_kernel_notice() -> None:
    """Put :class:`OptionalKernelNotice` on bitsandbytes' CPU backend logger (once); call it before bitsandbytes is
    imported."""
    logger = logging.getLogger(BNB_CPU_OPS_LOGGER)
    if not any(isinstance(f, OptionalKernelNotice) for f in logger.filters):
        logger.addFilter(OptionalKernelNotice())


drop_optional_kernel_notice()  # on import: ``lightning_fsdp_plus/__init__.py`` imports this module before the rest
