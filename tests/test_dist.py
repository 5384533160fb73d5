"""``lightning_fsdp_plus._dist``: a finished process frees its gloo groups before interpreter exit."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

from lightning_fsdp_plus._dist import initialized, shutdown
from tests.helpers.threads import gloo_threads, started_gloo_threads


def test_shutdown_stops_gloo_threads_after_fsdp2_work(tmp_path):
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        assert started_gloo_threads(), "a gloo group runs worker threads"
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
        for layer in model:
            fully_shard(layer)
        fully_shard(model)
        model(torch.randn(4, 8)).sum().backward()  # DTensor ops fill the sharding caches with the group's mesh
        del model, layer  # the FSDP modules hold the group while they live
    finally:
        shutdown()  # also when an assertion fails: a group left behind would fail every later test's checks
    assert not initialized()
    # left to interpreter exit, these threads can abort a finished run ("terminate called without an active
    # exception"); destroy_process_group alone leaves them, held through DTensor's sharding caches
    assert gloo_threads() == []
