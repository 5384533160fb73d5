"""Activation checkpointing on instruction data, 2 ranks: every checkpointed run against the same run without it.

    python -m torch.distributed.run --nproc_per_node=2 --standalone tests/helpers/ac_cases.py --out DIR

The data is the app's: the shipped medical instruction set through ``InstructionDataModule`` (prompt-masked labels,
right padding with attention masks, the shipped tokenizer). The module is what a user writes, ``self.model(**batch)``
— no ``use_cache=False`` — so a transformers decoder builds its key/value cache (its config's default) and
the checkpointed layers must run without it. Architectures: Llama, Qwen2, Phi-3 and GPT-2 (decoders with a cache;
GPT-2 takes it by position), BERT (an encoder, no cache); modes: full fine-tune, LoRA on an int8 base (replicated),
LoRA on an NF4 base (sharded). Ways checkpointing is reached (on the Llama): the strategy's option, the model's own
``gradient_checkpointing_enable()``, both together, and the auto plan's choice under a tight budget.

Rank 0 writes ``DIR/results.json``: per case, the largest loss and parameter difference from its reference run,
the checkpointed paths in the plan, and whether the model's own checkpointing flag was left on.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from lightning_fsdp_plus import FSDPPlusStrategy
from lightning_fsdp_plus._dist import barrier, rank
from lightning_fsdp_plus.app.data import InstructionDataModule
from lightning_fsdp_plus.options import FSDPPlusOptions
from lightning_fsdp_plus.sharding import transformers_checkpointing

TOKENIZER = "examples/assets/tiny-llama"
DATA = "examples/medical_lora/data/train.jsonl"
STEPS, BATCH, SEQ = 3, 4, 96
LORA = {"r": 4, "alpha": 8, "dropout": 0.0, "target_modules": "all-linear"}
MODES = {
    "full": {},
    "lora_int8": {"lora": LORA, "lora_only": True, "quantize_base": "int8"},
    "lora_nf4": {"lora": LORA, "lora_only": False, "quantize_base": "nf4", "quantize_blocksize": 32},
}
ARCHS = ("llama", "qwen2", "phi3", "gpt2", "bert")


def build(arch: str, vocab: int, *, deep: bool = False) -> torch.nn.Module:
    """A small random transformers model of ``arch`` (dropout on where the config has it: the recomputation must
    replay the same masks). ``deep``: a 6-layer, 128-wide Llama whose activations, not its logits, set the peak
    (so that the auto plan's leanest candidates are the checkpointed ones)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForMaskedLM

    common = {"vocab_size": vocab}
    kwargs = {
        "llama": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2),
        "qwen2": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2),
        "phi3": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=4, pad_token_id=0),
        "gpt2": dict(n_embd=64, n_layer=2, n_head=4, n_positions=128),
        "bert": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     max_position_embeddings=128),
    }[arch]  # fmt: skip
    if deep:
        kwargs.update(hidden_size=128, intermediate_size=512, num_hidden_layers=6)
    config = AutoConfig.for_model(arch, **common, **kwargs)
    torch.manual_seed(0)
    auto = AutoModelForMaskedLM if arch == "bert" else AutoModelForCausalLM
    return auto.from_config(config)


class UserLM(LightningModule):
    """A user's fine-tuning module: the model called on the batch as it comes, AdamW."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def training_step(self, batch, batch_idx):
        return self.model(**batch).loss

    def configure_optimizers(self):
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-3)


class Record(Callback):
    """Global loss per step; at the end, the full state dict (rank 0) and what the plan checkpointed."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.state: dict[str, torch.Tensor] = {}

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        self.losses.append(trainer.strategy.reduce(outputs["loss"].detach().float(), reduce_op="mean").item())

    def on_train_end(self, trainer, module) -> None:
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        self.state = get_model_state_dict(trainer.strategy.model, options=options)
        self.checkpointed = list(trainer.strategy.sharding_plan.activation_checkpointing)
        self.flags_on = sum(map(transformers_checkpointing, module.modules()))
        self.auto = trainer.strategy.auto_plan.choice.candidate.to_dict() if trainer.strategy.auto_plan else None


