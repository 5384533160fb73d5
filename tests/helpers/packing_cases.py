"""Packed rows under the strategy, 2 ranks: every packed run trains exactly as the same examples one per row.

    python -m torch.distributed.run --nproc_per_node=2 --standalone tests/helpers/packing_cases.py --out DIR

The shipped medical instructions through ``InstructionDataModule``: packed (``pack=True``, rows of ``ROW_LEN``) and
one example per row (padded, attention masks). Each rank's micro-batch ``s`` holds ``ROWS`` packed rows of two
examples or more (``[(s * world + rank) * ROWS, + ROWS)`` of them) in the packed run, and exactly those rows'
examples in the reference run, so both see the same target tokens: with no attention and no loss across examples
the losses, gradients and parameters are the same. The app's ``CausalLMModule`` (chunked loss), AdamW, clipping by
norm on.

Cases (fp32): FULL_SHARD, SHARD_GRAD_OP, NO_SHARD and HYBRID_SHARD full fine-tunes (Llama, Qwen2, GPT-2 with
learned positions), LoRA on an int8 base (replicated) and on an NF4 base (sharded), activation checkpointing, and
``compile`` (the packed run compiled, against the eager reference). Rank 0 writes ``DIR/results.json``: per case, the
largest loss and parameter difference from its reference, the losses, and each run's tokens per micro-batch.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from lightning.pytorch import Trainer, seed_everything
from torch.utils.data import DataLoader

from lightning_fsdp_plus import FSDPPlusStrategy
from lightning_fsdp_plus._dist import barrier, rank
from lightning_fsdp_plus.app.data import BOOKKEEPING_KEYS, InstructionDataModule, PadCollator
from lightning_fsdp_plus.app.lm import CausalLMModule
from tests.helpers import ac_cases
from tests.helpers.ac_cases import LORA

TOKENIZER = "examples/assets/tiny-llama"
DATA = "examples/medical_lora/data/train.jsonl"
STEPS, ROWS, ROW_LEN, WORLD = 3, 2, 192, 2
CASES = {
    "llama/full_shard": ("llama", {"sharding_strategy": "FULL_SHARD"}),
    "qwen2/shard_grad_op": ("qwen2", {"sharding_strategy": "SHARD_GRAD_OP"}),
    "gpt2/no_shard": ("gpt2", {"sharding_strategy": "NO_SHARD"}),
    "llama/hybrid_shard": ("llama", {"sharding_strategy": "HYBRID_SHARD"}),
    "llama/lora_int8": ("llama", {"lora": LORA, "lora_only": True, "quantize_base": "int8"}),
    "llama/lora_nf4": ("llama", {"lora": LORA, "lora_only": False, "quantize_base": "nf4", "quantize_blocksize": 32}),
    "llama/activation_checkpointing": ("llama", {"activation_checkpointing": "auto"}),
}
"""Name: (architecture, strategy options); both runs of a case take the same options."""


def build(arch: str, vocab: int) -> torch.nn.Module:
    """A small random transformers decoder (Llama and Qwen2 with 2 KV heads for 4; GPT-2 with learned positions up
    to the row length), dropout off: the two runs of a case must compute the same thing."""
    from transformers import AutoConfig, AutoModelForCausalLM

    attention = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2)  # fmt: skip
    kwargs = {"llama": attention, "qwen2": attention,
              "gpt2": dict(n_embd=64, n_layer=2, n_head=4, n_positions=ROW_LEN, resid_pdrop=0.0, embd_pdrop=0.0,
                           attn_pdrop=0.0)}[arch]  # fmt: skip
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(arch, vocab_size=vocab, **kwargs))


class Record(ac_cases.Record):
    """``ac_cases.Record`` (the global loss of every step, the full state dict at the end), plus the units compiled
    and the attention route the module took."""

    def on_train_end(self, trainer, module) -> None:
        super().on_train_end(trainer, module)
        self.compiled = list(trainer.strategy.sharding_plan.compiled)
        self.route = module._route


def micro_batches(packed: InstructionDataModule, single: InstructionDataModule, *, pack: bool) -> list[dict]:
    """This rank's micro-batches: packed rows of several examples each, or the same rows' examples one per row."""
    shared = [i for i, members in enumerate(packed.packed_rows) if len(members) >= 2]
    out = []
    for step in range(STEPS):
        first = (step * WORLD + rank()) * ROWS
        rows = shared[first : first + ROWS]
        if pack:
            batch = packed.train_collate([packed.train_set.rows[i] for i in rows])
        else:
            examples = [single.train_set.rows[m] for i in rows for m in packed.packed_rows[i]]
            batch = PadCollator(single.tokenizer.pad_token_id)(examples)
        out.append({k: v for k, v in batch.items() if k not in BOOKKEEPING_KEYS})
    return out


def fit(arch: str, options: dict, batches: list[dict], *, vocab: int) -> Record:
    seed_everything(0)
    record = Record()
    trainer = Trainer(strategy=FSDPPlusStrategy(**options), accelerator="cpu", devices=WORLD, max_steps=STEPS,
                      gradient_clip_val=0.5, gradient_clip_algorithm="norm", limit_val_batches=0, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      use_distributed_sampler=False, callbacks=[record])  # fmt: skip
    trainer.fit(CausalLMModule(build(arch, vocab), lr=1e-3), train_dataloaders=DataLoader(batches, batch_size=None))
    return record


def compare(run: Record, reference: Record, batches: dict[str, list[dict]]) -> dict:
    """``ac_cases.compare``'s differences, with what packing adds: the route and each run's batch shapes."""
    return {
        **ac_cases.compare(run, reference),
        "compiled": run.compiled,
        "route": run.route,
        "reference_route": reference.route,
        "positions": {name: [b["input_ids"].shape for b in runs] for name, runs in batches.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    kwargs = dict(tokenizer=TOKENIZER, train_files=[DATA], val_files=[DATA], max_seq_len=ROW_LEN)
    packed, single = InstructionDataModule(**kwargs, pack=True, seed=0), InstructionDataModule(**kwargs)
    vocab = len(single.tokenizer)
    batches = {"packed": micro_batches(packed, single, pack=True), "single": micro_batches(packed, single, pack=False)}
    results: dict[str, dict] = {}
    references: dict[str, Record] = {}
    for name, (arch, options) in CASES.items():
        references[name] = fit(arch, options, batches["single"], vocab=vocab)
        results[name] = compare(fit(arch, options, batches["packed"], vocab=vocab), references[name], batches)
    compiled = fit("llama", {"sharding_strategy": "FULL_SHARD", "compile": True}, batches["packed"], vocab=vocab)
    results["llama/compiled"] = compare(compiled, references["llama/full_shard"], batches)
    if rank() == 0:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps(results, indent=1, default=list))


if __name__ == "__main__":
    main()
    barrier()
