"""The configurations the auto plan chooses among: every combination the user allows.

Sharding strategy (``FULL_SHARD``, ``SHARD_GRAD_OP``, ``NO_SHARD``, and ``HYBRID_SHARD`` at every shard-group size
that divides the world, other than 1 and the world itself, which equal ``NO_SHARD``-like replication and
``FULL_SHARD``), ``lora_only`` on and off for LoRA runs (not with ``NO_SHARD``, where nothing is sharded anyway),
activation checkpointing off, full and selective per unit, CPU offload on accelerators, and quantization of the frozen
base only for the kinds the user allowed (``allow_quantize``: it changes numerics). Each candidate keeps its root unit
gathered from forward to backward (faster); one that reshards its units and does not fit so is considered with its root
resharded too (``reshard_root``: see :func:`~lightning_fsdp_plus.autoplan.choose.predict_memory`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from lightning_fsdp_plus.options import FSDPPlusOptions
from lightning_fsdp_plus.plan import ShardingStrategy


@dataclass(frozen=True)
class Candidate:
    """One configuration the auto plan considers."""

    sharding_strategy: ShardingStrategy
    """The sharding strategy."""
    hybrid_shard_size: int | None = None
    """Ranks per shard group (``HYBRID_SHARD`` only)."""
    lora_only: bool = False
    """The frozen base replicated, only the trainable parameters sharded."""
    activation_checkpointing: bool = False
    """Every unit but the root recomputed in backward."""
    checkpointing_mode: str = "full"
    """With checkpointing: ``full`` (each unit's forward recomputed) or ``selective`` (matmul and attention outputs
    kept, the rest recomputed: less memory saved, no matmul recomputed)."""
    cpu_offload: bool = False
    """Sharded state in host memory (accelerators only)."""
    quantize_base: str | None = None
    """The frozen base's quantization, if any."""
    reshard_root: bool = False
    """The root unit resharded after forward too (``reshard_root_after_forward``; strategies that reshard their
    units only), chosen when the candidate does not fit with its root kept gathered from forward to backward."""

    @property
    def strategy_name(self) -> str:
        """``HYBRID_SHARD/4`` for a hybrid candidate, else the strategy's name."""
        value = self.sharding_strategy.value
        return f"{value}/{self.hybrid_shard_size}" if self.hybrid_shard_size else value

    @property
    def label(self) -> str:
        """One line: ``FULL_SHARD + lora_only + checkpointing + int8``."""
        parts = [self.strategy_name]
        parts += ["lora_only"] if self.lora_only else []
        if self.activation_checkpointing:
            parts.append("selective checkpointing" if self.checkpointing_mode == "selective" else "checkpointing")
        parts += ["cpu_offload"] if self.cpu_offload else []
        parts += [self.quantize_base] if self.quantize_base else []
        parts += ["root resharded"] if self.reshard_root else []
        return " + ".join(parts)

    def options(self, base: FSDPPlusOptions) -> FSDPPlusOptions:
        """``base`` with this candidate's choices (checkpointing the user's policy, else the wrap policy's units)."""
        checkpointing = base.activation_checkpointing if base.activation_checkpointing is not None else (
            base.auto_wrap_policy)  # fmt: skip
        return base.replace(
            sharding_strategy=self.sharding_strategy,
            hybrid_shard_size=self.hybrid_shard_size,
            lora_only=self.lora_only,
            activation_checkpointing=checkpointing if self.activation_checkpointing else None,
            activation_checkpointing_mode=self.checkpointing_mode,
            cpu_offload=self.cpu_offload,
            quantize_base=self.quantize_base,
            reshard_root_after_forward=self.reshard_root,
        )

    def to_dict(self) -> dict[str, object]:
        """The choices as plain values (the options to pin for a run without ``auto``)."""
        return {
            "sharding_strategy": self.sharding_strategy.value,
            "hybrid_shard_size": self.hybrid_shard_size,
            "lora_only": self.lora_only,
            "activation_checkpointing": self.activation_checkpointing,
            "activation_checkpointing_mode": self.checkpointing_mode,
            "cpu_offload": self.cpu_offload,
            "quantize_base": self.quantize_base,
            "reshard_root_after_forward": self.reshard_root,
        }


def hybrid_sizes(world_size: int) -> list[int]:
    """Shard-group sizes ``HYBRID_SHARD`` adds: divisors of the world other than 1 and the world."""
    return [s for s in range(2, world_size) if world_size % s == 0]


def enumerate_candidates(
    *,
    world_size: int,
    lora_run: bool,
    quantize: Sequence[str | None] = (None,),
    accelerator: bool = False,
) -> list[Candidate]:
    """Every allowed combination, in a stable order (the table's and the tie-break's)."""
    layouts: list[tuple[ShardingStrategy, int | None]] = [(ShardingStrategy.FULL_SHARD, None),
                                                          (ShardingStrategy.SHARD_GRAD_OP, None)]  # fmt: skip
    layouts += [(ShardingStrategy.HYBRID_SHARD, size) for size in hybrid_sizes(world_size)]
    layouts += [(ShardingStrategy.NO_SHARD, None)]
    out = []
    for strategy, size in layouts:
        modes = (False, True) if lora_run and strategy is not ShardingStrategy.NO_SHARD else (False,)
        for kind in quantize:
            for lora_only in modes:
                for checkpointing, mode in ((False, "full"), (True, "full"), (True, "selective")):
                    for offload in (False, True) if accelerator else (False,):
                        out.append(Candidate(strategy, size, lora_only, checkpointing, mode, offload, kind))
    return out
