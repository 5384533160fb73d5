"""Automatic tensor parallelism against one process (issue 48).

    python -m torch.distributed.run --nproc_per_node=N --standalone tests/helpers/tp_cases.py --tp 2 --out DIR

transformers models trained ``STEPS`` steps under ``FSDPPlusStrategy(tensor_parallel_size=TP)`` on N ranks (N / TP
data-parallel ranks, FULL_SHARD over them), AdamW, clipping by norm on, fp32; the model's declared plan
(``config.base_model_tp_plan``) splits every attention and MLP projection. Every data-parallel rank takes its slice
of each step's global batch (random token sequences of one length), the ranks of a tensor-parallel group the same
slice. The reference is one process, no distributed code: the same model from the run's first full state dict
(adapters included), the global batch's per-rank losses averaged, ``clip_grad_norm_``, AdamW.

Cases: a Llama (4 heads, 4 KV heads), a Qwen2 (4/4, attention biases) and a GQA Llama (8 heads, 2 KV heads), each
full and LoRA (r 4 on every projection, sharded with its base layer), each with and without activation
checkpointing; a tied Qwen2 with GQA, full fine-tune (the tied table stays whole on each tensor rank and trains from
both ends: the embedding's and the head's gradients);
loss parallel (the head split over the vocabulary, the model's own cross-entropy under torch's ``loss_parallel``)
on the GQA Llama and on Qwen2 with LoRA; and the Llama under SHARD_GRAD_OP, NO_SHARD (a 2-D data-parallel mesh under
the tensor one) and ``compile`` (each block compiled after tensor parallelism, before FSDP2).
Rank 0 writes ``DIR/results.json``: per case, the largest loss and parameter difference, the plan's mesh, the
tensor-parallel parameters' placements and each rank's bytes of them.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
from lightning.pytorch import Callback, Trainer, seed_everything
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader

from lightning_fsdp_plus import FSDPPlusStrategy
from lightning_fsdp_plus._dist import barrier, rank
from tests.helpers.ac_cases import LORA, UserLM

STEPS, MICRO, SEQ, VOCAB, CLIP = 10, 2, 16, 96, 0.5
ARCHS = {
    "llama": ("llama", {"num_attention_heads": 4, "num_key_value_heads": 4}),
    "qwen2": ("qwen2", {"num_attention_heads": 4, "num_key_value_heads": 4}),
    "gqa": ("llama", {"num_attention_heads": 8, "num_key_value_heads": 2}),
    "qwen2_tied": ("qwen2", {"num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": True}),
}
"""Name: (transformers architecture, heads and more config); all 64 wide, MLP 128, 2 layers; untied unless the name
says tied (Qwen 2.5's small models and Llama 3.2 tie the head to the embedding)."""
CASES = {
    **{f"{arch}/{mode}{'/checkpointed' if ac else ''}": (arch, mode, {"activation_checkpointing": "auto"} if ac else {})
       for arch in ("llama", "qwen2", "gqa") for mode in ("full", "lora") for ac in (False, True)},
    "qwen2_tied/full": ("qwen2_tied", "full", {}),
    "gqa/full/loss_parallel": ("gqa", "full", {"loss_parallel": True}),
    "qwen2/lora/loss_parallel": ("qwen2", "lora", {"loss_parallel": True}),
    "llama/full/shard_grad_op": ("llama", "full", {"sharding_strategy": "SHARD_GRAD_OP"}),
    "llama/full/no_shard": ("llama", "full", {"sharding_strategy": "NO_SHARD"}),
    "llama/full/compiled": ("llama", "full", {"compile": True}),
}  # fmt: skip
"""Name: (architecture, full or LoRA, more strategy options); FULL_SHARD unless they say otherwise."""
APP_LOSS = {"qwen2/lora/loss_parallel"}
"""Cases whose module computes the app's loss (``causal_lm_loss``: chunked, unless the head is split over the
vocabulary, where it steps aside for the model's own); the others return the model's ``.loss``."""


class AppLossLM(UserLM):
    """``UserLM`` with the app's loss."""

    def training_step(self, batch, batch_idx):
        from lightning_fsdp_plus.loss import causal_lm_loss

        return causal_lm_loss(self.model, batch)


def module_for(name: str, model: torch.nn.Module) -> UserLM:
    """The LightningModule case ``name`` trains (:data:`APP_LOSS`)."""
    return (AppLossLM if name in APP_LOSS else UserLM)(model)


def world_size() -> int:
    """Ranks of this launch (torchrun's ``WORLD_SIZE``; the Trainer starts the process group)."""
    return int(os.environ["WORLD_SIZE"])


def build(arch: str) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    kind, heads = ARCHS[arch]
    config = AutoConfig.for_model(kind, vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  **heads)  # fmt: skip
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config)


