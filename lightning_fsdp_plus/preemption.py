"""Preemption: a signal only sets a flag; every rank learns of it at a step boundary; all save and exit together.

Lightning 2.6's SIGTERM handler calls ``torch.distributed.broadcast`` inside the signal handler. A rank signalled
mid-step pairs that broadcast with another rank's FSDP2 all-gather, and both block until the collective timeout.
Here the handler (:class:`PreemptionSignals`, which replaces Lightning's ``_SignalConnector`` on the trainer)
records the signal and returns: no collective, no I/O. At step boundaries one all-reduce of one integer over a
gloo group tells every rank whether any rank was signalled, so every rank stops after the same optimizer step.
After each optimizer step it runs in flight (:meth:`PreemptionSignals.agree_in_flight`): started there, read at
the next optimizer step — no barrier inside the training loop, and a signal stops training one step later than a
waiting agreement would; before each evaluation step, at the end of evaluation and around fit it waits.
Lightning's loops then raise their ``SIGTERMException`` at the same point on every rank;
:func:`handle_preemption` (the strategy's ``on_exception``) writes the checkpoint and sets the exit status.
"""

from __future__ import annotations

import signal
import time
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch.callbacks import ModelCheckpoint, OnExceptionCheckpoint
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_fsdp_plus._private import _SignalConnector
from lightning_fsdp_plus.options import ON_PREEMPT_CHOICES

if TYPE_CHECKING:
    from types import FrameType

    import lightning.pytorch as pl
    from torch.distributed import ProcessGroup


STOP_SIGNALS: tuple[int, ...] = (int(signal.SIGTERM), int(signal.SIGINT), int(signal.SIGUSR2))
"""Signals that stop a run with a checkpoint, besides the requeue signal (:func:`requeue_signal`): SIGTERM, SIGINT and
SIGUSR2 (submitit's preemption and timeout signal: it requeues the job itself, so the ranks save the "last"
checkpoint and stop, as on SIGTERM)."""


def exit_code(signum: int) -> int:
    """The status a preempted run exits with: 128 + the signal's number (143 for SIGTERM, 138 for SIGUSR1, 130 for
    SIGINT), what shells, SLURM, Kubernetes and torchrun report for a process that signal ended — so a preempted
    run never reads as finished (0) and retry logic treats it as the interruption it was."""
    return 128 + int(signum)


def requeue_signal(trainer: pl.Trainer | None, *, environment: Any = None) -> int:
    """The signal that asks for a requeue: SLURM's ``requeue_signal`` (Lightning's ``SLURMEnvironment``: the
    trainer's, else ``environment``), else SIGUSR1."""
    if trainer is not None:
        environment = trainer._accelerator_connector.cluster_environment
    if isinstance(environment, SLURMEnvironment) and environment.requeue_signal is not None:
        return int(environment.requeue_signal)
    return int(signal.SIGUSR1)


def auto_requeue(trainer: pl.Trainer) -> bool:
    """Whether Lightning's SLURM auto-requeue is on (``SLURMEnvironment(auto_requeue=True)``, the default on SLURM)."""
    environment = trainer._accelerator_connector.cluster_environment
    return isinstance(environment, SLURMEnvironment) and environment.auto_requeue


