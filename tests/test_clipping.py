"""Clipping on plain (replicated) gradients agrees with torch; the sharded path is covered on 2 ranks."""

from __future__ import annotations

import pytest
import torch

from lightning_fsdp_plus.clipping import (
    clip_grad_norm_across_shards,
    clip_grad_value_across_shards,
    grad_norm_across_shards,
)


def _params(seed: int) -> list[torch.nn.Parameter]:
    torch.manual_seed(seed)
    params = [
        torch.nn.Parameter(torch.randn(5, 3)),
        torch.nn.Parameter(torch.randn(7)),
        torch.nn.Parameter(torch.randn(2)),
    ]
    for p in params[:2]:
        p.grad = torch.randn_like(p) * 3
    return params  # the last one has no gradient


@pytest.mark.parametrize("norm_type", [2.0, 1.0, float("inf")])
def test_norm_and_clip_match_torch(norm_type):
    ours, theirs = _params(0), _params(0)
    total = clip_grad_norm_across_shards(ours, max_norm=0.5, norm_type=norm_type)
    expected = torch.nn.utils.clip_grad_norm_(theirs, 0.5, norm_type=norm_type)
    torch.testing.assert_close(total, expected)
    for a, b in zip(ours[:2], theirs[:2], strict=True):
        torch.testing.assert_close(a.grad, b.grad)
    assert grad_norm_across_shards(ours, norm_type=norm_type) <= 0.5 + 1e-5


def test_value_clipping_matches_torch():
    ours, theirs = _params(1), _params(1)
    clip_grad_value_across_shards(ours, clip_value=0.3)
    torch.nn.utils.clip_grad_value_(theirs, 0.3)
    for a, b in zip(ours[:2], theirs[:2], strict=True):
        torch.testing.assert_close(a.grad, b.grad)
    assert max(p.grad.abs().max().item() for p in ours[:2]) == pytest.approx(0.3)


def test_no_gradients_gives_zero_norm():
    assert grad_norm_across_shards([torch.nn.Parameter(torch.ones(2))]).item() == 0.0
