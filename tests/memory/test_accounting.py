"""Tensor-accounted model-state bytes on a single process (sharded cases run in test_strategy_distributed)."""

from __future__ import annotations

import torch

from lightning_fsdp_plus.memory import model_state_bytes


def test_params_grads_and_adam_state_are_counted_exactly():
    model = torch.nn.Sequential(torch.nn.Linear(10, 20), torch.nn.Linear(20, 5, bias=False))
    n = sum(p.numel() for p in model.parameters())
    before = model_state_bytes(model)
    assert before.to_dict() == {"params": 4 * n, "unsharded_params": 0, "grads": 0, "optimizer": 0, "total": 4 * n}
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(3, 10)).sum().backward()
    opt.step()
    after = model_state_bytes(model, [opt])
    assert (after.grads, after.optimizer) == (4 * n, 8 * n)  # exp_avg + exp_avg_sq; scalar step counters skipped
    assert after.total == 16 * n
