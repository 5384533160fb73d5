"""A short measurement of the real devices and group for the step-time model (a few hundred milliseconds).

Every rank times the same things at once (as it will train): a linear layer of the model's shape forward and
backward in the run's precision, the allowed quantized layers (forward and input gradient, bitsandbytes kernels),
two all-gathers of different sizes on the group (latency and bandwidth from the pair), an AdamW step, a streaming
elementwise operation (the memory bandwidth elementwise work runs at), and on
GPUs a host-to-device copy and an AdamW step in host memory. The ranks then share their timings and every rank
takes the slowest one per item, so all ranks build the same :class:`~lightning_fsdp_plus.autoplan.cost.Hardware`.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_fsdp_plus._dist import all_gather_object, initialized
from lightning_fsdp_plus.autoplan.cost import GPU_OVERLAP, Hardware, wire_bytes
from lightning_fsdp_plus.precision import FSDPPlusPrecision, compute_dtype

MAX_PROBE_TOKENS = 2048
"""Tokens of the probe's matrix multiply at most."""
MAX_PROBE_FEATURES = 8192
"""Input and output features of the probe's linear layer at most."""


def _timed(fn: Callable[[], Any], *, device: torch.device, repeats: int = 3) -> float:
    """Median seconds of ``fn`` over ``repeats`` runs after one warm-up."""

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    fn()
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _linear_seconds(
    *, features: tuple[int, int], tokens: int, precision: str, device: torch.device, quantize: str | None
) -> float:
    """Forward + backward of one linear layer: weight gradients for a float layer, input gradients only for a
    quantized (frozen) one."""
    from lightning_fsdp_plus.quantization import FourBitLinear, Int8Linear

    plugin = FSDPPlusPrecision(precision)  # type: ignore[arg-type]
    plugin.device = device.type
    stored = torch.float32 if precision.endswith("mixed") or precision == "32-true" else compute_dtype(precision)
    generator = torch.Generator(device="cpu").manual_seed(0)
    linear = nn.Linear(*features, bias=False, dtype=torch.float32)
    nn.init.normal_(linear.weight, std=0.02, generator=generator)
    if quantize == "int8":
        layer: nn.Module = Int8Linear.from_linear(linear.to(device))
    elif quantize is not None:
        layer = FourBitLinear.from_linear(linear.to(device, stored), quant_type=quantize)
    else:
        layer = linear.to(device, stored)
    x = torch.randn(tokens, features[0], generator=generator).to(device, stored).requires_grad_(True)

    def step() -> None:
        with plugin.forward_context():
            out = layer(x)
        out.float().sum().backward()

    return _timed(step, device=device)


COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce")
"""The collectives FSDP2 issues, each probed (gloo, for one, has no native reduce-scatter)."""


