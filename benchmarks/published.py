"""Our estimate for each published GPU fine-tuning run whose conditions we can express (issue 44).

Each row names the run, its source (file or page, with what it measured), the conditions we model, the published
figure, our estimator's real peak on CUDA for the closest configuration we offer, and the ratio. The models are built
from their configs on FakeTensors (no weights, no GPU): Llama 2 7B/70B and Llama 3.1 405B from the shapes in their
published ``config.json``, Llama 3.1 8B/70B from ``examples/configs``.

    python -m benchmarks.published            # prints the Markdown table; --out DIR writes DIR/results.md too

Published figures are in GiB as their sources print them; ours too. What a source measured matters: torchtitan and
Answer.AI report the CUDA caching allocator's *reserved* peak, torchtune its *active* peak, PEFT ``nvidia-smi``-like
totals; our real peak on ``cuda`` is live tensors (the caching allocator's reserve is ``memory_margin``'s share).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "examples" / "configs"
ALL_PROJ = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
TORCHTUNE_8B = ["q_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
"""torchtune's 8B (Q)LoRA recipes: ``lora_attn_modules: [q_proj, v_proj, output_proj]``, ``apply_lora_to_mlp``."""

LLAMA2_7B = {"model_type": "llama", "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008,
             "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
             "max_position_embeddings": 4096, "tie_word_embeddings": False}  # fmt: skip
LLAMA2_70B = {**LLAMA2_7B, "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
              "num_attention_heads": 64, "num_key_value_heads": 8}  # fmt: skip
LLAMA31_405B = {"model_type": "llama", "vocab_size": 128256, "hidden_size": 16384, "intermediate_size": 53248,
                "num_hidden_layers": 126, "num_attention_heads": 128, "num_key_value_heads": 8,
                "max_position_embeddings": 131072, "tie_word_embeddings": False, "rope_theta": 500000.0}  # fmt: skip