class PreemptionSignals(_SignalConnector):
    """The trainer's signal handling while ``FSDPPlusStrategy`` runs a stage (it replaces Lightning's own).

    SIGTERM, SIGINT and the requeue signal (SIGUSR1 or SLURM's) only record which signal came first on this rank.
    :meth:`agree` (called by the strategy at step boundaries, on every rank) turns the records into one decision;
    ``received_sigterm``, which Lightning's loops read, becomes true only then, on every rank at once. A second
    SIGINT raises ``KeyboardInterrupt`` at once (Ctrl+C twice: abort without saving).

    Args:
        trainer: the trainer whose stage this covers (``None`` under Fabric: the loop asks the strategy).
        group: the process group of the agreement (``None`` in a single process).
        environment: without a trainer, the cluster environment (SLURM's requeue signal).
    """

    def __init__(self, trainer: pl.Trainer | None, *, group: ProcessGroup | None, environment: Any = None) -> None:
        super().__init__(trainer)  # type: ignore[arg-type]
        self.group = group
        self.environment = environment
        """Fabric's cluster environment when there is no trainer (its SLURM requeue signal)."""
        self.signum = 0
        """The first signal this rank received (0: none); written by the handler only."""
        self.agreed = 0
        """The signal every rank agreed to stop for (the largest number any rank received; 0: none)."""
        self.agree_calls = 0
        """How many agreements ran (the benchmark divides :attr:`agree_seconds` by it)."""
        self.agree_seconds = 0.0
        """Time spent in agreements."""
        self._registered = False
        self._in_flight: tuple[Any, torch.Tensor] | None = None  # (work, flag) of an agreement started, not read

    def signals(self) -> tuple[int, ...]:
        """The signals handled: :data:`STOP_SIGNALS` and the requeue signal."""
        return tuple(dict.fromkeys((*STOP_SIGNALS, requeue_signal(self.trainer, environment=self.environment))))

    def register_signal_handlers(self) -> None:
        """Install the flag-only handler (once per stage: Lightning calls this again after the strategy's setup)."""
        if self._registered:
            return
        self.received_sigterm = False
        self.signum = self.agreed = 0
        self._original_handlers = self._get_current_signal_handlers()
        for signum in self.signals():
            self._register_signal(signum, self._on_signal)
        self._registered = True

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        # runs between two bytecodes of the main thread: record, nothing else
        if signum == signal.SIGINT and self.signum == signal.SIGINT:
            raise KeyboardInterrupt
        if not self.signum:
            self.signum = int(signum)

    def agree(self) -> bool:
        """Whether any rank was signalled, the same answer on every rank (a collective: call it on all of them).
        Waits for every rank; an agreement :meth:`agree_in_flight` started is completed first."""
        if self.agreed or self._collect():
            return True
        return self._decide(self._reduce(wait=True))

    def agree_in_flight(self) -> bool:
        """Like :meth:`agree` without waiting for the other ranks: the answer is the agreement the previous call
        started (finished since: a step of collectives lies between), and this call starts the next one. So a
        signal stops every rank after the same step, one step after :meth:`agree` would have (the per-step
        boundary: no barrier in the step)."""
        if self.agreed or self._collect():
            return True
        if self.group is None:
            return self._decide(self.signum)
        self._in_flight = self._reduce(wait=False)
        return False

    def _reduce(self, *, wait: bool) -> Any:
        """Start (or, with ``wait``, run) the MAX all-reduce of this rank's signal: its result or ``(work, flag)``."""
        started = time.perf_counter()
        if self.group is None:
            result: Any = self.signum
        else:
            flag = torch.tensor([self.signum], dtype=torch.int32)
            work = dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group, async_op=not wait)
            result = int(flag.item()) if wait else (work, flag)
        self.agree_seconds += time.perf_counter() - started
        self.agree_calls += 1
        return result

    def _collect(self) -> bool:
        """Finish the agreement in flight, if any; whether it decided to stop."""
        if self._in_flight is None:
            return False
        (work, flag), self._in_flight = self._in_flight, None
        started = time.perf_counter()
        work.wait()
        self.agree_seconds += time.perf_counter() - started
        return self._decide(int(flag.item()))

    def _decide(self, decided: int) -> bool:
        if decided:
            self.agreed = decided
            self.received_sigterm = True  # Lightning's loops raise SIGTERMException at their next check
        return bool(decided)

    def teardown(self) -> None:
        """Restore the handlers that were there before this stage; a signal that came after the stage's last
        agreement is delivered again to them (it is not swallowed: by default it ends the process)."""
        super().teardown()
        self._registered = False
        self._in_flight = None  # every rank started it together: it finished; its answer no longer matters
        if self.signum and not self.agreed:
            pending, self.signum = self.signum, 0
            signal.raise_signal(pending)


def install(trainer: pl.Trainer, *, group: ProcessGroup | None) -> PreemptionSignals:
    """Put a :class:`PreemptionSignals` in place of the trainer's signal connector and register it now."""
    connector = trainer._signal_connector
    if not isinstance(connector, PreemptionSignals):
        connector = PreemptionSignals(trainer, group=group)
        trainer._signal_connector = connector
    connector.group = group
    connector.register_signal_handlers()
    return connector


