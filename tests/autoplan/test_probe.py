"""The hardware probe's collectives: the current torch APIs, no warning a user cannot act on."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist

from lightning_fsdp_plus.autoplan.probe import COLLECTIVES, _collective_seconds


@pytest.fixture
def one_rank_group(tmp_path):
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


def test_every_probed_collective_runs_without_a_deprecation_warning(one_rank_group):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        seconds = {kind: _collective_seconds(kind, 1 << 16, device=torch.device("cpu"), group=one_rank_group)
                   for kind in COLLECTIVES}  # fmt: skip
    assert all(s > 0 for s in seconds.values())
    assert [str(w.message) for w in caught if issubclass(w.category, (FutureWarning, DeprecationWarning))] == []
