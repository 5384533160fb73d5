"""Lightning's ``ModelParallelStrategy`` as its docs show it: the model built in ``configure_model``, PEFT applied by
hand, ``fully_shard`` on each decoder layer and then on the whole model over the data-parallel mesh (2 ranks, no
tensor parallelism), AdamW over the trainable parameters. The loss is the model's own (transformers' cross-entropy
over the global batch's tokens)."""

from __future__ import annotations

import os

from benchmarks.peers.record import Recorder, versions


def main(argv: list[str] | None = None) -> None:
    """Train ``--steps`` steps of the plan on 2 processes and save the adapter in ``--out/adapter``."""
    from benchmarks.peers.cli import lightning_device, worker_args

    args = worker_args(__doc__, argv)
    if args.mode != "float":
        raise SystemExit(f"--mode {args.mode}: ModelParallelStrategy runs here with a float base only")
    import torch
    from lightning.pytorch import LightningModule, Trainer
    from lightning.pytorch.strategies import ModelParallelStrategy
    from peft import get_peft_model
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM

    from benchmarks.peers import SETTINGS, adamw, lora_config
    from benchmarks.peers.lightning_data import Recording, plan_loader
    from benchmarks.peers.plan import load_plan

    recorder = Recorder(out=args.out, rank=int(os.environ.get("LOCAL_RANK", 0)))
    plan = load_plan(args.plan)
    ranks = SETTINGS["ranks"]

    class LoRAFineTune(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = None

        def configure_model(self) -> None:
            if self.model is not None:
                return
            model = AutoModelForCausalLM.from_pretrained(plan["base"], dtype=torch.float32)
            model = get_peft_model(model, lora_config())
            mesh = self.device_mesh["data_parallel"]
            for layer in model.base_model.model.model.layers:
                fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
            self.model = model

        def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
            total = batch.pop("global_tokens")[0]
            loss = self.model(**batch, use_cache=False, num_items_in_batch=total).loss
            return loss * ranks  # FSDP averages the ranks' gradients: their sum over the global batch's tokens

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return adamw([p for p in self.parameters() if p.requires_grad])

    torch.manual_seed(0)
    module = LoRAFineTune()
    strategy = ModelParallelStrategy(data_parallel_size=ranks, tensor_parallel_size=1)
    trainer = Trainer(
        **lightning_device(args.device),
        devices=ranks,
        strategy=strategy,
        max_steps=args.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        num_sanity_val_steps=0,
        callbacks=[Recording(recorder)],
    )
    trainer.fit(
        module, train_dataloaders=plan_loader(plan, rank=recorder.rank, steps=args.steps, global_key="global_tokens")
    )
    state = {n: p.full_tensor().detach().cpu() for n, p in module.model.named_parameters() if p.requires_grad}
    if trainer.global_rank == 0:
        module.model.save_pretrained(str(args.out / "adapter"), state_dict=state)
    trainer.strategy.barrier()
    recorder.write(
        distributed="ModelParallelStrategy, fully_shard per decoder layer (FSDP2)",
        versions=versions("torch", "lightning", "transformers", "peft"),
    )


if __name__ == "__main__":
    main()
