"""TRL + PEFT + Accelerate: ``SFTTrainer`` with a ``LoraConfig``, started by ``accelerate launch`` on 2 processes.

The plan's examples go in as a pre-tokenized dataset (``input_ids`` and ``labels``, ``skip_prepare_dataset``), laid
out so that Accelerate's batch sharding (global batch ``i`` of the sequential sampler to process ``i % 2``) gives each
rank the plan's micro-batch; TRL's own collator pads them. Settings as the FACTS for a like-for-like run: no gradient
checkpointing, float32, no packing, ``loss_type="nll"``, tokens averaged across devices, ``ddp_backend="gloo"``.
What Accelerate actually ran (its ``distributed_type``, and whether the model ended up FSDP-wrapped) is recorded:
on CPU Accelerate sets FSDP up only for accelerator devices, so a CPU run with its FSDP2 plugin trains as DDP."""

from __future__ import annotations

import os

from benchmarks.peers.record import Recorder, versions


def main(argv: list[str] | None = None) -> None:
    """Train ``--steps`` steps of the plan and save the adapter in ``--out/adapter``."""
    from benchmarks.peers.cli import worker_args

    args = worker_args(__doc__, argv)
    if args.mode != "float":
        raise SystemExit(f"--mode {args.mode}: the TRL run here uses a float base only")
    import torch
    from datasets import Dataset
    from torch.utils.data import SequentialSampler
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    from benchmarks.peers import SETTINGS, lora_config
    from benchmarks.peers.plan import load_plan

    recorder = Recorder(out=args.out, rank=int(os.environ.get("RANK", 0)))
    plan = load_plan(args.plan)
    order = [i for step in plan["steps"][: args.steps] for rank_rows in step for i in rank_rows]
    dataset = Dataset.from_list(
        [{"input_ids": plan["examples"][i]["input_ids"], "labels": plan["examples"][i]["labels"]} for i in order]
    )

    class InPlanOrder(SFTTrainer):
        def _get_train_sampler(self, *args, **kwargs):
            return SequentialSampler(self.train_dataset)

        def training_step(self, model, inputs, *args, **kwargs):
            recorder.batch(inputs)
            return super().training_step(model, inputs, *args, **kwargs)

    class StepEnds(TrainerCallback):
        def on_step_end(self, *args, **kwargs):
            recorder.step_end()

    config = SFTConfig(
        output_dir=str(args.out / "trl"),
        per_device_train_batch_size=SETTINGS["per_rank_batch"],
        gradient_accumulation_steps=1,
        max_steps=args.steps,
        learning_rate=SETTINGS["lr"],
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=SETTINGS["weight_decay"],
        adam_beta1=SETTINGS["betas"][0],
        adam_beta2=SETTINGS["betas"][1],
        adam_epsilon=SETTINGS["eps"],
        max_grad_norm=0.0,
        use_cpu=args.device == "cpu",
        ddp_backend="gloo" if args.device == "cpu" else "nccl",
        ddp_find_unused_parameters=False,
        gradient_checkpointing=False,
        bf16=args.device == "cuda",
        fp16=False,
        packing=False,
        loss_type="nll",
        average_tokens_across_devices=True,
        dataset_kwargs={"skip_prepare_dataset": True},
        remove_unused_columns=False,
        report_to=[],
        save_strategy="no",
        logging_steps=1,
        dataloader_num_workers=0,
        seed=SETTINGS["seed"],
        disable_tqdm=True,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(plan["base"], dtype=torch.float32)
    trainer = InPlanOrder(
        model=model, args=config, train_dataset=dataset, peft_config=lora_config(), callbacks=[StepEnds()]
    )
    trainer.train()
    accelerator = trainer.accelerator
    wrapped = type(trainer.model_wrapped).__name__
    fsdp2 = any(type(m).__name__.startswith("FSDP") for m in trainer.model_wrapped.modules())
    if accelerator.is_main_process:
        trainer.model.save_pretrained(str(args.out / "adapter"))
    accelerator.wait_for_everyone()
    recorder.write(
        distributed=f"accelerate {accelerator.distributed_type.value}"
        + (", FSDP2" if fsdp2 else f", no FSDP ({type(trainer.model_wrapped).__name__})"),
        wrapped=wrapped,
        losses=[r["loss"] for r in trainer.state.log_history if "loss" in r],
        versions=versions("torch", "transformers", "peft", "trl", "accelerate", "datasets"),
    )


if __name__ == "__main__":
    main()
