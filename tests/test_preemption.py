"""Preemption in one process: the handler only records, agreement decides, options and SLURM requeue."""

from __future__ import annotations

import os
import signal
from datetime import timedelta

import pytest
import torch.distributed as dist
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import OnExceptionCheckpoint
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import SIGTERMException

from lightning_fsdp_plus.options import FSDPPlusOptions
from lightning_fsdp_plus.preemption import (
    PreemptionSignals,
    exit_code,
    handle_preemption,
    install,
    requeue_signal,
    resolve_on_preempt,
)


def trainer(**kwargs) -> Trainer:
    return Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, **kwargs)


@pytest.fixture
def connector():
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)}
    made = install(trainer(), group=None)
    yield made
    made.signum = 0  # nothing pending: teardown must not re-deliver
    made.teardown()
    assert {s: signal.getsignal(s) for s in handlers} == handlers  # restored


def test_exit_status_is_128_plus_the_signal_number():
    assert (exit_code(signal.SIGTERM), exit_code(signal.SIGINT), exit_code(signal.SIGUSR1)) == (143, 130, 138)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGUSR1, signal.SIGINT])
def test_a_signal_only_records_and_the_agreement_decides(connector, monkeypatch, signum):
    called = []
    for name in ("all_reduce", "broadcast", "barrier"):
        monkeypatch.setattr(dist, name, lambda *a, _n=name, **k: called.append(_n))
    os.kill(os.getpid(), signum)
    assert connector.signum == signum and called == []  # no collective, nothing decided yet
    assert connector.trainer.received_sigterm is False  # Lightning's loops see nothing until the agreement
    assert connector.agree() is True
    assert connector.agreed == signum and connector.trainer.received_sigterm is True


def test_a_second_sigint_aborts_at_once(connector):
    os.kill(os.getpid(), signal.SIGINT)
    with pytest.raises(KeyboardInterrupt):
        os.kill(os.getpid(), signal.SIGINT)


def test_a_signal_no_agreement_saw_is_delivered_again_at_teardown():
    made = install(trainer(), group=None)
    seen = []
    made._original_handlers[signal.SIGUSR1] = lambda signum, frame: seen.append(signum)
    os.kill(os.getpid(), signal.SIGUSR1)
    made.teardown()
    assert seen == [signal.SIGUSR1]


def test_the_agreement_is_one_max_all_reduce_on_its_group(monkeypatch):
    calls = []

    def all_reduce(tensor, op, group, async_op=False):
        calls.append((op, group))
        tensor.fill_(int(signal.SIGTERM))  # another rank was signalled

    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    made = PreemptionSignals(trainer(), group="the-group")
    assert made.agree() is True and made.agreed == signal.SIGTERM
    assert calls == [(dist.ReduceOp.MAX, "the-group")]
    assert made.agree() is True and len(calls) == 1  # decided once, no more collectives


def test_the_per_step_agreement_is_read_one_step_later_and_a_waiting_one_finishes_it_first(monkeypatch):
    calls, works = [], []

    class Work:
        def __init__(self, tensor):
            self.tensor, self.waited = tensor, False

        def wait(self):
            self.waited = True
            self.tensor.fill_(int(signal.SIGUSR1))  # another rank had been signalled when it started

    def all_reduce(tensor, op, group, async_op=False):
        calls.append(async_op)
        if async_op:
            works.append(Work(tensor))
            return works[-1]
        return None

    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    made = PreemptionSignals(trainer(), group="the-group")
    assert made.agree_in_flight() is False and calls == [True]  # started, nobody waited on
    assert not works[0].waited and made.received_sigterm is False
    assert made.agree_in_flight() is True and works[0].waited  # the next step reads it: stop, on every rank
    assert made.agreed == signal.SIGUSR1 and made.received_sigterm is True and calls == [True]
    again = PreemptionSignals(trainer(), group="the-group")
    again.agree_in_flight()
    assert again.agree() is True and calls == [True, True]  # a waiting agreement reads the one in flight first


def test_on_preempt_is_checked_with_key_value_and_choices():
    with pytest.raises(ValueError, match=r"on_preempt='save'.*checkpoint, exit"):
        FSDPPlusOptions(on_preempt="save")
    assert FSDPPlusOptions().timeout == timedelta(minutes=10)


def test_on_preempt_default_follows_the_checkpoint_directory():
    assert resolve_on_preempt(None, trainer=trainer()) == "checkpoint"  # Lightning's default ModelCheckpoint
    assert resolve_on_preempt(None, trainer=trainer(enable_checkpointing=False)) == "exit"
    on_exception = trainer(callbacks=[OnExceptionCheckpoint(".")])  # no ModelCheckpoint then
    assert resolve_on_preempt(None, trainer=on_exception) == "checkpoint"
    with pytest.raises(ValueError, match="on_preempt='checkpoint' needs a checkpoint directory"):
        resolve_on_preempt("checkpoint", trainer=trainer(enable_checkpointing=False))


def test_slurm_requeue_signal_saves_the_hpc_checkpoint_and_requeues(monkeypatch, tmp_path):
    from lightning.pytorch.trainer.connectors import signal_connector

    for key, value in {"SLURM_NTASKS": "1", "SLURM_JOB_NAME": "train", "SLURM_JOB_ID": "4242", "SLURM_PROCID": "0",
                       "SLURM_LOCALID": "0", "SLURM_NODEID": "0"}.items():  # fmt: skip
        monkeypatch.setenv(key, value)
    slurm = trainer(plugins=[SLURMEnvironment(auto_requeue=True)], default_root_dir=tmp_path)
    commands, saved = [], []
    monkeypatch.setattr(signal_connector, "call", lambda cmd, **kwargs: commands.append(cmd) or 0)
    monkeypatch.setattr(slurm, "save_checkpoint", lambda path, *a, **k: saved.append(path))
    slurm.state.fn = TrainerFn.FITTING
    made = PreemptionSignals(slurm, group=None)
    made.signum = requeue_signal(slurm)
    assert made.agree()
    error = SIGTERMException()
    handle_preemption(slurm, error, connector=made, on_preempt="checkpoint", steps_at_start=-1)
    assert [os.path.basename(p) for p in saved] == ["hpc_ckpt_1.ckpt"]
    assert commands == [["scontrol", "requeue", "4242"]]
    assert error.code == exit_code(signal.SIGUSR1)


def test_other_exceptions_are_left_alone():
    made = PreemptionSignals(trainer(), group=None)
    made.signum = signal.SIGTERM
    made.agree()
    error = RuntimeError("boom")
    handle_preemption(made.trainer, error, connector=made, on_preempt="checkpoint", steps_at_start=0)
    assert not hasattr(error, "code")
