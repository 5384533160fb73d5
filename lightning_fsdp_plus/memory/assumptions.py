"""The estimator's assumptions, in one place: bytes per parameter by precision and optimizer.

These tables are what :mod:`~lightning_fsdp_plus.memory.estimate` computes with, and
:func:`assumptions_markdown` renders them for ``docs/memory.md`` (a test keeps the two identical).
The figures describe FSDP2 as this package configures it (``precision.py``), checked against
``MemoryMonitor`` measurements; they differ from the ZeRO paper's where FSDP2 differs from ZeRO.
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_fsdp_plus.plan import ShardingStrategy


@dataclass(frozen=True)
class PrecisionBytes:
    """Bytes per element of a floating-point parameter under one ``precision`` preset."""

    stored: int
    """The sharded parameter FSDP2 keeps (also the optimizer's master copy: there is no separate one)."""
    grad: int
    """The sharded gradient (FSDP2 reduce-scatters in ``reduce_dtype`` and keeps the parameter's dtype)."""
    compute: int
    """The all-gathered (unsharded) copy forward and backward use (``MixedPrecisionPolicy.param_dtype``)."""
    state: int
    """One optimizer state element (torch optimizers keep state in the parameter's dtype)."""


PRECISION_BYTES: dict[str, PrecisionBytes] = {
    "32-true": PrecisionBytes(stored=4, grad=4, compute=4, state=4),
    "bf16-mixed": PrecisionBytes(stored=4, grad=4, compute=2, state=4),
    "16-mixed": PrecisionBytes(stored=4, grad=4, compute=2, state=4),
    "bf16-true": PrecisionBytes(stored=2, grad=2, compute=2, state=2),
    "16-true": PrecisionBytes(stored=2, grad=2, compute=2, state=2),
}
"""Per precision preset: bytes per element of each copy of a floating-point parameter."""

OPTIMIZER_STATES: dict[str, int] = {"adamw": 2, "adam": 2, "sgd-momentum": 1, "sgd": 0}
"""State tensors per trainable parameter: Adam(W) ``exp_avg`` + ``exp_avg_sq``; SGD's momentum buffer."""

OPTIMIZER_TEMPORARIES: dict[str, int] = {"adamw": 1, "adam": 1, "sgd-momentum": 0, "sgd": 0}
"""State-sized temporaries ``optimizer.step()`` allocates per trainable parameter: torch's foreach Adam(W) computes
``sqrt(exp_avg_sq)`` into a new tensor list before the update; SGD updates in place."""

GRADIENT_TEMPORARIES = 2
"""Tensors of the largest saved activation's size that backward adds at its peak: that activation's gradient and
the gradient its backward computes beside it (measured with ``benchmarks/memory_trace.py``, docs/memory.md)."""

INT8_BYTES = 1
"""An int8 base weight element; its per-row scale is 4 bytes (fp32 bits in an int32, never cast)."""

STRATEGY_ROWS: dict[ShardingStrategy, str] = {
    ShardingStrategy.FULL_SHARD: "params, grads, optimizer ÷ N; every unit re-gathered for backward",
    ShardingStrategy.SHARD_GRAD_OP: "params, grads, optimizer ÷ N; all units' compute copies kept forward→backward",
    ShardingStrategy.NO_SHARD: "nothing ÷; compute copies kept forward→backward (DDP-like)",
    ShardingStrategy.HYBRID_SHARD: "like FULL_SHARD within groups of S ranks (÷ S), replicated across groups",
}
"""What each strategy divides, and which unsharded copies stay alive from forward to backward."""


def assumptions_markdown() -> str:
    """The tables above as Markdown (pasted into ``docs/memory.md``; a test compares)."""
    lines = [
        "| precision | stored param | grad | compute copy | optimizer state element |",
        "|---|---|---|---|---|",
    ]
    lines += [f"| {name} | {b.stored} | {b.grad} | {b.compute} | {b.state} |" for name, b in PRECISION_BYTES.items()]
    lines += ["", "| optimizer | state tensors per trainable parameter | temporaries during step() |", "|---|---|---|"]
    lines += [f"| {name} | {count} | {OPTIMIZER_TEMPORARIES[name]} |" for name, count in OPTIMIZER_STATES.items()]
    lines += ["", "| strategy | per rank |", "|---|---|"]
    lines += [f"| {strategy.value} | {text} |" for strategy, text in STRATEGY_ROWS.items()]
    return "\n".join(lines) + "\n"
