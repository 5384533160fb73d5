"""Predict every candidate's per-rank peak and step time, and choose the fastest that fits the budget.

Memory comes from the estimator (:mod:`~lightning_fsdp_plus.memory.estimate`): the model built on FakeTensors,
prepared as each candidate would prepare it, one forward counted for the planned batch; a candidate fits when its
real peak (the live tensors with the largest unit's transient, on its platform: gloo's all-gather copy and the
allocator's overhead on CPU) is at most the budget less ``memory_margin``. Step time comes from
:mod:`~lightning_fsdp_plus.autoplan.cost`. Everything here is arithmetic on identical inputs, so every rank that
runs it chooses the same; :func:`agree_on_choice` checks that anyway.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from lightning_fsdp_plus.autoplan.budget import format_bytes
from lightning_fsdp_plus.autoplan.candidates import Candidate, enumerate_candidates
from lightning_fsdp_plus.autoplan.cost import Hardware, StepTime, predict_step_time
from lightning_fsdp_plus.memory.allocator import PLATFORMS, Platform
from lightning_fsdp_plus.memory.estimate import MemoryEstimate, ModelDescription, describe_config_variants
from lightning_fsdp_plus.memory.fake import EstimateError, ForwardBatch, config_source
from lightning_fsdp_plus.options import FSDPPlusOptions


class NoFitError(ValueError):
    """No candidate fits the memory budget; the message names the closest one and the bytes missing."""


@dataclass(frozen=True)
class Prediction:
    """One candidate's predicted memory and (once hardware is known) step time."""

    candidate: Candidate
    """The configuration."""
    memory: MemoryEstimate
    """The estimator's figures per rank."""
    model: ModelDescription = field(repr=False)
    """The model as this candidate prepares it."""
    step: StepTime | None = None
    """Predicted step time (None until hardware is known)."""

    @property
    def peak_bytes(self) -> int:
        """What a rank really takes at the step's peak on its platform: the live tensors with the backward's
        transients, the platform's all-gather copies and its allocator's overhead (what must fit)."""
        assert self.memory.real_peak_bytes_per_rank is not None
        return self.memory.real_peak_bytes_per_rank

    def to_dict(self) -> dict[str, Any]:
        """Candidate, memory and step time as plain values."""
        return {
            "candidate": self.candidate.to_dict(),
            "label": self.candidate.label,
            "peak_bytes": self.peak_bytes,
            "memory": self.memory.to_dict(),
            "step": None if self.step is None else self.step.to_dict(),
        }