@dataclass(frozen=True)
class PublishedRun:
    """One published measurement and the closest configuration of ours."""

    name: str
    """What was run."""
    source: str
    """Where it is published, and what its figure measures."""
    conditions: str
    """The run's conditions as its source gives them."""
    published_gib: float
    """The published peak per GPU, GiB."""
    config: Any
    """A config path or a dict of config fields."""
    estimate: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments for ``estimate_memory`` (ours, closest)."""
    ours: str = ""
    """Our configuration in words."""
    gap: str = ""
    """Why our figure differs, in numbers, where the ratio is outside 0.85-1.15 (filled from the run as well)."""
    expressible: bool = True
    """False when a condition has no counterpart of ours (the row then says which)."""
    measures: str = "allocator"
    """``allocator``: PyTorch's allocator statistics (an active or reserved peak), compared with our live peak,
    which leaves out what the CUDA runtime holds outside the allocator; ``device``: the whole GPU as ``nvidia-smi``
    shows it, compared with our real peak (live + the CUDA context + NCCL's communicators)."""


def ours(**fields: Any) -> dict[str, Any]:
    """``estimate_memory`` arguments: FULL_SHARD, bf16-true, 2048 tokens, full checkpointing unless ``fields`` say
    otherwise."""
    return {"strategy": "full_shard", "precision": "bf16-true", "seq_len": 2048, "activation_checkpointing": True,
            **fields}  # fmt: skip


QLORA_70B_ON_2 = {"world_size": 2, "batch_size": 2, "quantize_base": "nf4"}
"""Llama-2-70B QLoRA on two GPUs, 2 x 2048 tokens (Answer.AI's and PEFT's runs)."""
PEFT_70B = {**QLORA_70B_ON_2, "lora": {"r": 8, "alpha": 16, "target_modules": ALL_PROJ}, "quantize_double": True}
"""PEFT's FSDP + QLoRA example: LoRA r8 on every linear layer, nested (double) quantization."""

RUNS = [
    PublishedRun(
        "Llama-3.1-8B QLoRA, 1x RTX 4090",
        "torchtune README, memory table (peak memory per GPU)",
        "batch 2 x 2048 packed, compile; recipe 8B_qlora_single_device: LoRA r8 on q,v,o and MLP, NF4 base, AC, bf16",
        7.4,
        CONFIGS / "llama-3-8b",
        ours(
            world_size=1,
            batch_size=2,
            lora={"r": 8, "alpha": 16, "target_modules": TORCHTUNE_8B},
            quantize_base="nf4",
            quantize_double=True,
        ),
        "FULL_SHARD at 1 rank, bf16-true, LoRA r8 q,v,o + MLP, NF4 base double-quantized (torchao's NF4 always is),"
        " full AC, chunked loss",
    ),
    PublishedRun(
        "Llama-3.1-8B LoRA, 1x RTX 4090",
        "torchtune README, memory table (peak memory per GPU)",
        "batch 2 x 2048 packed, compile; recipe 8B_lora_single_device: LoRA r8 on q,v,o and MLP, AC, bf16",
        16.2,
        CONFIGS / "llama-3-8b",
        ours(world_size=1, batch_size=2, lora={"r": 8, "alpha": 16, "target_modules": TORCHTUNE_8B}),
        "FULL_SHARD at 1 rank, bf16-true, LoRA r8 q,v,o + MLP, bf16 base, full AC, chunked loss",
    ),
    PublishedRun(
        "Llama-3.1-70B LoRA, 8x A100",
        "torchtune README, memory table (peak memory per GPU)",
        "batch 2 x 2048 packed, compile; recipe 70B_lora: LoRA r16 on q,k,v, FSDP over 8 GPUs, AC, bf16",
        27.6,
        CONFIGS / "llama-3-70b",
        ours(world_size=8, batch_size=2, lora={"r": 16, "alpha": 32, "target_modules": ["q_proj", "k_proj", "v_proj"]}),
        "FULL_SHARD on 8, bf16-true, LoRA r16 q,k,v, full AC, chunked loss",
    ),
    PublishedRun(
        "Llama-3.1-8B full fine-tune, 1x RTX 4090",
        "torchtune README, memory table (peak memory per GPU)",
        "batch 2 x 2048 packed; recipe full_finetune_single_device: paged 8-bit AdamW, optimizer in backward, AC",
        18.9,
        CONFIGS / "llama-3-8b",
        {},
        "",
        "",
        expressible=False,
    ),
    PublishedRun(
        "Llama-3.1-8B full fine-tune, 8x H100",
        "torchtitan benchmarks/llama3_h100_202412_torchtitan.md, Table 1, row FSDP (memory: max reserved)",
        "local batch 2 x 8192, FSDP over 8, selective AC, bf16 params / fp32 reduce, AdamW",
        82.4,
        CONFIGS / "llama-3-8b",
        ours(
            world_size=8, precision="bf16-mixed", batch_size=2, seq_len=8192, activation_checkpointing_mode="selective"
        ),
        "FULL_SHARD on 8, bf16-mixed, selective AC (matmul + attention outputs kept), chunked loss",
    ),
    PublishedRun(
        "Llama-2-7B QLoRA, 2x RTX 3090",
        "Answer.AI fsdp_qlora benchmarks_03_2024.md, 7B table (peak reserved)",
        "batch 1 x 2048, FSDP over 2 GPUs, LoRA r64 (script default) all linear, NF4 base, AC (reentrant)",
        5.21,
        LLAMA2_7B,
        ours(world_size=2, batch_size=1, lora={"r": 64, "alpha": 16, "target_modules": ALL_PROJ}, quantize_base="nf4"),
        "FULL_SHARD on 2, bf16-true, LoRA r64 all projections, NF4 base, full AC",
    ),
    PublishedRun(
        "Llama-2-7B LoRA, 2x RTX 3090",
        "Answer.AI fsdp_qlora benchmarks_03_2024.md, 7B table (peak reserved)",
        "batch 1 x 2048, FSDP over 2 GPUs, LoRA r64 all linear, bf16 base, AC (reentrant)",
        10.22,
        LLAMA2_7B,
        ours(world_size=2, batch_size=1, lora={"r": 64, "alpha": 16, "target_modules": ALL_PROJ}),
        "FULL_SHARD on 2, bf16-true, LoRA r64 all projections, bf16 base, full AC",
    ),
    PublishedRun(
        "Llama-2-70B QLoRA, 2x RTX 3090, CPU offload",
        "Answer.AI fsdp_qlora benchmarks_03_2024.md, 70B table (peak reserved)",
        "batch 2 x 2048, FSDP over 2 GPUs, CPU offload, LoRA r64 all linear, NF4 base, AC",
        14.92,
        LLAMA2_70B,
        ours(**QLORA_70B_ON_2, lora={"r": 64, "alpha": 16, "target_modules": ALL_PROJ}, cpu_offload=True),
        "FULL_SHARD on 2, cpu_offload, bf16-true, LoRA r64 all projections, NF4 base, full AC",
    ),
    PublishedRun(
        "Llama-2-70B QLoRA, 2 GPUs, CPU offload",
        "PEFT docs/source/accelerate/fsdp.md, Memory usage (per GPU)",
        "batch 2 x 2048 packed, FSDP over 2, CPU offload, LoRA r8 all-linear, NF4 (nested) base, AC, flash-attn",
        19.6 * 1e9 / 2**30,
        LLAMA2_70B,
        ours(**PEFT_70B, cpu_offload=True),
        "FULL_SHARD on 2, cpu_offload, bf16-true, LoRA r8 all projections, NF4 double-quant base, full AC",
        measures="device",
    ),
    PublishedRun(
        "Llama-2-70B QLoRA, 2 GPUs, no offload",
        "PEFT docs/source/accelerate/fsdp.md, Memory usage (per GPU)",
        "as above without CPU offload",
        35.6 * 1e9 / 2**30,
        LLAMA2_70B,
        ours(**PEFT_70B),
        "FULL_SHARD on 2, bf16-true, LoRA r8 all projections, NF4 double-quant base, full AC",
        measures="device",
    ),
    PublishedRun(
        "Llama-3.1-405B QLoRA, 8x A100",
        "torchtune README, memory table (peak memory per GPU, printed as GB)",
        "batch 2 x 2048 packed; recipe 405B_qlora: LoRA r16 on q,k,v,o, NF4 base, FSDP over 8, AC",
        44.8,
        LLAMA31_405B,
        ours(
            world_size=8,
            batch_size=2,
            lora={"r": 16, "alpha": 32, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]},
            quantize_base="nf4",
            quantize_double=True,
        ),
        "FULL_SHARD on 8, bf16-true, LoRA r16 q,k,v,o, NF4 base double-quantized, full AC",
    ),
]
"""The published runs (each source read for its conditions; see the module docstring for what each measures)."""


