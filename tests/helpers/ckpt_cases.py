"""Checkpoint scenarios on CPU processes, run as a script (see tests/test_checkpoint_distributed.py).

    python tests/helpers/ckpt_cases.py --out DIR --scenario NAME [--devices 2] [--kind full_ft|lora_int8|lora_nf4[,...]]
        [--state-dict-type sharded|full] [--max-steps N] [--resume last|PATH] [--sharding FULL_SHARD]
        [--step-sleep S] [--crash-on-commit N]  # N: SIGKILL rank 0 at its Nth checkpoint commit
        [--signal PHASE --signal-ranks 0,1 --signal-step N [--signal-name TERM]]  # a rank signals itself
        [--validate] [--stateful] [--on-preempt checkpoint|exit] [--timeout S]

``--signal``: the listed ranks send themselves a real signal in PHASE (forward, backward, optimizer,
validation, checkpoint: inside the step's forward, inside backward, before the optimizer step, inside a
validation step, inside the checkpoint save) when ``global_step`` is N; each writes DIR/<scenario>.signal.rank<r>
(the time). Every rank writes DIR/<scenario>.exit.rank<r>.json ({code, time}) as its interpreter exits.
``--validate``: 2 validation batches every 2 steps; ``--stateful``: torchdata's StatefulDataLoader.

Training: 3 epochs x 4 steps of SGD+momentum on fixed data (same order every epoch); a checkpoint
("last") every 4 steps, in DIR/ckpt. Each rank writes DIR/<scenario>.rank<r>.json (per-step global
losses); rank 0 writes DIR/<scenario>.pt (the full final state dict). Several kinds (``--kind lora_int8,lora_nf4``)
run one after the other in the same processes, each in DIR/<kind>/ (one launch instead of several).
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import signal
import time
from pathlib import Path

import torch
from lightning.pytorch import Callback, Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader
from torchdata.stateful_dataloader import StatefulDataLoader

import lightning_fsdp_plus.checkpoint as checkpoint_module
from lightning_fsdp_plus import FSDPPlusStrategy
from tests.helpers.models import StridedSampler, TokenDataset, lora_llama, sgd_causal_lm, tiny_llama

STEPS_PER_EPOCH, BATCH = 4, 4


class Record(Callback):
    """Per rank: the pid (train start), the step reached, the global losses and (rank 0) the final full state."""

    def __init__(self, out: Path | str, name: str, step_sleep: float = 0.0) -> None:
        self.out, self.name, self.step_sleep = Path(out), name, step_sleep
        self.losses: dict[int, float] = {}

    def on_train_start(self, trainer, module) -> None:
        (self.out / f"{self.name}.rank{trainer.global_rank}.pid").write_text(str(os.getpid()))

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        loss = trainer.strategy.reduce(outputs["loss"].detach().float(), reduce_op="mean").item()
        self.losses[trainer.global_step] = loss
        (self.out / f"{self.name}.rank{trainer.global_rank}.progress").write_text(str(trainer.global_step))
        time.sleep(self.step_sleep)

    def on_train_end(self, trainer, module) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        full = get_model_state_dict(
            trainer.strategy.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
        agreement = trainer.strategy.preemption  # the cost of the preemption check, for the trials' report
        timing = {"agree_calls": agreement.agree_calls, "agree_seconds": agreement.agree_seconds}
        record = {"losses": self.losses, **timing}
        (self.out / f"{self.name}.rank{trainer.global_rank}.json").write_text(json.dumps(record))
        if trainer.global_rank == 0:
            torch.save({k: v.float() for k, v in full.items()}, self.out / f"{self.name}.pt")


class SignalAt(Callback):
    """The listed ranks send themselves ``signum`` in ``phase`` when ``global_step == step`` (once)."""

    def __init__(self, out: Path, name: str, *, phase: str, ranks: set[int], step: int, signum: int) -> None:
        self.out, self.name, self.phase, self.ranks, self.step, self.signum = out, name, phase, ranks, step, signum
        self.sent = False

    def fire(self, trainer, phase: str) -> None:
        if self.sent or phase != self.phase or trainer.global_step != self.step or trainer.sanity_checking:
            return
        if trainer.global_rank in self.ranks:
            self.sent = True
            (self.out / f"{self.name}.signal.rank{trainer.global_rank}").write_text(repr(time.time()))
            os.kill(os.getpid(), self.signum)

    def setup(self, trainer, module, stage) -> None:
        layers = module.model.model.layers

        def on_layer_output(layer, args, output):  # the hook on layer 0's output runs in the middle of backward
            hidden = output[0] if isinstance(output, tuple) else output
            if module.training and hidden.requires_grad:
                hidden.register_hook(lambda grad: self.fire(trainer, "backward"))

        layers[-1].register_forward_pre_hook(lambda layer, args: self.fire(trainer, "forward" if module.training
                                                                          else "validation"))  # fmt: skip
        layers[0].register_forward_hook(on_layer_output)

    def on_before_optimizer_step(self, trainer, module, optimizer) -> None:
        self.fire(trainer, "optimizer")

    def on_save_checkpoint(self, trainer, module, checkpoint) -> None:
        self.fire(trainer, "checkpoint")


def record_exit(out: Path, name: str, status: dict) -> None:
    rank = os.environ.get("LOCAL_RANK", "0")
    (out / f"{name}.exit.rank{rank}.json").write_text(json.dumps({**status, "time": time.time()}))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--scenario", required=True)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--kind", default="full_ft")
    parser.add_argument("--state-dict-type", default="sharded")
    parser.add_argument("--sharding", default="FULL_SHARD")
    parser.add_argument("--max-steps", type=int, default=3 * STEPS_PER_EPOCH)
    parser.add_argument("--resume", default=None)
    parser.add_argument("--step-sleep", type=float, default=0.0)
    parser.add_argument("--crash-on-commit", type=int, default=0, help="SIGKILL rank 0 at the Nth checkpoint commit")
    parser.add_argument("--signal", default=None, help="forward|backward|optimizer|validation|checkpoint")
    parser.add_argument("--signal-ranks", default="0")
    parser.add_argument("--signal-step", type=int, default=5)
    parser.add_argument("--signal-name", default="TERM")
    parser.add_argument("--validate", action="store_true")
    parser.add_argument("--stateful", action="store_true")
    parser.add_argument("--on-preempt", default=None)
    parser.add_argument("--timeout", type=float, default=None)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    status: dict = {"code": 0}
    atexit.register(record_exit, args.out, args.scenario, status)  # registered first: runs after the strategy's
    try:
        kinds = args.kind.split(",")
        for kind in kinds:
            out = args.out / kind if len(kinds) > 1 else args.out
            run(argparse.Namespace(**{**vars(args), "kind": kind, "out": out}))
    except SystemExit as exit_:
        status["code"] = exit_.code
        raise
    except BaseException as error:
        status["code"], status["error"] = 1, repr(error)
        raise


def run(args: argparse.Namespace) -> None:
    args.out.mkdir(parents=True, exist_ok=True)
    if args.crash_on_commit:
        original, calls = checkpoint_module.commit, []

        def crashing_commit(tmp, path):
            calls.append(path)
            if len(calls) == args.crash_on_commit:
                os.kill(os.getpid(), signal.SIGKILL)  # the new checkpoint is fully written but not yet in place
            original(tmp, path)

        checkpoint_module.commit = crashing_commit
    seed_everything(0)
    model = lora_llama(0, r=16) if args.kind.startswith("lora") else tiny_llama(0)
    strategy_kwargs = {
        "lora_int8": {"quantize_base": "int8", "lora_only": True},
        "lora_nf4": {"quantize_base": "nf4", "quantize_double": True},  # sharded 4-bit base, nested statistics
    }.get(args.kind, {})
    if args.on_preempt is not None:
        strategy_kwargs["on_preempt"] = args.on_preempt
    if args.timeout is not None:
        strategy_kwargs["timeout"] = args.timeout
    signal_at = []
    if args.signal:
        ranks = {int(r) for r in args.signal_ranks.split(",")}
        signum = getattr(signal, f"SIG{args.signal_name}")
        signal_at = [SignalAt(args.out, args.scenario, phase=args.signal, ranks=ranks, step=args.signal_step,
                              signum=signum)]  # fmt: skip
    trainer = Trainer(
        strategy=FSDPPlusStrategy(args.sharding, state_dict_type=args.state_dict_type, **strategy_kwargs),
        accelerator="cpu",
        devices=args.devices,
        max_steps=args.max_steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=2 if args.validate else 0,
        val_check_interval=2 if args.validate else None,
        num_sanity_val_steps=0,
        use_distributed_sampler=False,
        callbacks=[
            *signal_at,
            Record(args.out, args.scenario, args.step_sleep),
            ModelCheckpoint(
                dirpath=args.out / "ckpt", save_last=True, save_top_k=0, every_n_train_steps=STEPS_PER_EPOCH
            ),
        ],
    )
    dataset = TokenDataset(n=STEPS_PER_EPOCH * BATCH * 2)  # 2 ranks' worth; 1 rank takes all of it in 2x steps
    loader = StatefulDataLoader if args.stateful else DataLoader
    data = loader(dataset, batch_size=BATCH * (2 // args.devices), sampler=StridedSampler(len(dataset)))
    val = DataLoader(dataset, batch_size=BATCH, sampler=StridedSampler(len(dataset))) if args.validate else None
    module = sgd_causal_lm(model, lr=0.05 if args.kind == "full_ft" else 0.5)
    trainer.fit(module, data, val, ckpt_path=args.resume)


if __name__ == "__main__":
    main()  # FSDPPlusStrategy frees the process group at exit
