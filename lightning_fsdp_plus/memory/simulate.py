"""``simulate``: torch's FSDP2 memory tracker on a fake process group — a per-rank peak without a GPU.

The config's model is built on FakeTensors and run through the same pipeline as the strategy's (prepare,
quantize, plan, shard: ``lightning_fsdp_plus.pipeline``) on rank 0 of a ``fake`` process group of
``world_size`` ranks, and two training steps run under ``FSDPMemTracker``
(``torch.distributed._tools.fsdp2_mem_tracker``). No memory is allocated and nothing is communicated;
the tracker reports what rank 0 would hold, by category, at its peak.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from lightning_fsdp_plus._private import fake_store, fsdp2_mem_tracker
from lightning_fsdp_plus.memory.fake import EstimateError, ForwardBatch, fake_model
from lightning_fsdp_plus.options import FSDPPlusOptions
from lightning_fsdp_plus.pipeline import plan_model, shard_model
from lightning_fsdp_plus.precision import FSDPPlusPrecision, stored_dtype
from lightning_fsdp_plus.sharding import init_mesh


def _optimizer(name: str, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    name = name.lower()
    if name in ("adam", "adamw"):
        return (torch.optim.AdamW if name == "adamw" else torch.optim.Adam)(params, lr=1e-4)
    return torch.optim.SGD(params, lr=1e-4, momentum=0.9 if name == "sgd-momentum" else 0.0)


def simulate_peak(
    config: Any,
    *,
    options: FSDPPlusOptions,
    world_size: int,
    batch: ForwardBatch,
    precision: str = "bf16-mixed",
    optimizer: str = "adamw",
    chunked_loss: bool = True,
) -> dict[str, int]:
    """Rank 0's peak bytes by ``FSDPMemTracker`` category (and ``total``) for two training steps (the loss computed
    as the app does: chunked unless ``chunked_loss=False``)."""
    if dist.is_initialized():
        raise EstimateError("simulate=True starts a fake process group: run it where none is initialised")
    layout = options.mesh_layout(world_size=world_size)
    options = options.replace(compile=False)  # FSDPMemTracker measures the eager model (docs/compile.md: memory)
    dist.init_process_group("fake", rank=0, world_size=world_size, store=fake_store()())
    try:
        mesh = init_mesh(layout=layout, device_type="cpu")  # real tensors: the mesh reads its ranks
        with fake_model(config, dtype=stored_dtype(precision), options=options, batch=batch) as (model, inputs):
            plan = plan_model(model, options, layout=layout, precision=precision, device_type="cpu")
            shard_model(model, plan, mesh=mesh)
            opt = _optimizer(optimizer, [p for p in model.parameters() if p.requires_grad])
            tracker = fsdp2_mem_tracker()(model, opt)
            tracker.track_inputs(tuple(inputs.values()))
            with tracker:
                for _ in range(2):  # the second step has optimizer state
                    with FSDPPlusPrecision(precision).forward_context():  # type: ignore[arg-type]
                        loss = model(chunked_loss=chunked_loss, **inputs)
                    loss.backward()
                    opt.step()
                    opt.zero_grad()
                    tracker.reset_mod_stats()
            snapshot = tracker.get_tracker_snapshot("peak")
            replicated = plan.replicated
    finally:
        dist.destroy_process_group()
    categories = next(iter(snapshot.values()), {})
    peak = {str(getattr(key, "value", key)).lower().replace(" ", "_"): int(v) for key, v in categories.items()}
    # the tracker follows FSDP-managed tensors only: add the replicated (ignored) parameters it cannot see
    peak["replicated_param"] = sum(p.bytes_per_rank for p in replicated)
    peak["total"] = peak.get("total", 0) + peak["replicated_param"]
    return peak
