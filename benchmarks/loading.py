"""Loading a pretrained checkpoint: peak memory and time per rank, old path vs streaming loading.

    python -m benchmarks.loading [--checkpoint DIR] [--devices 2] [--repeats 3] [--cases ...] [--report-only]
                                 [--out outputs/benchmarks/loading]

Without ``--checkpoint`` it first saves a randomly initialised Llama of 404 M parameters in bf16
(``outputs/benchmarks/llama-404m``, 0.81 GB, sharded safetensors; about a minute). Each case runs in a fresh
``torchrun`` launch (a clean heap per case); every rank samples ``/proc/self/status`` every 2 ms while it builds
the LightningModule and runs the preparation pipeline (LoRA, int8, ``fully_shard``, materialize/load) exactly as
``FSDPPlusStrategy.setup`` does, in ``bf16-true``:

- ``old_*``: ``from_pretrained`` in every rank, then the pipeline (today's ``model.low_memory_load=false``);
- ``new_*``: ``CausalLMModule.from_pretrained`` (meta) and the pipeline's streaming load.

Modes: ``full_shard`` (all weights trained, FULL_SHARD, bf16), ``full_shard_fp32`` (the same loaded in fp32),
``int8_sharded`` (LoRA r=16 on an int8 base, ``lora_only=False``), ``int8_replicated`` (the same,
``lora_only=True``). Reported per rank: peak anonymous memory
added while loading (``RssAnon``: what the process itself holds), peak file-backed memory added (``RssFile``:
mapped safetensors pages; reclaimable, shared between ranks reading the same file), what stays resident after
loading, and the wall time. Cases alternate within each of ``--repeats`` rounds (slow drift touches all alike);
the report gives the largest memory figures and the median time over rounds. The issue's bounds use B (bf16
bytes), T (largest tensor in fp32), N (ranks). Writes ``results.json`` and ``results.md``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

CONFIG = {"model_type": "llama", "vocab_size": 32000, "hidden_size": 1024, "intermediate_size": 2816,
          "num_hidden_layers": 30, "num_attention_heads": 16, "num_key_value_heads": 4,
          "tie_word_embeddings": False}  # fmt: skip
"""A Llama of 404 M parameters (TinyLlama's shapes at 30 layers and 1024 wide)."""
LORA = {"r": 16, "alpha": 32, "dropout": 0.0}
MODES: dict[str, dict[str, Any]] = {
    "full_shard": {},
    "full_shard_fp32": {},
    "int8_sharded": {"lora": LORA, "quantize_base": "int8"},
    "int8_replicated": {"lora": LORA, "quantize_base": "int8", "lora_only": True},
}
"""Strategy options per mode; ``full_shard_fp32`` loads the bf16 checkpoint in fp32 (``torch_dtype=float32``,
``32-true``), the others keep bf16 (``bf16-true``)."""
BOUNDS = {
    "full_shard": ("B/N + T", lambda b, t, n: b / n + t),
    "full_shard_fp32": ("2B/N + T", lambda b, t, n: 2 * b / n + t),
    "int8_sharded": ("B/(2N) + T", lambda b, t, n: b / (2 * n) + t),
    "int8_replicated": ("B/2 + T", lambda b, t, n: b / 2 + t),
}
"""The issue's bound on the anonymous memory a rank adds while loading (before its +10%)."""
CASES = [f"{path}_{mode}" for mode in MODES for path in ("old", "new")]


def make_checkpoint(directory: Path) -> Path:
    """Save the benchmark Llama (random weights, bf16, 200 MB files) unless it is there."""
    if (directory / "model.safetensors.index.json").is_file():
        return directory
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = dict(CONFIG)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(config.pop("model_type"), **config))
    model.to(torch.bfloat16).save_pretrained(directory, max_shard_size="200MB")
    return directory


def run_case(name: str, checkpoint: Path) -> dict[str, Any]:
    """One case on this rank (under torchrun): memory and time of building + preparing the model."""
    import torch
    import torch.distributed as dist

    from lightning_fsdp_plus import FSDPPlusPrecision
    from lightning_fsdp_plus.app.lm import CausalLMModule, build_causal_lm
    from lightning_fsdp_plus.memory.rss import PeakRss, rss
    from lightning_fsdp_plus.options import FSDPPlusOptions
    from lightning_fsdp_plus.pipeline import build_sharded_model
    from lightning_fsdp_plus.sharding import build_mesh

    path, mode = name.split("_", 1)
    options = FSDPPlusOptions(**MODES[mode])
    dtype, precision = ("float32", "32-true") if mode.endswith("fp32") else (None, "bf16-true")
    layout = options.mesh_layout(world_size=dist.get_world_size())
    mesh = build_mesh(layout=layout, device_type="cpu")
    gc.collect()
    dist.barrier()
    started = time.perf_counter()
    with PeakRss() as peak:
        if path == "new":
            module = CausalLMModule.from_pretrained(str(checkpoint), torch_dtype=dtype)
        else:
            module = CausalLMModule(build_causal_lm(name_or_path=str(checkpoint), torch_dtype=dtype))
        build_sharded_model(module, options, mesh=mesh, layout=layout, precision=FSDPPlusPrecision(precision),
                            device=torch.device("cpu"))  # fmt: skip
        dist.barrier()
    seconds = time.perf_counter() - started
    gc.collect()
    after = rss()
    return {"rank": dist.get_rank(), "seconds": seconds, "added_anon": peak.added_anon, "added_file": peak.added_file,
            "resident_anon": after.anon - peak.before.anon, "resident_file": after.file - peak.before.file}  # fmt: skip