def agreement_group(*, backend: str, timeout: Any) -> ProcessGroup | None:
    """The group agreements run on: the default group under gloo; a gloo group beside nccl, so that a CPU
    integer is all-reduced without a device synchronisation. ``None`` in a single process."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    if backend == "gloo":
        return dist.group.WORLD
    return dist.new_group(backend="gloo", timeout=timeout)


def resolve_on_preempt(on_preempt: str | None, *, trainer: pl.Trainer) -> str:
    """``on_preempt`` for this trainer: ``None`` is ``checkpoint`` when a checkpoint directory is configured
    (a ``ModelCheckpoint`` or ``OnExceptionCheckpoint``), else ``exit``; ``checkpoint`` without one is an error."""
    has_directory = checkpoint_callback(trainer) is not None or _on_exception_checkpoints(trainer)
    if on_preempt is None:
        return "checkpoint" if has_directory else "exit"
    if on_preempt == "checkpoint" and not has_directory:
        raise ValueError(
            "on_preempt='checkpoint' needs a checkpoint directory: keep Lightning's ModelCheckpoint"
            " (Trainer(enable_checkpointing=True), the default) or add one, or an OnExceptionCheckpoint;"
            f" or set on_preempt='exit'. Valid choices: {', '.join(ON_PREEMPT_CHOICES)} or None"
        )
    return on_preempt


def checkpoint_callback(trainer: pl.Trainer) -> ModelCheckpoint | None:
    """The trainer's first ``ModelCheckpoint``: its directory receives the preemption checkpoint."""
    return next((c for c in trainer.checkpoint_callbacks if isinstance(c, ModelCheckpoint)), None)


def _on_exception_checkpoints(trainer: pl.Trainer) -> bool:
    return any(isinstance(c, OnExceptionCheckpoint) for c in trainer.callbacks)


def last_checkpoint_path(trainer: pl.Trainer) -> str:
    """Where the preemption checkpoint goes: the ``ModelCheckpoint``'s "last" file (``last.ckpt`` unless renamed),
    which ``fit(ckpt_path="last")`` picks as the newest; written atomically, so the previous one stays valid until
    the new one is complete."""
    callback = checkpoint_callback(trainer)
    assert callback is not None and callback.dirpath is not None
    candidates = callback._monitor_candidates(trainer)
    return callback.format_checkpoint_name(candidates, callback.CHECKPOINT_NAME_LAST)


def handle_preemption(
    trainer: pl.Trainer,
    exception: BaseException,
    *,
    connector: PreemptionSignals,
    on_preempt: str,
    steps_at_start: int,
) -> None:
    """After every rank agreed to stop: save (when fitting, with ``on_preempt="checkpoint"`` and progress since this
    fit started) and give the ``SIGTERMException`` the exit status :func:`exit_code`. A collective: every rank calls
    it, from the strategy's ``on_exception``.

    On SLURM with auto-requeue, the requeue signal saves Lightning's HPC checkpoint (``hpc_ckpt_N.ckpt``, resumed
    automatically when the job restarts) and rank 0 requeues the job (Lightning's own routine, run here at the step
    boundary instead of inside the signal handler).
    """
    if not isinstance(exception, SIGTERMException) or not connector.agreed:
        return
    signum = connector.agreed
    name = signal.Signals(signum).name
    fitting = trainer.state.fn == TrainerFn.FITTING
    if fitting and on_preempt == "checkpoint" and trainer.global_step > steps_at_start:
        if auto_requeue(trainer) and signum == requeue_signal(trainer):
            connector._slurm_sigusr_handler_fn(signum, None)  # type: ignore[arg-type]
        elif not _on_exception_checkpoints(trainer):  # an OnExceptionCheckpoint has just saved
            path = last_checkpoint_path(trainer)
            callback = checkpoint_callback(trainer)
            assert callback is not None
            callback.last_model_path = path  # part of the saved state, as ModelCheckpoint does
            trainer.save_checkpoint(path)
            rank_zero_info(f"fsdp_plus: {name} - saved step {trainer.global_step} to {path}")
    exception.code = exit_code(signum)
    rank_zero_info(
        f"fsdp_plus: {name} received; every rank stopped after step {trainer.global_step}; exit status {exception.code}"
    )
