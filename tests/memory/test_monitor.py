"""``MemoryMonitor`` and ``SavedActivations`` in one process (the 2-rank runs are in test_memory_distributed)."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.utilities.exceptions import SIGTERMException
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_fsdp_plus.memory import MemoryMonitor, SavedActivations
from lightning_fsdp_plus.memory import monitor as monitor_module
from lightning_fsdp_plus.memory.monitor import device_memory, release_cached_memory
from tests.helpers.models import TinyLM


def test_saved_activations_count_what_backward_keeps_and_not_parameters():
    torch.manual_seed(0)
    first, second = nn.Linear(16, 32), nn.Linear(32, 8)
    x = torch.randn(5, 16)
    with SavedActivations() as counter:
        second(torch.relu(first(x))).sum()
    # x (for first's weight grad), relu's output (its own grad and second's weight grad); weights are excluded
    assert counter.bytes == 5 * 16 * 4 + 5 * 32 * 4
    with SavedActivations() as checkpointed:
        checkpoint(lambda t: second(torch.relu(first(t))), x, use_reentrant=False).sum()
    assert checkpointed.bytes == 5 * 16 * 4  # only the checkpoint's input: the rest is recomputed in backward


def test_monitor_bad_arguments_name_the_key():
    with pytest.raises(ValueError, match=r"empty_cache_every_n_steps=-1 is not valid; use an integer >= 0"):
        MemoryMonitor(empty_cache_every_n_steps=-1)


class _Fails(TinyLM):
    def training_step(self, batch, batch_idx):
        if self.global_step == 2:
            raise RuntimeError("out of memory (simulated)")
        return super().training_step(batch, batch_idx)


def _fit(module, monitor, tmp_path, steps=4):
    trainer = Trainer(
        accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[monitor], default_root_dir=tmp_path,
    )  # fmt: skip
    trainer.fit(module)
    return trainer


def test_monitor_in_a_single_process_run_logs_summarises_and_writes_summaries(tmp_path, monkeypatch):
    released = []
    monkeypatch.setattr(monitor_module, "release_cached_memory", lambda device: released.append(device))
    monitor = MemoryMonitor(log_every_n_steps=1, empty_cache_every_n_steps=2, summary_every_n_steps=4)
    trainer = _fit(TinyLM(optimizer="adamw"), monitor, tmp_path)
    n = sum(p.numel() for p in trainer.lightning_module.parameters())
    assert monitor.empty_cache_steps == [2] and len(released) == 1  # before steps 2 (step 4 is never started)
    assert monitor.model_state_peak == 16 * n  # fp32 params + grads + AdamW's two states
    assert monitor.peak.activations > 0 and monitor.peak.unsharded_params == 0
    assert trainer.callback_metrics["memory/optimizer"] == 8 * n
    summary = monitor.summary(trainer)
    assert summary["model_state_bytes_per_rank"] == 16 * n
    assert summary["tensor_peak_bytes_per_rank"] == monitor.peak.tensor_total
    text = (tmp_path / "memory_summary.step4.rank0.txt").read_text()
    assert "rank 0 peak sample" in text and "activations" in text


def test_monitor_writes_a_summary_when_training_fails(tmp_path):
    monitor = MemoryMonitor(log_every_n_steps=0)
    with pytest.raises(RuntimeError, match="out of memory"):
        _fit(_Fails(), monitor, tmp_path)
    assert "latest sample" in (tmp_path / "memory_summary.exception.rank0.txt").read_text()


class _Preempted(TinyLM):
    def training_step(self, batch, batch_idx):
        if self.global_step == 2:
            raise SIGTERMException  # what Lightning's loops raise once every rank agreed to stop on a signal
        return super().training_step(batch, batch_idx)


def test_a_preemption_is_not_summarised_as_a_failure(tmp_path, caplog):
    """A SIGTERM, SIGUSR1 (requeue) or SIGUSR2 stop is not a failure (issue 35): no failure summary, no line that
    says so; the strategy logs the signal, the step and the checkpoint instead."""
    monitor = MemoryMonitor(log_every_n_steps=0)
    with caplog.at_level("INFO"), pytest.raises(SIGTERMException):
        _fit(_Preempted(), monitor, tmp_path)
    assert monitor.last is not None  # it had a sample it could have written
    assert not list(tmp_path.glob("memory_summary.exception.*")) and "at the failure" not in caplog.text


def test_cuda_paths_use_the_allocator(monkeypatch):
    """By construction: on CUDA the figures come from torch.cuda's allocator statistics."""
    cuda = torch.device("cuda", 0)
    calls = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty"))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda d: 10)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda d: 30)
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda d: {"active_bytes.all.current": 20})
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda d: 40)
    assert release_cached_memory(cuda) is True and calls == ["empty"]
    assert release_cached_memory(torch.device("cpu")) is False
    stats = device_memory(cuda)
    assert (stats.allocated, stats.reserved, stats.active, stats.peak) == (10, 30, 20, 40)
    cpu = device_memory(torch.device("cpu"))
    assert cpu.reserved is None and cpu.peak >= cpu.allocated > 0
