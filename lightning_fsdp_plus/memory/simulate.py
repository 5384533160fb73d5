"""``simulate``: torch's FSDP2 memory tracker on a fake process group — a per-rank peak without a GPU.

The config's model is built on FakeTensors, prepared and sharded exactly as the strategy does it
(LoRA, int8 skeleton, wrap policy, ``MixedPrecisionPolicy``) on rank 0 of a ``fake`` process group of
``world_size`` ranks, and two training steps run under ``FSDPMemTracker``
(``torch.distributed._tools.fsdp2_mem_tracker``). No memory is allocated and nothing is communicated;
the tracker reports what rank 0 would hold, by category, at its peak.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from lightning_fsdp_plus.lora import frozen_parameters
from lightning_fsdp_plus.memory.estimate import EstimateError, ModelSetup, fake_model
from lightning_fsdp_plus.plan import ShardingStrategy, build_sharding_plan, resolve_mesh_layout
from lightning_fsdp_plus.policies import select_unit_paths
from lightning_fsdp_plus.precision import FSDPPlusPrecision, mixed_precision_policy, stored_dtype
from lightning_fsdp_plus.sharding import apply_sharding_plan, init_mesh


def _optimizer(name: str, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    name = name.lower()
    if name in ("adam", "adamw"):
        return (torch.optim.AdamW if name == "adamw" else torch.optim.Adam)(params, lr=1e-4)
    return torch.optim.SGD(params, lr=1e-4, momentum=0.9 if name == "sgd-momentum" else 0.0)


def simulate_peak(
    config: Any,
    *,
    sharding_strategy: ShardingStrategy,
    world_size: int,
    precision: str = "bf16-mixed",
    optimizer: str = "adamw",
    hybrid_shard_size: int | None = None,
    setup: ModelSetup | None = None,
) -> dict[str, int]:
    """Rank 0's peak bytes by ``FSDPMemTracker`` category (and ``total``) for two training steps."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.testing._internal.distributed.fake_pg import FakeStore

    setup = setup or ModelSetup()
    if dist.is_initialized():
        raise EstimateError("simulate=True starts a fake process group: run it where none is initialised")
    layout = resolve_mesh_layout(
        sharding_strategy=sharding_strategy, world_size=world_size, hybrid_shard_size=hybrid_shard_size
    )
    dist.init_process_group("fake", rank=0, world_size=world_size, store=FakeStore())
    try:
        mesh = init_mesh(layout=layout, device_type="cpu")  # real tensors: the mesh reads its ranks
        with fake_model(config, dtype=stored_dtype(precision), setup=setup) as (model, batch):
            replicated = frozen_parameters(model) if setup.lora_only else set()
            unit_paths = select_unit_paths(model, setup.auto_wrap_policy)
            plan = build_sharding_plan(
                model,
                unit_paths=unit_paths,
                sharding_strategy=sharding_strategy,
                mesh=layout,
                ignored_params=replicated,
                activation_checkpointing=[p for p in unit_paths if p] if setup.activation_checkpointing else (),
            )
            apply_sharding_plan(
                model, plan, mesh=mesh, mp_policy=mixed_precision_policy(precision=precision), ignored_params=replicated
            )
            opt = _optimizer(optimizer, [p for p in model.parameters() if p.requires_grad])
            tracker = FSDPMemTracker(model, opt)
            tracker.track_inputs(tuple(batch.values()))
            with tracker:
                for _ in range(2):  # the second step has optimizer state
                    with FSDPPlusPrecision(precision).forward_context():  # type: ignore[arg-type]
                        loss = model(**batch).loss
                    loss.backward()
                    opt.step()
                    opt.zero_grad()
                    tracker.reset_mod_stats()
            snapshot = tracker.get_tracker_snapshot("peak")
    finally:
        dist.destroy_process_group()
    categories = next(iter(snapshot.values()), {})
    peak = {str(getattr(key, "value", key)).lower().replace(" ", "_"): int(v) for key, v in categories.items()}
    # the tracker follows FSDP-managed tensors only: add the replicated (ignored) parameters it cannot see
    peak["replicated_param"] = sum(p.numel() * p.element_size() for p in replicated)
    peak["total"] = peak.get("total", 0) + peak["replicated_param"]
    return peak
