"""One process, plain transformers + PEFT: the reference for the loss. Each step trains the plan's micro-batches of
both ranks one after the other (gradients accumulated, each token weighted by the global batch's token count), so
the step is the same arithmetic as the two-rank systems'."""

from __future__ import annotations

from benchmarks.peers.record import Recorder, versions


def main(argv: list[str] | None = None) -> None:
    """Train ``--steps`` steps of the plan and save the adapter in ``--out/adapter``."""
    from benchmarks.peers.cli import worker_args

    args = worker_args(__doc__, argv)
    import torch
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from benchmarks.peers import adamw, lora_config
    from benchmarks.peers.plan import load_plan, micro_batch, rank_rows, target_tokens

    recorder = Recorder(out=args.out, rank=0)  # the baseline: everything imported, no model yet
    plan = load_plan(args.plan)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(plan["base"], dtype=torch.float32)
    model = get_peft_model(model, lora_config()).to(args.device)
    model.train()
    autocast = torch.autocast(args.device, dtype=torch.bfloat16, enabled=args.device == "cuda")
    optimizer = adamw([p for p in model.parameters() if p.requires_grad])
    losses = []
    for step in range(args.steps):
        batches = [
            micro_batch(rank_rows(plan, step=step, rank=r), pad_id=plan["pad_id"])
            for r in range(len(plan["steps"][step]))
        ]
        total = torch.tensor(sum(target_tokens(b["labels"]) for b in batches))
        step_loss = 0.0
        for batch in batches:
            recorder.batch(batch)
            with autocast:
                batch = {k: v.to(args.device) for k, v in batch.items()}
                loss = model(**batch, use_cache=False, num_items_in_batch=total.to(args.device)).loss
            loss.backward()
            step_loss += float(loss)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        recorder.step_end()
        losses.append(step_loss)
    model.save_pretrained(str(args.out / "adapter"))
    recorder.write(losses=losses, distributed="one process", versions=versions("torch", "transformers", "peft"))


if __name__ == "__main__":
    main()
