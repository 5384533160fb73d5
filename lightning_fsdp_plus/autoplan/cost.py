"""The step-time model: compute, collectives over a link, the optimizer, PCIe under offload.

Per rank and optimizer step, with T = batch x sequence tokens, W = weights (a quantized weight counts once,
whatever its bytes), F = matmul FLOP/s in the compute dtype and F_q the effective FLOP/s of a quantized frozen
layer (dequantization included):

* compute = forward 2T(W_float/F + W_quant/F_q) + backward the same (input gradients) + 2T W_trainable/F
  (weight gradients) + with activation checkpointing the forward of every unit but the root again, + the
  elementwise work: ``ELEMENTWISE_PASSES`` x the forward's saved activation bytes (with checkpointing, a third of
  the recomputed ones more: the forward's share) ÷ the probed memory bandwidth;
* collectives, each ``latency + bytes on the wire / bandwidth`` of its kind (ring algorithms: an all-gather or a
  reduce-scatter over S ranks moves (S-1)/S of the data, an all-reduce over R twice (R-1)/R; the probe measures
  each kind, since a backend may run one as another — gloo's reduce-scatter is an all-reduce): per unit, one
  all-gather of its sharded parameters in the compute dtype (int8 and 4-bit bytes as stored) per forward and
  again per backward when it reshards after forward (FULL_SHARD, HYBRID_SHARD; the root only when the candidate
  reshards it), a
  reduce-scatter of its trainable gradients in the reduce dtype, and for a replicated mesh dimension
  (NO_SHARD, HYBRID_SHARD) an all-reduce of that shard;
* optimizer = trainable elements this rank updates ÷ optimizer elements/s (the host's under CPU offload);
* offload = (sharded parameters copied to the device before every all-gather + gradient shards copied back) ÷
  PCIe bandwidth;
* step = compute + optimizer + offload + the part of the collectives compute cannot hide:
  max(0, collectives - overlap x compute). ``overlap`` is 0 on CPU (gloo and compute share the cores; measured)
  and 0.8 on GPUs (FSDP2 runs collectives on their own streams, prefetching the next unit).

Attention's own FLOPs (a few per cent at 2k tokens) count in the elementwise passes. Measured on CPU at 12.8M-400M
parameters the step time is predicted within 25% (docs/autoplan.md); on GPUs the passes (fp32 on CPU, bf16 there)
are an assumption until a GPU run confirms them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from lightning_fsdp_plus.autoplan.candidates import Candidate
from lightning_fsdp_plus.memory.assumptions import PRECISION_BYTES
from lightning_fsdp_plus.memory.estimate import (
    ModelDescription,
    bytes_per_element,
    is_quantized,
    unit_reshards,
    weight_elements,
)
from lightning_fsdp_plus.plan import ParamInfo, resolve_mesh_layout

ELEMENTWISE_PASSES = 30.0
"""Elementwise work of a step (norms, activations, residuals, attention's softmax, LoRA's scaling, the int8 weights'
dequantization, autograd's bookkeeping) as streaming passes over the forward's saved activations: the step time
``aten::mm`` and the collectives leave unexplained, ÷ (saved activation bytes / probed memory bandwidth). Measured
on 2 CPU ranks (fp32 LoRA on Llamas of 12.8M, 135M and 400M parameters): 33-39 with an int8 base, about 24 with a
float one (docs/autoplan.md)."""
GPU_OVERLAP = 0.8
"""Share of the compute time that hides collectives on GPUs (separate streams, FSDP2's prefetch)."""
CPU_LINK_BANDWIDTH = 1.1e9
"""gloo between processes of one host (bytes/s), for ``fsdp-plus-estimate --hardware cpu``: measured by the probe
on the development machine (2 cores) at 1.13 GB/s."""
CPU_LINK_LATENCY = 300e-6
"""gloo's per-collective cost on one host (seconds), measured there too (281 us)."""


@dataclass(frozen=True)
class Hardware:
    """What the step-time model needs to know about the devices and the link between them."""

    matmul_flops: float
    """Matrix-multiply FLOP/s in the compute dtype (forward and backward of a linear layer)."""
    link_bandwidth: float
    """Bytes per second a collective moves per rank (NCCL's "bus bandwidth")."""
    link_latency: float = 0.0
    """Seconds every collective costs regardless of size."""
    collectives: Mapping[str, tuple[float, float]] = field(default_factory=dict)
    """Measured ``(bandwidth, latency)`` per collective (``all_gather``, ``reduce_scatter``, ``all_reduce``), where
    they differ from the link's (gloo runs a reduce-scatter as an all-reduce)."""
    optimizer_rate: float = 1e9
    """Parameter elements per second the optimizer (AdamW) updates on the device."""
    memory_bandwidth: float = 0.0
    """Bytes per second a streaming elementwise operation moves (0: no elementwise term)."""
    quantized_flops: Mapping[str, float] = field(default_factory=dict)
    """Effective FLOP/s of a quantized frozen linear layer (forward and input gradient), per kind."""
    host_optimizer_rate: float = 1e9
    """Elements per second of the optimizer step in host memory (CPU offload)."""
    pcie_bandwidth: float = 0.0
    """Host-device bytes per second (CPU offload; 0 on CPU)."""
    overlap: float = 0.0
    """Share of the compute time that hides collectives."""
    accelerator: bool = False
    """GPUs (CPU offload is a candidate) rather than CPU processes."""
    device_memory: int = 0
    """Bytes of one device, for budgets given as a fraction (0: ask the device)."""
    source: str = ""
    """Where the figures come from: a preset, a probe of the real group, the user."""

    def to_dict(self) -> dict[str, Any]:
        """All fields (``quantized_flops`` as a plain dict)."""
        return asdict(self) | {
            "quantized_flops": dict(self.quantized_flops),
            "collectives": {kind: list(pair) for kind, pair in self.collectives.items()},
        }

    def with_link_bandwidth(self, gb_per_s: float | None) -> Hardware:
        """A copy with the user's link bandwidth (GB/s, 10^9 bytes) when given."""
        if gb_per_s is None:
            return self
        return replace(
            self, link_bandwidth=gb_per_s * 1e9, collectives={}, source=f"{self.source}; link {gb_per_s:g} GB/s given"
        )


def _preset(
    name: str, *, tflops: float, link: float, pcie: float, hbm: float, int8: float, nf4: float, gib: int
) -> Hardware:
    # dense bf16 spec x 0.45 (a good FSDP MFU); AdamW reads and writes about 28 bytes per element, at 50% of HBM
    flops = tflops * 1e12 * 0.45
    return Hardware(
        matmul_flops=flops, link_bandwidth=link * 1e9, link_latency=20e-6, optimizer_rate=hbm * 1e9 * 0.5 / 28,
        memory_bandwidth=hbm * 1e9 * 0.5,
        quantized_flops={"int8": flops * int8, "nf4": flops * nf4, "fp4": flops * nf4},
        host_optimizer_rate=1e9, pcie_bandwidth=pcie * 1e9, overlap=GPU_OVERLAP, accelerator=True,
        device_memory=gib * 2**30,
        source=f"{name} preset (spec sheet x efficiency, assumed)",
    )  # fmt: skip


PRESETS: dict[str, Hardware] = {
    # bf16 dense TFLOP/s, NCCL all-gather bus bandwidth GB/s, PCIe GB/s, HBM GB/s, LLM.int8 / NF4 speed vs bf16,
    # memory GiB (80 GB parts)
    "h100": _preset("h100", tflops=989, link=360, pcie=50, hbm=3350, int8=0.5, nf4=0.6, gib=80),
    "a100": _preset("a100", tflops=312, link=230, pcie=25, hbm=2039, int8=0.5, nf4=0.6, gib=80),
    "l4": _preset("l4", tflops=121, link=20, pcie=25, hbm=300, int8=0.5, nf4=0.6, gib=22),
}
"""Assumed GPU figures for ``fsdp-plus-estimate --budget`` (the strategy probes the real devices instead)."""


@dataclass(frozen=True)
class StepTime:
    """Predicted seconds per optimizer step of one candidate, by part."""

    compute: float
    """Matrix multiplies (recompute included)."""
    collectives: float
    """All-gathers, reduce-scatters and all-reduces, before overlap."""
    optimizer: float
    """The optimizer step."""
    offload: float
    """Host-device copies under CPU offload."""
    total: float
    """compute + optimizer + offload + collectives not hidden by compute."""

    def to_dict(self) -> dict[str, float]:
        """All fields."""
        return asdict(self)


def wire_bytes(kind: str, nbytes: float, ranks: int) -> float:
    """Bytes one rank sends for a ring ``kind`` over ``ranks`` of an ``nbytes`` tensor (NCCL's bus-bandwidth
    convention): (N-1)/N of it for all-gather and reduce-scatter, twice that for all-reduce."""
    factor = 2.0 if kind == "all_reduce" else 1.0
    return factor * nbytes * (ranks - 1) / ranks


def _unit_bytes(unit: Iterable[ParamInfo], float_bytes: int) -> int:
    """A unit's bytes with float elements at ``float_bytes`` (compute or stored); int8 / 4-bit bytes as they are."""
    return sum(p.numel * bytes_per_element(p, float_bytes) for p in unit)


def predict_step_time(
    model: ModelDescription,
    candidate: Candidate,
    *,
    hardware: Hardware,
    world_size: int,
    tokens: int,
    precision: str,
) -> StepTime:
    """The step-time model (module docstring) for ``candidate`` on ``model`` (described with its choices)."""
    pb = PRECISION_BYTES[precision]
    layout = resolve_mesh_layout(sharding_strategy=candidate.sharding_strategy, world_size=world_size,
                                 hybrid_shard_size=candidate.hybrid_shard_size)  # fmt: skip
    shard, replicas = layout.shard, layout.replicate
    params = [p for unit in (*model.units, model.replicated) for p in unit]
    quant_rate = hardware.quantized_flops.get(candidate.quantize_base or "", hardware.matmul_flops)
    float_w = sum(weight_elements(p) for p in params if not is_quantized(p))
    quant_w = sum(weight_elements(p) for p in params if is_quantized(p))
    trainable = sum(p.numel for p in params if p.trainable)
    forward = 2 * tokens * (float_w / hardware.matmul_flops + quant_w / quant_rate)
    backward = forward + 2 * tokens * trainable / hardware.matmul_flops
    recompute = 0.0
    selective = getattr(candidate, "checkpointing_mode", "full") == "selective"
    if candidate.activation_checkpointing and model.units and not selective:  # selective keeps the matmuls' outputs
        in_units = sum(weight_elements(p) for unit in model.units for p in unit)
        if model.unit_recompute:  # the checkpointed units: those whose backward recomputes something
            checkpointed = sum(weight_elements(p) for unit, again in zip(model.units, model.unit_recompute,
                                                                         strict=True) if again for p in unit)
        else:
            checkpointed = in_units - sum(weight_elements(p) for p in model.units[-1])
        recompute = forward * checkpointed / in_units if in_units else 0.0
    compute = forward + backward + recompute
    if hardware.memory_bandwidth and model.activation_bytes:
        # the forward's elementwise work over every activation, again for what checkpointed units recompute
        # (a step's elementwise work is about one part forward to two parts backward: recomputing adds a third)
        recomputed = sum(model.unit_recompute) if model.unit_recompute else model.recompute_bytes * (
            len(model.units) - 1)  # fmt: skip
        touched = model.activation_bytes + (4 / 3 * recomputed if candidate.activation_checkpointing else 0)
        compute += ELEMENTWISE_PASSES * touched / hardware.memory_bandwidth

    def collective(kind: str, nbytes: float, ranks: int) -> float:
        if ranks <= 1 or nbytes <= 0:
            return 0.0
        bandwidth, latency = hardware.collectives.get(kind, (hardware.link_bandwidth, hardware.link_latency))
        return latency + wire_bytes(kind, nbytes, ranks) / bandwidth

    comm = pcie_bytes = 0.0
    for index, unit in enumerate(model.units):
        root = index == len(model.units) - 1
        again = unit_reshards(candidate.sharding_strategy, root=root, reshard_root=candidate.reshard_root)
        gathers = 2 if again else 1
        grads = sum(p.numel for p in unit if p.trainable) * pb.grad
        comm += gathers * collective("all_gather", _unit_bytes(unit, pb.compute), shard)
        comm += collective("reduce_scatter", grads, shard) + collective("all_reduce", grads / shard, replicas)
        pcie_bytes += gathers * _unit_bytes(unit, pb.stored) / shard + grads / shard
    updated = sum(p.numel for unit in model.units for p in unit if p.trainable) / shard
    updated += sum(p.numel for p in model.replicated if p.trainable)
    offloaded = candidate.cpu_offload and hardware.accelerator
    optimizer = updated / (hardware.host_optimizer_rate if offloaded else hardware.optimizer_rate)
    offload = pcie_bytes / hardware.pcie_bandwidth if offloaded and hardware.pcie_bandwidth else 0.0
    total = compute + optimizer + offload + max(0.0, comm - hardware.overlap * compute)
    return StepTime(compute=compute, collectives=comm, optimizer=optimizer, offload=offload, total=total)