def config_path(config: Any, directory: Path, name: str) -> Path:
    """A directory holding ``config.json`` for ``config`` (a path as it is; a dict written under ``directory``)."""
    if not isinstance(config, dict):
        return Path(config)
    from transformers import AutoConfig

    target = directory / name
    spec = dict(config)
    AutoConfig.for_model(spec.pop("model_type"), **spec).save_pretrained(target)
    return target


def estimate_run(run: PublishedRun, directory: Path) -> dict[str, Any]:
    """Our figures for one run: real peak (GiB), its moment, and the parts of that moment."""
    from lightning_fsdp_plus.memory.estimate import estimate_memory

    path = config_path(run.config, directory, run.name.split(",")[0].replace(" ", "_"))
    _, (est,) = estimate_memory(config=path, **run.estimate)
    moment = next(m for m in est.timeline if m["name"] == est.peak_moment) if est.timeline else {"parts": {}}
    parts = {k: round(v / 2**30, 2) for k, v in moment["parts"].items()}
    ours = est.live_peak_bytes_per_rank
    if run.measures == "device":
        ours, parts["CUDA context + NCCL"] = est.real_peak_bytes_per_rank, round(est.runtime_bytes_per_rank / 2**30, 2)
    return {"ours_gib": ours / 2**30, "moment": est.peak_moment, "parts_gib": parts}


def table(rows: list[tuple[PublishedRun, dict[str, Any] | None]]) -> str:
    """The comparison as Markdown."""
    lines = ["| run | source (what it measured) | its conditions | published, GiB | ours (closest) | our estimate, "
             "GiB | ratio | peak moment: parts, GiB |", "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for run, ours in rows:
        if ours is None:
            lines.append(f"| {run.name} | {run.source} | {run.conditions} | {run.published_gib:.1f} | not expressible:"
                         " 8-bit paged AdamW and the optimizer step fused into backward have no counterpart here | -"
                         " | - | - |")  # fmt: skip
            continue
        ratio = ours["ours_gib"] / run.published_gib
        parts = ", ".join(f"{k} {v}" for k, v in ours["parts_gib"].items())
        lines.append(f"| {run.name} | {run.source} | {run.conditions} | {run.published_gib:.2f} | {run.ours} |"
                     f" {ours['ours_gib']:.2f} | {ratio:.2f} | {ours['moment']}: {parts} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    """Estimate every expressible run and print (and with ``--out`` write) the table and a JSON record."""
    import tempfile

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        rows = [(run, estimate_run(run, Path(tmp)) if run.expressible else None) for run in RUNS]
    import datetime

    import torch

    head = (f"Estimated {datetime.date.today().isoformat()} with `python -m benchmarks.published` (torch"
            f" {torch.__version__}; the estimator on FakeTensors, platform cuda: no GPU ran)\n\n")  # fmt: skip
    text = head + table(rows)
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.md").write_text(text)
        record = [{"name": r.name, "published_gib": r.published_gib, **(o or {})} for r, o in rows]
        (args.out / "results.json").write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    sys.exit(main())
