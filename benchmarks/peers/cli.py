"""The command line every worker (``python -m benchmarks.peers.run_<system>``) takes."""

from __future__ import annotations

import argparse
from pathlib import Path

MODES = ("float", "float_replicated", "int8_sharded", "int8_replicated")
"""How the frozen base is held: float and sharded with the adapters (every system; TRL's as Accelerate runs it),
float and replicated with only the adapters sharded, LLM.int8 sharded or replicated (the last three ours only)."""


def worker_args(description: str, argv: list[str] | None = None) -> argparse.Namespace:
    """``--plan``, ``--out``, ``--steps``, ``--mode`` (see :data:`MODES`) and ``--device``."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--plan", type=Path, required=True, help="plan.json written by python -m benchmarks.peers")
    parser.add_argument("--out", type=Path, required=True, help="the run directory (rank<R>.json, adapter/)")
    parser.add_argument("--steps", type=int, required=True, help="optimizer steps (at most the plan's)")
    parser.add_argument("--mode", choices=MODES, default="float", help="how the frozen base is held")
    parser.add_argument(
        "--device", choices=("cpu", "cuda"), default="cpu", help="cpu: gloo, float32; cuda: nccl, bf16 (one GPU a rank)"
    )
    return parser.parse_args(argv)


def lightning_device(device: str) -> dict[str, str]:
    """The Trainer's ``accelerator`` and ``precision`` for ``--device``: float32 on CPU, bf16 autocast on GPUs (as
    TRL's ``bf16=True``)."""
    return (
        {"accelerator": "cpu", "precision": "32-true"}
        if device == "cpu"
        else {"accelerator": "gpu", "precision": "bf16-mixed"}
    )