@dataclass(frozen=True)
class AutoPlan:
    """Every candidate with its predictions, the budget, and the choice."""

    predictions: tuple[Prediction, ...]
    """Every candidate, in enumeration order."""
    budget: int
    """The budget in bytes per device."""
    margin: float
    """Share of the budget kept free (``memory_margin``)."""
    world_size: int
    """Ranks."""
    batch: ForwardBatch
    """The planned per-rank batch."""
    precision: str
    """The precision preset."""
    source: str = ""
    """The model (a config path or its type and size)."""
    budget_text: str = ""
    """The budget as the user gave it."""
    hardware: Hardware | None = None
    """What step times were computed with (None: memory only so far)."""
    chosen: int | None = None
    """Index of the chosen prediction."""
    excluded: tuple[tuple[str, str], ...] = ()
    """``(quantization, why)`` for allowed quantizations this model cannot take (e.g. a 4-bit block size that
    does not divide a layer)."""
    platform: str = "cuda"
    """The platform the peaks are real for (:data:`~lightning_fsdp_plus.memory.allocator.PLATFORMS`)."""

    @property
    def usable(self) -> int:
        """Bytes a candidate's peak may take: the budget less the margin."""
        return int(self.budget * (1.0 - self.margin))

    def fits(self, prediction: Prediction) -> bool:
        """Whether ``prediction``'s peak is within the usable budget."""
        return prediction.peak_bytes <= self.usable

    @property
    def fitting(self) -> list[Prediction]:
        """The candidates that fit."""
        return [p for p in self.predictions if self.fits(p)]

    @property
    def choice(self) -> Prediction:
        """The chosen candidate's prediction."""
        if self.chosen is None:
            raise RuntimeError("no candidate chosen yet: call with_hardware()")
        return self.predictions[self.chosen]

    def require_fit(self) -> None:
        """Raise :class:`NoFitError` naming the closest candidate and the shortfall unless one fits."""
        if self.fitting:
            return
        closest = min(self.predictions, key=lambda p: p.peak_bytes)
        missing = closest.peak_bytes - self.usable
        raise NoFitError(
            f"memory_budget={self.budget_text or self.budget} leaves {format_bytes(self.usable)} per device after"
            f" memory_margin={self.margin:g}, and none of the {len(self.predictions)} candidates fits at"
            f" {self.world_size} rank(s), batch {self.batch.batch_size} x {self.batch.seq_len} tokens. Closest:"
            f" {closest.candidate.label} needs {format_bytes(closest.peak_bytes)} per rank, {format_bytes(missing)}"
            f" ({missing:,} bytes) more than the budget allows. Raise memory_budget, use more ranks, plan a smaller"
            " batch (plan_batch_size) or sequence (plan_seq_len), or allow quantization of a LoRA run's base"
            " (allow_quantize=[int8, nf4])"
        )

    def with_hardware(self, hardware: Hardware) -> AutoPlan:
        """Step times for every candidate on ``hardware`` and the choice: the fastest that fits (ties: the earlier
        in enumeration order, which prefers less replication and no extra options)."""
        self.require_fit()
        tokens = self.batch.batch_size * self.batch.seq_len
        timed = tuple(
            replace(p, step=predict_step_time(p.model, p.candidate, hardware=hardware, world_size=self.world_size,
                                              tokens=tokens, precision=self.precision))
            for p in self.predictions
        )  # fmt: skip
        fitting = [i for i, p in enumerate(timed) if self.fits(p)]
        chosen = min(fitting, key=lambda i: (timed[i].step.total, i))  # type: ignore[union-attr]
        return replace(self, predictions=timed, hardware=hardware, chosen=chosen)

    def format_table(self) -> str:
        """Every candidate: predicted peak, whether it fits (or by how much it misses), predicted step time."""
        hw = self.hardware
        lines = [
            f"auto plan for {self.source}: budget {format_bytes(self.budget)} per device, {format_bytes(self.usable)}"
            f" usable (memory_margin {self.margin:g}); {self.world_size} rank(s); batch {self.batch.batch_size} x"
            f" {self.batch.seq_len} tokens per rank; {self.precision}; real peaks for {self.platform}",
        ]
        if hw is not None:
            lines.append(
                f"hardware ({hw.source}): matmul {hw.matmul_flops / 1e9:,.1f} GFLOP/s, {_links(hw)}, AdamW"
                f" {hw.optimizer_rate / 1e6:,.0f} M elements/s, overlap {hw.overlap:g}"
                + "".join(f", {k} {v / 1e9:,.1f} GFLOP/s" for k, v in hw.quantized_flops.items())
            )
        rows = [["#", "candidate", "peak/rank", "fits", "step s", "compute", "collectives", "optimizer"]]
        for i, p in enumerate(self.predictions):
            fit = "yes" if self.fits(p) else f"no (+{format_bytes(p.peak_bytes - self.usable)})"
            step = ["", "", "", ""] if p.step is None else [f"{v:.4f}" for v in (
                p.step.total, p.step.compute, p.step.collectives, p.step.optimizer)]  # fmt: skip
            mark = "*" if i == self.chosen else " "
            rows.append([f"{mark}{i + 1}", p.candidate.label, format_bytes(p.peak_bytes), fit, *step])
        widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
        for row in rows:
            lines.append("  ".join(c.ljust(w) if k in (1, 3) else c.rjust(w) for k, (c, w) in
                                   enumerate(zip(row, widths, strict=True))).rstrip())  # fmt: skip
        lines += [f"not a candidate: {kind} base ({why})" for kind, why in self.excluded]
        if self.chosen is not None:
            c = self.choice
            assert c.step is not None
            lines.append(
                f"chosen: #{self.chosen + 1} {c.candidate.label}: fastest that fits, {c.step.total:.4f} s/step"
                f" predicted, peak {format_bytes(c.peak_bytes)} of {format_bytes(self.usable)} usable"
            )
        return "\n".join(lines) + "\n"

    def to_dict(self) -> dict[str, Any]:
        """The whole plan as plain values (JSON)."""
        return {
            "source": self.source,
            "budget_bytes": self.budget,
            "usable_bytes": self.usable,
            "memory_margin": self.margin,
            "world_size": self.world_size,
            "batch_size": self.batch.batch_size,
            "seq_len": self.batch.seq_len,
            "precision": self.precision,
            "platform": self.platform,
            "hardware": None if self.hardware is None else self.hardware.to_dict(),
            "chosen": self.chosen,
            "candidates": [p.to_dict() | {"fits": self.fits(p)} for p in self.predictions],
            "excluded": {kind: why for kind, why in self.excluded},
        }