def worker(args: argparse.Namespace) -> None:
    """torchrun entry: run one case, rank 0 writes ``<case>.json`` with every rank's figures."""
    import accelerate  # noqa: F401  - imported before measuring: a real run has them loaded already
    import bitsandbytes  # noqa: F401
    import peft  # noqa: F401
    import torch.distributed as dist
    import torch.distributed.checkpoint  # noqa: F401
    import transformers  # noqa: F401

    from lightning_fsdp_plus._dist import all_gather_object, shutdown

    dist.init_process_group("gloo")
    result = run_case(args.worker, args.checkpoint)
    results = all_gather_object(result)
    if dist.get_rank() == 0:
        (args.out / f"{args.worker}.json").write_text(json.dumps(results, indent=1))
    dist.barrier()
    shutdown()  # gloo groups freed while the interpreter is whole (see _dist.shutdown)


def checkpoint_sizes(checkpoint: Path) -> tuple[int, int]:
    """B (bytes of the bf16 checkpoint) and T (its largest tensor in fp32)."""
    from lightning_fsdp_plus.loading import read_checkpoint

    tensors = read_checkpoint(checkpoint).tensors.values()
    return sum(t.nbytes for t in tensors), max(t.nbytes // t.dtype.itemsize for t in tensors) * 4


def report(results: dict[str, list[list[dict[str, Any]]]], *, b: int, t: int, n: int) -> str:
    """The Markdown table: one row per case; memory of the rank and round with the largest peak, median time."""
    mb = 1e6
    lines = [f"B = {b / 1e9:.3f} GB (bf16 checkpoint), T = {t / mb:.0f} MB (largest tensor in fp32), N = {n} ranks; "
             "MB = 10^6 bytes; memory: the largest over ranks and rounds; time: median over rounds (slowest rank)",
             "",
             "| case | peak anon added (MB) | bound (MB) | within | peak file added (MB) | resident after: anon + file"
             " (MB) | load time (s) |", "|---|---|---|---|---|---|---|"]  # fmt: skip
    for name in CASES:
        if name not in results:
            continue
        rounds = results[name]
        worst = max((r for ranks in rounds for r in ranks), key=lambda r: r["added_anon"])
        mode = name.split("_", 1)[1]
        label, bound = BOUNDS[mode]
        limit = 1.1 * bound(b, t, n)
        seconds = _median_time(rounds)
        lines.append(
            f"| {name} | {worst['added_anon'] / mb:,.0f} | {label} +10% = {limit / mb:,.0f} |"
            f" {'yes' if worst['added_anon'] <= limit else 'no'} | {worst['added_file'] / mb:,.0f} |"
            f" {worst['resident_anon'] / mb:,.0f} + {worst['resident_file'] / mb:,.0f} | {seconds:.2f} |"
        )
    lines.append("")
    for mode in MODES:
        old, new = results.get(f"old_{mode}"), results.get(f"new_{mode}")
        if old and new:
            lines.append(f"- {mode}: load time new / old = {_median_time(new) / _median_time(old):.2f}")
    return "\n".join(lines) + "\n"


def _median_time(rounds: list[list[dict[str, Any]]]) -> float:
    times = sorted(max(r["seconds"] for r in ranks) for ranks in rounds)
    return times[len(times) // 2]


def main(argv: list[str] | None = None) -> None:
    """Run every case in its own torchrun launch and write the report."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", type=Path, default=None, help="a bf16 safetensors checkpoint directory")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3, help="rounds over all cases")
    parser.add_argument("--cases", nargs="*", default=CASES, choices=CASES)
    parser.add_argument("--out", type=Path, default=Path("outputs/benchmarks/loading"))
    parser.add_argument("--report-only", action="store_true", help="rewrite results.md from OUT/results.json")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.worker:
        worker(args)
        return
    if args.report_only:
        saved = json.loads((args.out / "results.json").read_text())
        table = report(saved["cases"], b=saved["B"], t=saved["T"], n=saved["N"])
        (args.out / "results.md").write_text(table)
        print(table)
        return
    args.checkpoint = make_checkpoint(args.checkpoint or Path("outputs/benchmarks/llama-404m"))
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    results: dict[str, list[list[dict[str, Any]]]] = {name: [] for name in args.cases}
    for _ in range(args.repeats):
        for name in args.cases:
            command = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={args.devices}",
                       "--standalone", "-m", "benchmarks.loading", "--worker", name, "--checkpoint",
                       str(args.checkpoint), "--out", str(args.out)]  # fmt: skip
            subprocess.run(command, check=True, env=env)
            results[name].append(json.loads((args.out / f"{name}.json").read_text()))
            print(name, results[name][-1], flush=True)
    b, t = checkpoint_sizes(args.checkpoint)
    (args.out / "results.json").write_text(json.dumps({"B": b, "T": t, "N": args.devices, "cases": results}, indent=1))
    table = report(results, b=b, t=t, n=args.devices)
    (args.out / "results.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
