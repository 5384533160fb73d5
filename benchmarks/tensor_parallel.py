"""Tensor parallelism against FSDP alone (issue 48): memory per rank, step time and bytes communicated, 2 and 4 CPU
ranks.

A Llama (8 layers, 512 wide, 8 heads and 4 KV heads, MLP 1,376, vocabulary 4,096), full fine-tune in fp32, AdamW,
clipping by norm, the same global batch of 8 sequences of 256 tokens in every layout (each data-parallel rank takes
its share). Layouts: ``fsdp`` (FULL_SHARD over every rank) against ``tp2`` (tensor 2 x FULL_SHARD over the rest), on
2 ranks ``tp2_loss_parallel`` (the head split over the vocabulary too, torch's loss-parallel cross-entropy), and on
4 ranks ``tp4``. Every layout computes the model's own loss (the whole logits). Per layout, on rank 0: the parameter
bytes the plan keeps per rank (its table's total), the process's peak resident memory, the median step's wall and
CPU time over the steps after ``WARMUP``, and the bytes one rank hands to collectives per step, counted by a
dispatch mode over every ``c10d`` and functional-collective op: an all-gather's output, a reduce-scatter's input, an
all-reduce's tensor (FSDP2's parameter all-gathers and gradient reduce-scatters; tensor parallelism's all-reduces of
activations and their gradients; on a data-parallel group of one rank, FSDP2 moves nothing).

    python -m benchmarks.tensor_parallel --out outputs/measured/tensor_parallel
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
STEPS, WARMUP, GLOBAL, SEQ = 8, 2, 8, 256
LAYOUTS = {
    2: {"fsdp": {}, "tp2": {"tensor_parallel_size": 2},
        "tp2_loss_parallel": {"tensor_parallel_size": 2, "loss_parallel": True}},
    4: {"fsdp": {}, "tp2": {"tensor_parallel_size": 2}, "tp4": {"tensor_parallel_size": 4}},
}  # fmt: skip
"""Ranks: {layout: its strategy options}."""


def build() -> Any:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=4096, hidden_size=512, intermediate_size=1376, num_hidden_layers=8,
                         num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=SEQ)  # fmt: skip
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


_MOVES = ("allreduce", "allgather", "reducescatter", "alltoall", "broadcast")
"""Collectives that move data (not a ``wait_tensor``, nor the functional collectives' autograd wrapper)."""


def _collective_bytes() -> Any:
    """A dispatch mode that sums the bytes of every collective's payload (see the module docstring)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.bytes = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            namespace = func.namespace if hasattr(func, "namespace") else ""
            name = func.__name__.replace("_", "")  # allgather, all_gather_into_tensor, reduce_scatter_tensor, ...
            if namespace in ("c10d", "_c10d_functional") and any(k in name for k in _MOVES):
                tensors = [a for a in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
                if tensors:
                    # all-gather: the output (first argument of the in-place ops), else the input
                    self.bytes += max(t.numel() * t.element_size() for t in tensors) if "gather" in name else (
                        tensors[0].numel() * tensors[0].element_size())  # fmt: skip
            return func(*args, **kwargs)

    return Count()


def rank_main(out: Path, layout: str) -> None:
    """One layout's run (under torchrun); rank 0 writes ``out/<layout>-<ranks>.json``."""
    import torch
    from lightning.pytorch import Callback, Trainer, seed_everything
    from torch.utils.data import DataLoader

    from lightning_fsdp_plus import FSDPPlusStrategy
    from tests.helpers.ac_cases import UserLM

    world = int(os.environ["WORLD_SIZE"])
    options = LAYOUTS[world][layout]
    tp = options.get("tensor_parallel_size", 1)
    dp, data_rank = world // tp, int(os.environ["RANK"]) // tp
    generator = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(STEPS):
        ids = torch.randint(0, 4096, (GLOBAL, SEQ), generator=generator).view(dp, -1, SEQ)[data_rank]
        batches.append({"input_ids": ids, "labels": ids.clone()})

    class Measure(Callback):
        def __init__(self) -> None:
            self.wall: list[float] = []
            self.cpu: list[float] = []
            self.comm: list[int] = []

        def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
            self.mode = _collective_bytes()
            self.mode.__enter__()
            self.started = (time.perf_counter(), time.process_time())

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
            self.mode.__exit__(None, None, None)
            self.wall.append(time.perf_counter() - self.started[0])
            self.cpu.append(time.process_time() - self.started[1])
            self.comm.append(self.mode.bytes)

    measure = Measure()
    seed_everything(0)
    trainer = Trainer(strategy=FSDPPlusStrategy(**options), accelerator="cpu", devices=world,
                      max_steps=STEPS, gradient_clip_val=1.0, gradient_clip_algorithm="norm", limit_val_batches=0,
                      logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      use_distributed_sampler=False, callbacks=[measure])  # fmt: skip
    trainer.fit(UserLM(build()), train_dataloaders=DataLoader(batches, batch_size=None))
    if int(os.environ["RANK"]) == 0:
        plan = trainer.strategy.sharding_plan
        result = {
            "layout": layout, "ranks": world, "tensor_parallel_size": tp, "data_parallel": dp,
            "param_bytes_per_rank": plan.bytes_per_rank,
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "step_wall_s": statistics.median(measure.wall[WARMUP:]),
            "step_cpu_s": statistics.median(measure.cpu[WARMUP:]),
            "collective_bytes_per_step": statistics.median(measure.comm[WARMUP:]),
        }  # fmt: skip
        (out / f"{layout}-{world}.json").write_text(json.dumps(result, indent=1))


def report(results: list[dict[str, Any]]) -> str:
    """The results as a Markdown table, FSDP alone first at each rank count."""
    lines = ["| ranks | layout | tensor x data | parameter bytes per rank | peak RSS, rank 0 | step wall (s) |"
             " step CPU (s) | bytes to collectives per step, a rank |",
             "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in sorted(results, key=lambda r: (r["ranks"], r["tensor_parallel_size"], r["layout"])):
        lines.append(
            f"| {r['ranks']} | {r['layout']} | {r['tensor_parallel_size']} x {r['data_parallel']} |"
            f" {r['param_bytes_per_rank']:,} | {r['peak_rss_bytes'] / 2**20:,.0f} MiB | {r['step_wall_s']:.3f} |"
            f" {r['step_cpu_s']:.3f} | {r['collective_bytes_per_step'] / 2**20:,.1f} MiB |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    """Launch every layout at 2 and 4 ranks; write ``results.json`` and ``results.md`` under ``--out``."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=REPO / "outputs" / "measured" / "tensor_parallel")
    parser.add_argument("--rank-main", metavar="LAYOUT", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.rank_main:
        rank_main(args.out, args.rank_main)
        return
    started = time.perf_counter()
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    for ranks, layouts in LAYOUTS.items():
        for layout in layouts:
            command = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={ranks}", "--standalone",
                       "-m", "benchmarks.tensor_parallel", "--out", str(args.out), "--rank-main", layout]  # fmt: skip
            subprocess.run(command, cwd=REPO, env=env, check=True)  # fmt: skip
    results = [json.loads(p.read_text()) for p in sorted(args.out.glob("*-[0-9].json"))]
    (args.out / "results.json").write_text(json.dumps(results, indent=1))
    import datetime
    import platform

    import torch

    head = (f"Measured {datetime.date.today().isoformat()} on {platform.machine()}, {os.cpu_count()} cores, torch"
            f" {torch.__version__}, gloo, with `python -m benchmarks.tensor_parallel`,"
            f" {(time.perf_counter() - started) / 60:.0f} min.\n\n")  # fmt: skip
    (args.out / "results.md").write_text(head + report(results))
    print(head + report(results))


if __name__ == "__main__":
    main()
