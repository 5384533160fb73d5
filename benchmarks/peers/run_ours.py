"""Ours: ``Trainer(strategy=FSDPPlusStrategy(...))`` on 2 CPU processes, LoRA applied by the strategy, the base
built on meta and each rank reading its own shards (``CausalLMModule.from_pretrained``). ``--mode``: a float base
sharded with the adapters (FULL_SHARD) or replicated with only the adapters sharded (LoRA-only sharding, as
DDP holds it), or an LLM.int8 base sharded or replicated."""

from __future__ import annotations

import os

from benchmarks.peers.record import Recorder, versions


def main(argv: list[str] | None = None) -> None:
    """Train ``--steps`` steps of the plan on 2 processes and save the adapter in ``--out/adapter``."""
    from benchmarks.peers.cli import lightning_device, worker_args

    args = worker_args(__doc__, argv)
    import torch
    from lightning.pytorch import Trainer

    from benchmarks.peers import SETTINGS
    from benchmarks.peers.lightning_data import Recording, plan_loader
    from benchmarks.peers.plan import load_plan
    from lightning_fsdp_plus import FSDPPlusStrategy
    from lightning_fsdp_plus.app.data import GLOBAL_TOKENS_KEY
    from lightning_fsdp_plus.app.lm import CausalLMModule
    from lightning_fsdp_plus.lora import export_adapter

    recorder = Recorder(out=args.out, rank=int(os.environ.get("LOCAL_RANK", 0)))
    plan = load_plan(args.plan)
    lora = {
        "r": SETTINGS["lora_r"],
        "alpha": SETTINGS["lora_alpha"],
        "dropout": SETTINGS["lora_dropout"],
        "target_modules": list(SETTINGS["target_modules"]),
    }
    held = {
        "float": {"quantize_base": None, "lora_only": False},
        "float_replicated": {"quantize_base": None, "lora_only": True},
        "int8_sharded": {"quantize_base": "int8", "lora_only": False},
        "int8_replicated": {"quantize_base": "int8", "lora_only": True},
    }[args.mode]
    strategy = FSDPPlusStrategy(sharding_strategy="FULL_SHARD", lora=lora, **held)
    torch.manual_seed(0)
    module = CausalLMModule.from_pretrained(
        plan["base"],
        torch_dtype=torch.float32,
        lr=SETTINGS["lr"],
        betas=SETTINGS["betas"],
        weight_decay=SETTINGS["weight_decay"],
    )
    trainer = Trainer(
        **lightning_device(args.device),
        devices=SETTINGS["ranks"],
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
    loader = plan_loader(plan, rank=recorder.rank, steps=args.steps, global_key=GLOBAL_TOKENS_KEY)
    trainer.fit(module, train_dataloaders=loader)
    export_adapter(trainer.strategy.model, args.out / "adapter")
    recorder.write(
        distributed=f"fsdp_plus FULL_SHARD, {args.mode} base",
        versions=versions("torch", "lightning", "transformers", "peft", "bitsandbytes", "lightning-fsdp-plus"),
    )


if __name__ == "__main__":
    main()
