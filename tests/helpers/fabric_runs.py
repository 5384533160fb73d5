"""Fabric runs started the way users start them (``python script.py``; Fabric's launcher starts rank 1), for the
failure and preemption tests of issue 49, and a one-process load of a 2-rank checkpoint.

    python tests/helpers/fabric_runs.py --scenario fail|preempt|load1 --out DIR [--checkpoint PATH]

- ``fail``: rank 1 raises at step 3 while rank 0 is inside its next collective: every rank ends, with the message.
- ``preempt``: rank 1 sends itself SIGTERM after step 3; after every step the loop asks
  ``fabric.strategy.stop_requested()``: both ranks stop after the same step, save with ``fabric.save`` and exit with
  ``exit_code`` of the signal (143). Each rank writes ``DIR/preempt.rank<r>.json``.
- ``load1``: one process loads ``--checkpoint`` (saved on 2 ranks) into a fresh model; writes ``DIR/load1.json``
  with the largest difference from ``DIR/<name>.step3.pt``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path

import torch
from lightning.fabric import Fabric, seed_everything

from lightning_fsdp_plus import FSDPPlusFabricStrategy
from lightning_fsdp_plus.preemption import exit_code
from tests.helpers.fabric_cases import LR, full_state, global_batches, llama, loss_of


def loop(args: argparse.Namespace) -> None:
    seed_everything(0)
    fabric = Fabric(accelerator="cpu", devices=2, strategy=FSDPPlusFabricStrategy(), precision="32-true")
    fabric.launch()
    model = fabric.setup_module(llama())
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=LR))
    me = fabric.global_rank
    for step, batch in enumerate(global_batches(steps=8), start=1):
        if args.scenario == "fail" and me == 1 and step == 3:
            raise RuntimeError("boom at step 3 on rank 1")
        fabric.backward(loss_of(model, batch.chunk(2)[me], "llama"))
        optimizer.step()
        optimizer.zero_grad()
        if args.scenario == "preempt" and me == 1 and step == 3:
            os.kill(os.getpid(), signal.SIGTERM)  # a flag only: the loop decides at the next question
        signum = fabric.strategy.stop_requested()
        if signum:
            fabric.save(args.out / "ckpt", {"model": model, "optimizer": optimizer, "step": step})
            (args.out / f"preempt.rank{me}.json").write_text(json.dumps({"step": step, "signal": signum}))
            sys.exit(exit_code(signum))
    (args.out / f"{args.scenario}.rank{me}.finished").write_text("")


def load1(args: argparse.Namespace) -> None:
    fabric = Fabric(accelerator="cpu", devices=1, strategy=FSDPPlusFabricStrategy(), precision="32-true")
    fabric.launch()
    model = fabric.setup_module(llama(seed=7))
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=LR))
    state = {"model": model, "optimizer": optimizer, "step": 0}
    fabric.load(args.checkpoint, state)
    expected = torch.load(args.checkpoint.parent / f"{args.checkpoint.name.removeprefix('ckpt_')}.step3.pt")
    loaded = full_state(model)
    result = {"param_diff": max((loaded[k] - v).abs().max().item() for k, v in expected.items()),
              "step": state["step"], "optimizer_states": len(optimizer.state_dict()["state"])}  # fmt: skip
    (args.out / "load1.json").write_text(json.dumps(result))


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--scenario", required=True, choices=["fail", "preempt", "load1"])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--checkpoint", type=Path)
    arguments = parser.parse_args()
    arguments.out.mkdir(parents=True, exist_ok=True)
    (load1 if arguments.scenario == "load1" else loop)(arguments)