def fit(
    arch: str, options: dict, data: InstructionDataModule, *, hf_checkpointing: bool = False, deep: bool = False
) -> Record:
    seed_everything(0)
    model = build(arch, len(data.tokenizer), deep=deep)
    if hf_checkpointing:
        model.gradient_checkpointing_enable()
    record = Record()
    trainer = Trainer(strategy=FSDPPlusStrategy(**options), accelerator="cpu", devices=2, max_steps=STEPS,
                      limit_val_batches=0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, callbacks=[record])  # fmt: skip
    trainer.fit(UserLM(model), datamodule=data)
    return record


def compare(run: Record, reference: Record) -> dict:
    diffs = [
        (run.state[k].float() - v.float()).abs().max().item()
        for k, v in reference.state.items()
        if v.is_floating_point()
    ]  # fmt: skip (the full state is on rank 0 only)
    return {
        "loss_diff": max(abs(a - b) for a, b in zip(run.losses, reference.losses, strict=True)),
        "param_diff": max(diffs, default=None),
        "losses": run.losses,
        "checkpointed": run.checkpointed,
        "reference_checkpointed": reference.checkpointed,
        "flags_left_on": run.flags_on,
        "auto": run.auto,
    }


def tight_budget(options: dict, vocab: int) -> int:
    """A budget (bytes) only candidates with checkpointing fit: between their least predicted peak and the others'."""
    from lightning_fsdp_plus.autoplan import predict_memory
    from lightning_fsdp_plus.memory.allocator import platform_for
    from lightning_fsdp_plus.memory.fake import ForwardBatch

    given = FSDPPlusOptions(**options, memory_budget=1)
    full_shard = given.replace(sharding_strategy="FULL_SHARD")
    plan = predict_memory(build("llama", vocab, deep=True).config, options=full_shard,
                          world_size=2, precision="32-true", batch=ForwardBatch(BATCH, SEQ), budget=1, margin=0.1,
                          quantize=(None, *given.allow_quantize), lora_run=True,
                          platform=platform_for("cpu"))  # fmt: skip
    with_ac = min(p.peak_bytes for p in plan.predictions if p.candidate.activation_checkpointing)
    without = min(p.peak_bytes for p in plan.predictions if not p.candidate.activation_checkpointing)
    assert with_ac < without, (with_ac, without)
    return int((with_ac + without) / 2 / (1 - given.memory_margin))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    data = InstructionDataModule(tokenizer=TOKENIZER, train_files=[DATA], val_files=[DATA], batch_size=BATCH,
                                 max_seq_len=SEQ)  # fmt: skip
    results: dict[str, dict] = {}
    for arch in ARCHS:
        for mode, options in MODES.items():
            if mode == "lora_nf4" and arch in ("gpt2", "bert"):
                continue  # GPT-2's Conv1D and BERT are covered by the int8 base; NF4 on Llama, Qwen2 and Phi-3
            reference = fit(arch, options, data)
            checkpointed = fit(arch, {**options, "activation_checkpointing": "auto"}, data)
            results[f"{arch}/{mode}"] = compare(checkpointed, reference)
    reference = fit("llama", {}, data)
    results["llama/model_own"] = compare(fit("llama", {}, data, hf_checkpointing=True), reference)
    both = fit("llama", {"activation_checkpointing": "auto"}, data, hf_checkpointing=True)
    results["llama/both"] = compare(both, reference)
    auto = {"sharding_strategy": "auto", "lora": LORA, "allow_quantize": ["int8"], "plan_batch_size": BATCH,
            "plan_seq_len": SEQ}  # fmt: skip
    chosen = fit("llama", {**auto, "memory_budget": tight_budget(auto, len(data.tokenizer))}, data, deep=True)
    pinned = {k: v for k, v in chosen.auto.items() if k != "activation_checkpointing"}
    results["llama/auto_plan"] = compare(chosen, fit("llama", {"lora": LORA, **pinned}, data, deep=True))
    if rank() == 0:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
    barrier()
