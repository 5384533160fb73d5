"""One benchmark run: fsdp_plus vs hand-written FSDP2 (a plain loop, ``ModelParallelStrategy``) vs Lightning's
strategies, side by side.

    python -m benchmarks.run [--quick] [--devices 2] [--accelerator cpu|gpu] [--repeats R] [--cases a,b]
                             [--out outputs/benchmarks/run]

Starts ``--devices`` ranks with torchrun (gloo on CPU, nccl on GPU) unless already under it. Every
repetition runs every case once, in the same order, so slow drift of the machine touches all cases alike;
each case reports the median of its post-warm-up steps. Across repetitions the report gives the median
and the spread (min-max) of step time, and of each ``fsdp_plus_<s>`` ÷ the faster of ``fsdp2_loop_<s>`` and
``lightning_model_parallel_<s>`` computed within a repetition (the small GPT's too). The last repetition also
runs a few steps of every case under ``torch.profiler`` first; the report lists the ops whose time differs most
from the faster reference. Writes ``results.json``, ``results.md`` and ``results.png`` (rank 0).
``--quick``: a small model, 5 repetitions of 3 + 30 steps (the report's first line gives the wall time).
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import time
from dataclasses import replace
from datetime import date
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from benchmarks.cases import CASES, CLIP, LLAMA_SIZES, SIZES, Setting
from benchmarks.report import aggregate, write_reports
from lightning_fsdp_plus._dist import all_gather_object, shutdown

PROFILE_STEPS = 2
"""Steps of each case the last repetition runs under ``torch.profiler``."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small model, 3 + 30 steps per case")
    parser.add_argument("--size", choices=LLAMA_SIZES, default=None,
                        help="the Llama's size (default: full; quick with --quick); 135m/400m: issue 32's")  # fmt: skip
    parser.add_argument("--devices", type=int, default=2, help="ranks (processes)")
    parser.add_argument("--accelerator", default="cpu", choices=["cpu", "gpu"])
    parser.add_argument("--repeats", type=int, default=5, help="repetitions (default 5)")
    parser.add_argument("--cases", default=",".join(CASES), help="comma-separated subset of: " + ", ".join(CASES))
    parser.add_argument("--out", type=Path, default=Path("outputs/benchmarks/run"))
    parser.add_argument("--steps", type=int, default=None, help="measured steps per case (default 30 quick, 20 full)")
    parser.add_argument(
        "--clip", type=float, default=CLIP, help=f"gradient_clip_val (norm) of every case (default {CLIP}; 0: none)"
    )
    args = parser.parse_args(argv)
    unknown = [c for c in args.cases.split(",") if c not in CASES]
    if unknown:
        parser.error(f"--cases: unknown {unknown}; valid choices: {', '.join(CASES)}")
    if args.devices < 1:
        parser.error(f"--devices={args.devices} must be a positive integer")
    if args.steps is not None and args.steps < 1:
        parser.error(f"--steps={args.steps} must be a positive integer")
    return args


def launch(argv: list[str], devices: int, *, module: str = "benchmarks.run", env: dict[str, str] | None = None) -> int:
    """Re-run ``module`` under torchrun with ``devices`` ranks (``env`` added to the environment); the exit code."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={devices}",
               "-m", module, *argv]  # fmt: skip
    threads = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    return subprocess.call(command, env={**os.environ, **threads, **(env or {})})


def _setting(args: argparse.Namespace) -> Setting:
    warmup, steps = (3, 30) if args.quick else (3, 20)  # quick: ~80 ms steps, more of them against the noise
    steps = args.steps or steps
    return Setting(
        size=SIZES[args.size or ("quick" if args.quick else "full")],
        batch_size=4,
        warmup=warmup,
        steps=steps,
        world_size=dist.get_world_size(),
        accelerator=args.accelerator,
        hybrid_shard_size=max(1, dist.get_world_size() // 2),
        clip=args.clip,
    )


def _meta(args: argparse.Namespace, setting: Setting, argv: list[str]) -> dict[str, Any]:
    device = torch.cuda.get_device_name() if args.accelerator == "gpu" else platform.processor() or platform.machine()
    return {
        "date": date.today().isoformat(),
        "machine": f"{device}, {os.cpu_count()} cores, {torch.get_num_threads()} thread(s)/rank",
        "command": " ".join(["python -m benchmarks.run", *argv]),
        "torch": torch.__version__,
        "backend": dist.get_backend(),
        "world_size": setting.world_size,
        "model": setting.size,
        "batch_size_per_rank": setting.batch_size,
        "warmup_steps": setting.warmup,
        "measured_steps": setting.steps,
        "gradient_clip_val": setting.clip or None,
    }


def main(argv: list[str] | None = None) -> None:
    """Entry point: launch the ranks, run the repetitions, write the reports on rank 0."""
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if "LOCAL_RANK" not in os.environ:
        sys.exit(launch(argv, args.devices))
    if args.accelerator == "gpu":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if args.accelerator == "gpu" else "gloo")
    setting = _setting(args)
    names = args.cases.split(",")
    repeats = args.repeats
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    started = time.perf_counter()
    for rep in range(repeats):
        # the last repetition also profiles a few steps of every case (before its measured steps)
        current = replace(setting, profile_steps=PROFILE_STEPS) if rep == repeats - 1 else setting
        for name in names:
            ranks = all_gather_object(CASES[name](current))  # every rank's figures for this repetition
            runs[name].append({"repetition": rep, "ranks": ranks})
            if dist.get_rank() == 0:
                print(f"[benchmarks] repetition {rep + 1}/{repeats} {name}: done", flush=True)
    if dist.get_rank() == 0:
        meta = _meta(args, setting, argv) | {"repetitions": repeats, "wall_s": time.perf_counter() - started}
        write_reports(aggregate(runs), meta=meta, out=args.out)
        print((args.out / "results.md").read_text())
    # leave together: a rank tearing gloo down while another still works can abort at exit
    # ("terminate called without an active exception", seen once in CI)
    dist.barrier()


if __name__ == "__main__":
    try:
        main()
    finally:
        shutdown()