def _links(hw: Hardware) -> str:
    """The link figures for the table: per collective when measured."""
    if not math.isfinite(hw.link_bandwidth):
        return "no link (1 rank)"
    pairs = hw.collectives or {"link": (hw.link_bandwidth, hw.link_latency)}
    return ", ".join(f"{kind} {bw / 1e9:,.2f} GB/s + {lat * 1e6:,.0f} us" for kind, (bw, lat) in pairs.items())


def predict_memory(
    config: Any,
    *,
    options: FSDPPlusOptions,
    world_size: int,
    precision: str,
    batch: ForwardBatch,
    budget: int,
    margin: float,
    quantize: Sequence[str | None] = (None,),
    lora_run: bool,
    accelerator: bool = False,
    optimizer: str = "adamw",
    budget_text: str = "",
    platform: Platform = PLATFORMS["cuda"],
) -> AutoPlan:
    """Every candidate's memory (one FakeTensor build per quantization kind); no step times yet. A candidate whose
    units reshard after forward keeps its root gathered until backward (one all-gather fewer per step) unless only
    freeing the root too (``reshard_root``) brings its peak down enough to fit."""
    from lightning_fsdp_plus.memory.estimate import estimate_strategy

    candidates = enumerate_candidates(world_size=world_size, lora_run=lora_run, quantize=quantize,
                                      accelerator=accelerator)  # fmt: skip
    described: dict[tuple[str | None, bool, str | None], ModelDescription] = {}
    excluded = []
    modes = (False, True) if lora_run else (False,)
    for kind in quantize:
        try:
            variants = describe_config_variants(
                config, precision=precision, batch=batch, lora_only=modes, checkpointing=(False, True),
                options=options.replace(quantize_base=kind, activation_checkpointing_mode="full"),
            )  # fmt: skip
            selective = describe_config_variants(
                config, precision=precision, batch=batch, lora_only=modes, checkpointing=(True,),
                options=options.replace(quantize_base=kind, activation_checkpointing_mode="selective"),
            )  # fmt: skip
        except EstimateError as err:
            if kind is None or len(quantize) == 1:  # the model itself cannot be prepared: nothing to choose from
                raise
            excluded.append((kind, str(err)))
            continue
        described |= {(kind, lo, "full" if ck else None): value for (lo, ck), value in variants.items()}
        described |= {(kind, lo, "selective"): value for (lo, _), value in selective.items()}

    def key(c: Candidate) -> tuple[str | None, bool, str | None]:
        return c.quantize_base, c.lora_only, c.checkpointing_mode if c.activation_checkpointing else None

    def predict(c: Candidate) -> Prediction:
        model = described[key(c)]
        memory = estimate_strategy(model, sharding_strategy=c.sharding_strategy, world_size=world_size,
                                   precision=precision, optimizer=optimizer, hybrid_shard_size=c.hybrid_shard_size,
                                   cpu_offload=c.cpu_offload and accelerator, reshard_root=c.reshard_root,
                                   platform=platform)  # fmt: skip
        return Prediction(candidate=c, memory=memory, model=model)

    predictions = [predict(c) for c in candidates if key(c) in described]
    plan = AutoPlan(predictions=tuple(predictions), budget=budget, margin=margin, world_size=world_size, batch=batch,
                    precision=precision, source=config_source(config), budget_text=budget_text,
                    excluded=tuple(excluded), platform=platform.name)  # fmt: skip

    def leaner(p: Prediction) -> Prediction:
        # the root kept gathered from forward to backward saves an all-gather per step; where that does not fit,
        # the same candidate with its root freed after forward too, if that needs less
        if plan.fits(p) or not p.candidate.sharding_strategy.reshard_after_forward:
            return p
        resharded = predict(replace(p.candidate, reshard_root=True))
        return resharded if resharded.peak_bytes < p.peak_bytes else p

    return replace(plan, predictions=tuple(leaner(p) for p in predictions))


def agree_on_choice(plan: AutoPlan, *, gather: Callable[[Any], list[Any]]) -> None:
    """Every rank chose the same candidate, or a RuntimeError that names each rank's choice."""
    choices = gather(None if plan.chosen is None else plan.choice.candidate.label)
    if len(set(choices)) > 1:
        listed = ", ".join(f"rank {r}: {c}" for r, c in enumerate(choices))
        raise RuntimeError(
            f"sharding_strategy='auto' chose differently on different ranks ({listed}); the inputs differ between"
            " ranks (a different model, batch or budget): pin the configuration the table printed"
        )
