"""``fsdp-plus-estimate``: per-rank memory for each sharding strategy, before you launch.

    fsdp-plus-estimate --params 7.5e9 --world-size 64
    fsdp-plus-estimate --config path/to/config.json --world-size 8 16 --strategy all \\
        --precision bf16-mixed --optimizer adamw --lora-rank 16 --quantize-base int8|nf4 --lora-only \\
        --batch-size 4 --seq-len 2048 [--activation-checkpointing] [--simulate] [--json]

A table for people by default (GB = 10^9 bytes); ``--json`` prints a machine-readable document (a list of
them for several world sizes) whose ``strategies`` maps each sharding strategy to its figures in bytes.

With ``--budget 24GiB`` (needs ``--config``, one world size) it prints the auto plan's table instead: every
candidate configuration the strategy's ``sharding_strategy="auto"`` would consider, its predicted peak and step
time, and the choice (``--hardware h100|a100|l4`` assumed GPU figures, or ``cpu``: this machine's compute
probed, ``--link-bandwidth`` GB/s; ``--allow-quantize int8 nf4``; ``--memory-margin``). Exit status 2 when
nothing fits, with the closest candidate and the bytes missing.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import warnings
from collections.abc import Sequence
from typing import Any

from lightning_fsdp_plus.autoplan.budget import device_memory
from lightning_fsdp_plus.autoplan.cost import CPU_LINK_BANDWIDTH, CPU_LINK_LATENCY, PRESETS, Hardware
from lightning_fsdp_plus.lora import DEFAULT_TARGETS
from lightning_fsdp_plus.memory.allocator import PLATFORMS, Platform, tcmalloc_path
from lightning_fsdp_plus.memory.assumptions import OPTIMIZER_STATES, PRECISION_BYTES
from lightning_fsdp_plus.memory.estimate import (
    STRATEGY_CHOICES,
    EstimateError,
    MemoryEstimate,
    ModelDescription,
    estimate_memory,
)
from lightning_fsdp_plus.memory.fake import load_config
from lightning_fsdp_plus.options import field_docs
from lightning_fsdp_plus.quantization import QUANTIZE_CHOICES

_COLUMNS = (
    ("params", "params"),
    ("unsharded_params", "unsharded kept"),
    ("grads", "grads"),
    ("optimizer", "optimizer"),
    ("model_state_bytes_per_rank", "model state"),
    ("activation_bytes_per_rank", "activations"),
    ("largest_unit_transient_bytes", "unit transient"),
    ("peak_with_transient_bytes_per_rank", "peak"),
    ("real_peak_bytes_per_rank", "real peak"),
)
_NEEDS_ACTIVATIONS = ("activation_bytes_per_rank", "largest_unit_transient_bytes", "peak_with_transient_bytes_per_rank",
                      "real_peak_bytes_per_rank")  # fmt: skip
"""Columns a model known only by its size has no figure for (no activations, no units)."""


def short_moment(moment: str | None) -> str:
    """``backward layers.31`` for ``backward model.base_model.model.model.layers.31`` (the unit's last name, with
    its parent's for numbered blocks); ``-`` for None."""
    if moment is None:
        return "-"
    phase, _, path = moment.partition(" ")
    parts = path.split(".")
    tail = ".".join(parts[-2:]) if parts and parts[-1].isdigit() else parts[-1]
    return f"{phase} {tail}".strip()


def notes_for(estimates: Sequence[MemoryEstimate]) -> list[str]:
    """What a reader of the table must know about these rows."""
    notes = []
    if any(e.sharding_strategy == "NO_SHARD" and e.world_size == 1 for e in estimates):
        notes.append("NO_SHARD at world size 1: FSDP2 still keeps an unsharded copy of every parameter beside its"
                     " (whole) shard (checked: the two storages differ), so parameters count twice; at one rank"
                     " FULL_SHARD gathers one unit at a time and holds the least")  # fmt: skip
    runtime = sorted({e.runtime_bytes_per_rank for e in estimates if e.runtime_bytes_per_rank})
    if runtime:
        gib = " to ".join(f"{b / 2**30:.2f}" for b in (runtime[0], runtime[-1]) if b) if len(runtime) > 1 else (
            f"{runtime[0] / 2**30:.2f}")  # fmt: skip
        notes.append(f"the real peak includes {gib} GiB the CUDA runtime holds outside PyTorch's allocator: its"
                     " context (pytorch/pytorch#85692) and a NCCL communicator per process group (NVIDIA/nccl#964);"
                     " torch.cuda.max_memory_allocated() does not show them, nvidia-smi does")  # fmt: skip
    return notes


def build_parser() -> argparse.ArgumentParser:
    """The command-line interface."""
    parser = argparse.ArgumentParser(
        prog="fsdp-plus-estimate", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    model = parser.add_mutually_exclusive_group(required=True)
    model.add_argument("--params", type=float, help="parameter count, e.g. 7.5e9")
    model.add_argument("--config", help="a transformers config.json (or its directory); local files only")
    parser.add_argument("--world-size", type=int, nargs="+", required=True, help="one or more world sizes")
    parser.add_argument("--strategy", default="all", help=f"one of {', '.join(STRATEGY_CHOICES)} (any case)")
    docs = {k: v.replace("%", "%%") for k, v in field_docs().items()}  # the options' own docstrings (argparse-safe)
    parser.add_argument("--hybrid-shard-size", type=int, help=docs.get("hybrid_shard_size"))
    parser.add_argument("--tensor-parallel-size", type=int, default=1, help=docs.get("tensor_parallel_size"))
    parser.add_argument("--loss-parallel", action="store_true", help=docs.get("loss_parallel"))
    parser.add_argument("--precision", default="bf16-mixed", choices=list(PRECISION_BYTES))
    parser.add_argument("--optimizer", default="adamw", choices=list(OPTIMIZER_STATES))
    parser.add_argument("--lora-rank", type=int, help="apply PEFT LoRA of this rank (needs --config)")
    parser.add_argument(
        "--lora-targets",
        default=",".join(DEFAULT_TARGETS),
        help="comma-separated linear layer names LoRA adapts (default: %(default)s)",
    )
    parser.add_argument("--trainable-fraction", type=float, help="with --params: the share of parameters that train")
    parser.add_argument("--lora-only", action="store_true", help=docs.get("lora_only"))
    parser.add_argument("--quantize-base", choices=list(QUANTIZE_CHOICES), help=docs.get("quantize_base"))
    parser.add_argument("--quantize-blocksize", type=int, default=64, help=docs.get("quantize_blocksize"))
    parser.add_argument("--quantize-double", action="store_true", help=docs.get("quantize_double"))
    parser.add_argument("--cpu-offload", action="store_true", help=docs.get("cpu_offload"))
    parser.add_argument("--reshard-root-after-forward", action="store_true",
                        help=docs.get("reshard_root_after_forward"))  # fmt: skip
    parser.add_argument(
        "--activation-checkpointing", action="store_true", help="checkpoint every unit but the root (needs --config)"
    )
    parser.add_argument("--checkpointing-mode", choices=["full", "selective"], default="full",
                        help=docs.get("activation_checkpointing_mode"))  # fmt: skip
    parser.add_argument("--unchunked-loss", action="store_true",
                        help="count the model's own loss (the batch's float32 logits) instead of the app's chunked"
                        " one (CausalLMModule(chunked_loss=False), model.chunked_loss=false)")  # fmt: skip
    parser.add_argument("--batch-size", type=int, default=1, help="per-rank batch for the activation estimate")
    parser.add_argument("--seq-len", type=int, default=2048, help="sequence length for the activation estimate")
    parser.add_argument(
        "--padded", action="store_true", help="batches carry padding (attention mask): attention saves more"
    )
    parser.add_argument("--packed", action="store_true",
                        help="batches are packed rows (data.pack=true: position_ids restart per example, a block"
                        " attention mask); --seq-len is the row length")  # fmt: skip
    parser.add_argument("--platform", choices=list(PLATFORMS),
                        help="what the real peak is for: all-gather copies and the allocator's overhead (default: cuda;"
                        " with --hardware cpu, cpu-tcmalloc where tcmalloc is installed (scripts/run preloads it),"
                        " else cpu-glibc)")  # fmt: skip
    parser.add_argument("--simulate", action="store_true", help="also run torch's FSDP2 memory tracker (fake PG)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    plan = parser.add_argument_group("auto plan (--budget)")
    plan.add_argument("--budget", help=docs.get("memory_budget"))
    plan.add_argument("--memory-margin", type=float, default=0.1, help=docs.get("memory_margin"))
    plan.add_argument("--allow-quantize", nargs="*", default=[], choices=list(QUANTIZE_CHOICES),
                      help=docs.get("allow_quantize"))  # fmt: skip
    plan.add_argument("--hardware", default="h100", choices=[*PRESETS, "cpu"],
                      help="assumed GPU figures, or cpu: this machine probed (default: %(default)s)")  # fmt: skip
    plan.add_argument("--link-bandwidth", type=float, help="GB/s per rank for collectives (overrides --hardware's)")
    return parser


def format_table(model: ModelDescription, estimates: Sequence[MemoryEstimate], *, header: str) -> str:
    """The estimates as an aligned text table in GB (10^9 bytes), or MB for small models."""
    largest = max((e.model_state_bytes_per_rank + (e.activation_bytes_per_rank or 0) for e in estimates), default=0)
    unit, scale = ("GB", 1e9) if largest >= 1e9 else ("MB", 1e6)

    def _gb(value: int | None) -> str:
        return "n/a" if value is None else f"{value / scale:.3f}"

    size_only = all(e.activation_bytes_per_rank is None for e in estimates)
    columns = [(k, t) for k, t in _COLUMNS if not (size_only and k in _NEEDS_ACTIVATIONS)]
    rows = [["strategy", "world", "shard", *(title for _, title in columns)]]
    moments = not size_only and any(e.peak_moment for e in estimates)
    if moments:
        rows[0].append("peak at")
    simulated = any(e.simulated for e in estimates)
    if simulated:
        rows[0].append("simulated peak")
    for e in estimates:
        figures = e.to_dict()
        row = [e.sharding_strategy, str(e.world_size), str(e.shard_size), *(_gb(figures[k]) for k, _ in columns)]
        if moments:
            row.append(short_moment(e.peak_moment))
        if simulated:
            row.append(_gb(e.simulated["total"]) if e.simulated else "n/a")
        rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [header, f"{unit} per rank (1 {unit} = {scale:.0e} bytes)"]
    for row in rows:
        cells = zip(row, widths, strict=True)
        lines.append("  ".join(c.ljust(w) if i == 0 or (c[:1].isalpha() and c != "n/a") else c.rjust(w)
                               for i, (c, w) in enumerate(cells)).rstrip())  # fmt: skip
    lines += [f"note: {note}" for note in notes_for(estimates)]
    return "\n".join(lines) + "\n"


def _documents(model: ModelDescription, estimates: list[MemoryEstimate], inputs: dict[str, Any]) -> Any:
    sizes = list(dict.fromkeys(e.world_size for e in estimates))
    docs = [
        {
            "world_size": size,
            "inputs": inputs,
            "model": model.to_dict(),
            "strategies": {e.sharding_strategy: e.to_dict() for e in estimates if e.world_size == size},
            "notes": notes_for([e for e in estimates if e.world_size == size]),
        }
        for size in sizes
    ]
    return docs[0] if len(docs) == 1 else docs


def _lora(args: argparse.Namespace) -> dict[str, Any] | None:
    if args.lora_rank is None:
        return None
    targets = [t.strip() for t in args.lora_targets.split(",") if t.strip()]
    return {"r": args.lora_rank, "alpha": 2 * args.lora_rank, "dropout": 0.0, "target_modules": targets}


def _hardware(args: argparse.Namespace) -> Hardware:
    """The ``--hardware`` preset, or this machine's compute probed (one process: no link to measure) with one
    rank's share of the cores (the world size's ranks share this host, as the strategy's ``share_cores`` makes
    them: probing with every core predicted 2.76 s for a 5.67 s step at 135M on 2 ranks)."""
    if args.hardware in PRESETS:
        hardware = PRESETS[args.hardware]
    else:
        import torch

        from lightning_fsdp_plus.autoplan.probe import hardware_from, measure
        from lightning_fsdp_plus.cpu_threads import rank_share_of_cores

        config = load_config(args.config)
        with rank_share_of_cores(local_ranks=args.world_size[0]) as threads:
            timings = measure(features=(config.hidden_size, getattr(config, "intermediate_size",
                                                                    4 * config.hidden_size)),
                              tokens=args.batch_size * args.seq_len, precision=args.precision,
                              device=torch.device("cpu"), quantize=[q for q in args.allow_quantize if q])  # fmt: skip
        hardware = dataclasses.replace(hardware_from([timings], world_size=1, accelerator=False),
                                       link_bandwidth=CPU_LINK_BANDWIDTH, link_latency=CPU_LINK_LATENCY,
                                       source=f"this CPU probed with {threads} thread(s), one rank's share of the"
                                       " cores; gloo loopback link assumed")  # fmt: skip
    return hardware.with_link_bandwidth(args.link_bandwidth)


def _platform(args: argparse.Namespace) -> Platform:
    """``--platform``, else what ``--hardware`` implies (on CPU: the allocator scripts/run would preload)."""
    if args.platform is not None:
        return PLATFORMS[args.platform]
    if args.hardware == "cpu":
        return PLATFORMS["cpu-tcmalloc" if tcmalloc_path() else "cpu-glibc"]
    return PLATFORMS["cuda"]


def run_plan(parser: argparse.ArgumentParser, args: argparse.Namespace) -> str:
    """``--budget``: the auto plan's table for the config (exit 2 when nothing fits)."""
    import torch

    from lightning_fsdp_plus.autoplan import NoFitError, parse_budget, predict_memory
    from lightning_fsdp_plus.memory.estimate import estimate_options
    from lightning_fsdp_plus.memory.fake import ForwardBatch

    if args.config is None:
        parser.error("--budget needs --config (activations decide what fits; --params has none)")
    if len(args.world_size) != 1:
        parser.error(f"--budget plans for one world size; got --world-size {' '.join(map(str, args.world_size))}")
    lora = _lora(args)
    if args.allow_quantize and lora is None:
        parser.error("--allow-quantize quantizes a frozen base: give --lora-rank (a LoRA run)")
    hardware = _hardware(args)
    try:
        options = estimate_options(None, lora=lora, memory_margin=args.memory_margin,
                                   **({"quantize_blocksize": args.quantize_blocksize,
                                       "quantize_double": args.quantize_double}))  # fmt: skip
        memory = hardware.device_memory or device_memory(torch.device("cpu"))
        plan = predict_memory(
            args.config, options=options, world_size=args.world_size[0], precision=args.precision,
            batch=ForwardBatch(args.batch_size, args.seq_len, args.padded, args.packed), margin=args.memory_margin,
            budget=parse_budget(args.budget, device_memory=memory, key="--budget"), budget_text=args.budget,
            quantize=(args.quantize_base,) if args.quantize_base else (None, *args.allow_quantize),
            lora_run=lora is not None, accelerator=hardware.accelerator, optimizer=args.optimizer,
            platform=_platform(args),
        )  # fmt: skip
        plan.require_fit()
    except NoFitError as err:
        sys.stdout.write(plan.format_table())
        parser.exit(2, f"{parser.prog}: error: {err}\n")
    except (EstimateError, ValueError) as err:
        parser.error(str(err))
    plan = plan.with_hardware(hardware)
    return json.dumps(plan.to_dict(), indent=1) + "\n" if args.json else plan.format_table()


def run(argv: Sequence[str] | None = None) -> str:
    """Parse ``argv``, estimate, and return the text to print (raises ``SystemExit(2)`` on bad input)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.budget is not None:
        return run_plan(parser, args)
    if args.lora_rank is not None and args.config is None:
        parser.error("--lora-rank needs --config (the layers to adapt); with --params use --trainable-fraction")
    lora = _lora(args)
    inputs = {k: v for k, v in vars(args).items() if k != "json"}
    try:
        model, estimates = estimate_memory(
            params=args.params, config=args.config, world_size=args.world_size, strategy=args.strategy,
            precision=args.precision, optimizer=args.optimizer, hybrid_shard_size=args.hybrid_shard_size,
            lora=lora, trainable_fraction=args.trainable_fraction, lora_only=args.lora_only,
            quantize_base=args.quantize_base, cpu_offload=args.cpu_offload,
            tensor_parallel_size=args.tensor_parallel_size, loss_parallel=args.loss_parallel,
            reshard_root_after_forward=args.reshard_root_after_forward,
            **({"quantize_blocksize": args.quantize_blocksize, "quantize_double": args.quantize_double}
               if args.quantize_base in ("nf4", "fp4") else {}),
            activation_checkpointing=args.activation_checkpointing, batch_size=args.batch_size, padded=args.padded,
            packed=args.packed, seq_len=args.seq_len, simulate=args.simulate, platform=_platform(args),
            activation_checkpointing_mode=args.checkpointing_mode, chunked_loss=not args.unchunked_loss,
        )  # fmt: skip
    except (EstimateError, ValueError) as err:
        parser.error(str(err))
    if args.json:
        return json.dumps(_documents(model, estimates, inputs), indent=1) + "\n"
    header = (
        f"{model.source}: {model.total_weights:,} parameters, {model.trainable_params:,} trainable;"
        f" {args.precision}, {args.optimizer}"
        + (f", LoRA r={args.lora_rank}" if lora else "")
        + (f", {args.quantize_base} base" if args.quantize_base else "")
        + (", frozen base replicated" if args.lora_only else "")
        + (", CPU offload" if args.cpu_offload else "")
        + (
            f", tensor parallel {args.tensor_parallel_size} (parameter counts: one tensor rank's share; activations"
            " counted whole)"
            if args.tensor_parallel_size > 1
            else ""
        )
        + (", loss parallel (the head split over the vocabulary, the model's own loss)" if args.loss_parallel else "")
        + (", root resharded after forward" if args.reshard_root_after_forward else "")
        + (f", {args.checkpointing_mode} activation checkpointing" if args.activation_checkpointing else "")
        + (", the model's own (unchunked) loss" if args.config and args.unchunked_loss else "")
        + (f"; activations for batch {args.batch_size} x {args.seq_len} tokens" if args.config else "")
        + (", padded" if args.config and args.padded else "")
        + (", packed rows" if args.config and args.packed else "")
        + (
            f"; real peak on {_platform(args).name}"
            if args.config
            else "; model state only: the peak needs --config (activations and units)"
        )
    )
    return format_table(model, estimates, header=header)


def main(argv: Sequence[str] | None = None) -> None:
    """Console entry point."""
    warnings.filterwarnings("ignore", category=FutureWarning, module="transformers")  # deprecations, not ours
    sys.stdout.write(run(argv))


if __name__ == "__main__":
    main()
