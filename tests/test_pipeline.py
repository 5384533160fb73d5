"""Preparation stages that need no process group: ``Trainer(sync_batchnorm=True)``'s conversion."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch.plugins.layer_sync import TorchSyncBatchNorm
from torch import nn

from lightning_fsdp_plus.pipeline import batch_norms, sync_batch_norm


def _net() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 1))


def test_sync_batchnorm_converts_batchnorm_layers_on_an_accelerator():
    net = _net()
    weight = net[1].weight
    converted = sync_batch_norm(net, layer_sync=TorchSyncBatchNorm(), device=torch.device("cuda", 0))
    assert isinstance(converted[1], nn.SyncBatchNorm) and converted[1].weight is weight  # same parameters
    assert batch_norms(converted) == [] and batch_norms(_net()) == ["1"]


def test_sync_batchnorm_on_cpu_is_refused_before_any_step_and_a_model_without_batchnorm_passes():
    with pytest.raises(ValueError, match=r"sync_batchnorm=True\) on CPU: torch's SyncBatchNorm runs on GPU/XPU only"
                       r" \(1 is a BatchNorm\)"):  # fmt: skip
        sync_batch_norm(_net(), layer_sync=TorchSyncBatchNorm(), device=torch.device("cpu"))
    plain = nn.Linear(2, 2)
    assert sync_batch_norm(plain, layer_sync=TorchSyncBatchNorm(), device=torch.device("cpu")) is plain