def global_batches(*, data_parallel: int, steps: int = STEPS, size: int = 2 * MICRO) -> list[list[dict]]:
    """Per step, the global batch of ``size`` sequences split into one micro-batch per data-parallel rank (labels =
    inputs: every position in the loss; equal sizes, so the mean of the ranks' means is the batch's mean)."""
    generator = torch.Generator().manual_seed(1)
    out = []
    for _ in range(steps):
        ids = torch.randint(0, VOCAB, (size, SEQ), generator=generator).view(data_parallel, -1, SEQ)
        out.append([{"input_ids": part, "labels": part.clone()} for part in ids])
    return out


class Record(Callback):
    """The global loss of every step; the full state dict at the start and at the end (rank 0); the placements of
    the parameters tensor parallelism split."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_start(self, trainer, module) -> None:
        # cloned: a parameter sharded over one data-parallel rank comes back as itself, which training then changes
        self.initial = {k: v.clone() for k, v in get_model_state_dict(trainer.strategy.model, options=_FULL).items()}
        self.placements = {
            name: [str(p) for p in param.placements]
            for name, param in trainer.strategy.model.named_parameters()
            if isinstance(param, DTensor) and param.device_mesh.mesh_dim_names[-1] == "tensor"
            and param.placements[-1].is_shard()  # split over the tensor ranks, not only replicated there
        }  # fmt: skip
        self.local_bytes = sum(p.to_local().numel() * p.element_size() for p in trainer.strategy.model.parameters())
        self.mesh = trainer.strategy.sharding_plan.to_dict()["mesh"]
        self.compiled = list(trainer.strategy.sharding_plan.compiled)

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        self.losses.append(trainer.strategy.reduce(outputs["loss"].detach(), reduce_op="mean").item())

    def on_train_end(self, trainer, module) -> None:
        self.final = get_model_state_dict(trainer.strategy.model, options=_FULL)


_FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


def fit(name: str, arch: str, mode: str, extra: dict, *, tp: int, steps: list[list[dict]]) -> Record:
    seed_everything(0)
    data_rank = int(os.environ.get("RANK", 0)) // tp
    record = Record()
    options = {"tensor_parallel_size": tp, "lora": LORA if mode == "lora" else None, **extra}
    trainer = Trainer(strategy=FSDPPlusStrategy(**options), accelerator="cpu", devices=world_size(),
                      max_steps=STEPS, gradient_clip_val=CLIP, gradient_clip_algorithm="norm", limit_val_batches=0,
                      logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      use_distributed_sampler=False, callbacks=[record])  # fmt: skip
    batches = [step[data_rank] for step in steps]
    trainer.fit(module_for(name, build(arch)), train_dataloaders=DataLoader(batches, batch_size=None))
    return record


def reference(name: str, arch: str, mode: str, initial: dict, steps: list[list[dict]]) -> tuple[list[float], dict]:
    """One process: the run's starting weights, each step's per-rank losses averaged, clipping, AdamW."""
    from lightning_fsdp_plus.lora import apply_lora

    module = module_for(name, build(arch))
    if mode == "lora":
        apply_lora(module, LORA)
    module.load_state_dict(initial)
    optimizer = module.configure_optimizers()
    params = [p for p in module.parameters() if p.requires_grad]
    losses = []
    for step in steps:
        loss = torch.stack([module.training_step(batch, 0) for batch in step]).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, CLIP)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, module.state_dict()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--tp", type=int, required=True)
    parser.add_argument("--only", nargs="*", default=None)
    args = parser.parse_args()
    steps = global_batches(data_parallel=world_size() // args.tp, size=MICRO * world_size() // args.tp)
    results = {}
    for name, (arch, mode, extra) in CASES.items():
        if args.only and name not in args.only:
            continue
        run = fit(name, arch, mode, extra, tp=args.tp, steps=steps)
        if rank() != 0:
            continue
        losses, final = reference(name, arch, mode, run.initial, steps)
        results[name] = {
            "loss_diff": max(abs(a - b) for a, b in zip(run.losses, losses, strict=True)),
            "param_diff": max((run.final[k] - v).abs().max().item() for k, v in final.items()),
            "worst_param": max(final, key=lambda k: (run.final[k] - final[k]).abs().max().item()),
            "losses": run.losses,
            "reference_losses": losses,
            "mesh": run.mesh,
            "compiled": run.compiled,
            "placements": run.placements,
            "local_bytes": run.local_bytes,
            "full_bytes": sum(v.numel() * v.element_size() for v in final.values()),
        }
    if rank() == 0:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
    barrier()
