"""LoRA + 8-bit base: replicated base (``lora_only=True``) vs sharded base (``lora_only=False``).

    python -m benchmarks.lora_int8 [--quick] [--devices 2] [--accelerator cpu] [--out outputs/benchmarks/lora_int8]

Runs a Llama (built from a config, no download) with LoRA r=16 on all projections through
``Trainer(strategy=FSDPPlusStrategy(...), precision="bf16-true")`` on the same data, one case after the other
in the same processes:

============================== ========== ============ ==========================================
case                           lora_only  quantize     units
============================== ========== ============ ==========================================
lora_int8_replicated           True       int8         one per decoder layer (LoRA params only)
lora_int8_replicated_per_layer True       int8         one per LoRA-wrapped linear layer
lora_int8_sharded              False      int8         one per decoder layer (base sharded 1/N)
lora_bf16_replicated           True       -            one per decoder layer
lora_bf16_sharded              False      -            one per decoder layer
============================== ========== ============ ==========================================

Reported per case (max over ranks): median step time and its interquartile range after warm-up, tokens/s,
all-gather and reduce-scatter bytes per step (counted on the collectives FSDP2 calls), frozen (base) bytes
per rank, and the peak tensor-accounted model state per rank. Writes ``results.json`` and ``results.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from datetime import date
from pathlib import Path

import torch
import torch.distributed as dist
from lightning.pytorch import Trainer, seed_everything
from torch.utils.data import DataLoader, Dataset
from transformers import LlamaConfig, LlamaForCausalLM

from benchmarks.harness import BenchmarkRecorder, CommCounter
from lightning_fsdp_plus import FSDPPlusStrategy
from lightning_fsdp_plus._dist import shutdown
from lightning_fsdp_plus.lm import CausalLMModule

LORA = {"r": 16, "alpha": 32, "dropout": 0.0,
        "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]}  # fmt: skip


def _is_lora_layer(module: torch.nn.Module) -> bool:
    from peft.tuners.lora import LoraLayer

    return isinstance(module, LoraLayer)


CASES = {
    "lora_int8_replicated": {"lora_only": True, "quantize_base": "int8"},
    "lora_int8_replicated_per_layer": {"lora_only": True, "quantize_base": "int8", "auto_wrap_policy": _is_lora_layer},
    "lora_int8_sharded": {"lora_only": False, "quantize_base": "int8"},
    "lora_bf16_replicated": {"lora_only": True},
    "lora_bf16_sharded": {"lora_only": False},
}
SIZES = {
    "full": {"hidden_size": 512, "intermediate_size": 1408, "num_hidden_layers": 4, "vocab_size": 1024, "seq": 128},
    "quick": {"hidden_size": 256, "intermediate_size": 704, "num_hidden_layers": 2, "vocab_size": 512, "seq": 64},
}


class RandomTokens(Dataset):
    """Fixed random token sequences."""

    def __init__(self, *, n: int, seq: int, vocab: int) -> None:
        self.data = torch.randint(0, vocab, (n, seq), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.data[i]


def run_case(name: str, *, size: dict, args: argparse.Namespace) -> dict:
    seed_everything(0)
    config = LlamaConfig(num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=size["seq"],
                         **{k: v for k, v in size.items() if k != "seq"})  # fmt: skip
    module = CausalLMModule(LlamaForCausalLM(config), lr=1e-4)
    counter = CommCounter()
    recorder = BenchmarkRecorder(warmup=args.warmup, counter=counter)
    trainer = Trainer(
        strategy=FSDPPlusStrategy(lora=LORA, **CASES[name]),
        accelerator=args.accelerator,
        devices=args.devices,
        precision="bf16-true",
        max_steps=args.warmup + args.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[recorder, recorder.monitor],
    )
    data = RandomTokens(n=(args.warmup + args.steps) * args.batch_size * args.devices, seq=size["seq"],
                        vocab=size["vocab_size"])  # fmt: skip
    with counter.installed():
        trainer.fit(module, DataLoader(data, batch_size=args.batch_size))
    summary = recorder.benchmark_summary(module, world_size=trainer.world_size)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, summary)
    worst = {k: max(s[k] for s in gathered) for k in summary}
    worst["tokens_per_s"] = min(s["tokens_per_s"] for s in gathered)
    units = "per LoRA layer" if "auto_wrap_policy" in CASES[name] else "per decoder layer"
    return {"case": name, **CASES[name], "auto_wrap_policy": units, **worst}


def to_markdown(rows: list[dict], header: str) -> str:
    cols = [
        ("case", "case"),
        ("step_time_s_median", "step s (median)"),
        ("step_time_s_iqr", "IQR s"),
        ("tokens_per_s", "tokens/s"),
        ("all_gather_bytes_per_step", "all-gather B/step"),
        ("all_gather_calls_per_step", "all-gathers/step"),
        ("reduce_scatter_bytes_per_step", "reduce-scatter B/step"),
        ("frozen_bytes_per_rank", "base B/rank"),
        ("model_state_peak_bytes_per_rank", "peak state B/rank"),
    ]
    lines = [header, "", "| " + " | ".join(c[1] for c in cols) + " |", "|" + "---|" * len(cols)]
    for row in rows:
        cells = []
        for key, _ in cols:
            value = row[key]
            cells.append(f"{value:.3f}" if isinstance(value, float) and value < 100 else
                         f"{value:,.0f}" if isinstance(value, (int, float)) else str(value))  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smaller model and fewer steps (about a minute)")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--out", type=Path, default=Path("outputs/benchmarks/lora_int8"))
    parser.add_argument("--cases", default=",".join(CASES))
    args = parser.parse_args()
    args.warmup, args.steps = (2, 6) if args.quick else (3, 12)
    size = SIZES["quick" if args.quick else "full"]
    rows = [run_case(name, size=size, args=args) for name in args.cases.split(",")]
    if dist.get_rank() == 0:
        args.out.mkdir(parents=True, exist_ok=True)
        meta = {
            "date": date.today().isoformat(),
            "machine": f"{platform.machine()}, {os.cpu_count()} cores, {torch.get_num_threads()} thread(s)/rank",
            "command": " ".join(["python -m benchmarks.lora_int8", *sys.argv[1:]]),
            "model": size,
            "torch": torch.__version__,
            "world_size": args.devices,
            "accelerator": args.accelerator,
        }
        (args.out / "results.json").write_text(json.dumps({"meta": meta, "results": rows}, indent=1))
        header = f"LoRA + int8 base, {args.devices} x {args.accelerator}, {meta['date']}: `{meta['command']}`"
        (args.out / "results.md").write_text(to_markdown(rows, header))
        print(to_markdown(rows, header))


if __name__ == "__main__":
    try:
        main()
    finally:
        shutdown()