def _collective_seconds(kind: str, nbytes: int, *, device: torch.device, group: Any) -> float:
    """Seconds of one ``kind`` collective whose full (unsharded) tensor is ``nbytes`` of fp32."""
    size = dist.get_world_size(group)
    chunk = max(1, nbytes // 4 // size)
    full = torch.ones(chunk * size, dtype=torch.float32, device=device)
    shard = torch.ones(chunk, dtype=torch.float32, device=device)
    run = {
        "all_gather": lambda: dist.all_gather_single(full, shard, group=group),
        "reduce_scatter": lambda: dist.reduce_scatter_single(shard, full, group=group),
        "all_reduce": lambda: dist.all_reduce(full, group=group),
    }[kind]
    return _timed(run, device=device, repeats=5)


def _optimizer_seconds(numel: int, *, dtype: torch.dtype, device: torch.device) -> float:
    param = nn.Parameter(torch.zeros(numel, dtype=dtype, device=device))
    param.grad = torch.full_like(param, 1e-3)
    optimizer = torch.optim.AdamW([param], lr=1e-4)
    return _timed(optimizer.step, device=device)


def _memory_seconds(*, device: torch.device, numel: int = 8 << 20) -> dict[str, float]:
    """A streaming elementwise operation (``c = a + b`` over 32 MiB fp32 tensors): the bytes it moves and its time."""
    a, b = torch.ones(numel, device=device), torch.ones(numel, device=device)
    c = torch.empty_like(a)
    return {"memory_s": _timed(lambda: torch.add(a, b, out=c), device=device, repeats=5), "memory_bytes": 3 * 4 * numel}


def measure(
    *,
    features: tuple[int, int],
    tokens: int,
    precision: str,
    device: torch.device,
    quantize: Sequence[str] = (),
    group: Any = None,
) -> dict[str, float]:
    """This rank's timings (seconds) and the work each timed (FLOPs, bytes, elements)."""
    features = (min(features[0], MAX_PROBE_FEATURES), min(features[1], MAX_PROBE_FEATURES))
    tokens = max(1, min(tokens, MAX_PROBE_TOKENS))
    gpu = device.type == "cuda"
    flops = 2.0 * tokens * features[0] * features[1]
    out = {"matmul_s": _linear_seconds(features=features, tokens=tokens, precision=precision, device=device,
                                       quantize=None), "matmul_flops": 3 * flops}  # fmt: skip
    for kind in quantize:
        out[f"{kind}_s"] = _linear_seconds(features=features, tokens=tokens, precision=precision, device=device,
                                           quantize=kind)  # fmt: skip
        out[f"{kind}_flops"] = 2 * flops
    # on CPU 64 MiB: with 8 MiB a few ms of scheduling noise in either timing swung the bandwidth 1-9 GB/s
    small, large = 4 << 10, (256 << 20) if gpu else (64 << 20)
    if initialized() and dist.get_world_size(group) > 1:
        out |= {"collective_small": small, "collective_large": large}
        for kind in COLLECTIVES:
            for name, nbytes in (("small", small), ("large", large)):
                out[f"{kind}_{name}_s"] = _collective_seconds(kind, nbytes, device=device, group=group)
    stored = compute_dtype(precision) if precision.endswith("true") and precision != "32-true" else torch.float32
    numel = (1 << 24) if gpu else (1 << 20)
    out |= {"optimizer_s": _optimizer_seconds(numel, dtype=stored, device=device), "optimizer_numel": numel}
    out |= _memory_seconds(device=device)
    if gpu:
        host = torch.empty(64 << 20, dtype=torch.uint8).pin_memory()
        out |= {"pcie_s": _timed(lambda: host.to(device, non_blocking=True), device=device), "pcie_bytes": host.numel(),
                "host_optimizer_s": _optimizer_seconds(numel, dtype=stored, device=torch.device("cpu"))}  # fmt: skip
    return out


def hardware_from(timings: Sequence[dict[str, float]], *, world_size: int, accelerator: bool) -> Hardware:
    """One :class:`Hardware` from every rank's :func:`measure`: the slowest rank's time per item."""
    slowest = {key: max(t[key] for t in timings) for key in timings[0]}
    quantized = {key[:-2]: slowest[f"{key[:-2]}_flops"] / slowest[key] for key in slowest
                 if key.endswith("_s") and f"{key[:-2]}_flops" in slowest and key != "matmul_s"}  # fmt: skip
    links: dict[str, tuple[float, float]] = {}
    if "collective_large" in slowest:
        for kind in COLLECTIVES:  # bandwidth from the difference of two sizes, latency what remains of the small one
            small, large = (wire_bytes(kind, slowest[f"collective_{n}"], world_size) for n in ("small", "large"))
            seconds = slowest[f"{kind}_large_s"] - slowest[f"{kind}_small_s"]
            bandwidth = (large - small) / max(seconds, 1e-9)
            links[kind] = (bandwidth, max(0.0, slowest[f"{kind}_small_s"] - small / bandwidth))
    bandwidth, latency = links.get("all_gather", (float("inf"), 0.0))
    numel = slowest["optimizer_numel"]
    return Hardware(
        matmul_flops=slowest["matmul_flops"] / slowest["matmul_s"],
        link_bandwidth=bandwidth,
        link_latency=latency,
        collectives=links,
        optimizer_rate=numel / slowest["optimizer_s"],
        memory_bandwidth=slowest["memory_bytes"] / slowest["memory_s"],
        quantized_flops=quantized,
        host_optimizer_rate=numel / slowest.get("host_optimizer_s", slowest["optimizer_s"]),
        pcie_bandwidth=slowest["pcie_bytes"] / slowest["pcie_s"] if "pcie_s" in slowest else 0.0,
        overlap=GPU_OVERLAP if accelerator else 0.0,
        accelerator=accelerator,
        source=f"probed on {world_size} rank(s)" + (" (GPU)" if accelerator else " (CPU)"),
    )


def probe_hardware(**inputs: Any) -> Hardware:
    """Measure on every rank (:func:`measure`, with its keyword arguments) and agree on one :class:`Hardware` (the
    same on every rank)."""
    timings = all_gather_object(measure(**inputs))
    group = inputs.get("group")
    world = dist.get_world_size(group) if initialized() else 1
    return hardware_from(timings, world_size=world, accelerator=inputs["device"].type == "cuda")
