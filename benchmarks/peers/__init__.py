"""The same LoRA fine-tune through the systems users pick instead of ours, side by side.

``python -m benchmarks.peers`` runs it (:mod:`benchmarks.peers.__main__`).

One stream of batches (:mod:`benchmarks.peers.plan`: the shipped medical examples through SmolLM2-135M-Instruct's
chat template, tokenized once, in one seeded order) is trained by every system with the same LoRA, optimizer,
learning rate, precision, global batch and number of steps (:data:`SETTINGS`). Each system runs in its own
processes (``python -m benchmarks.peers.run_<system>``), records what it measured (:mod:`benchmarks.peers.record`)
and saves its adapter; one evaluator (:mod:`benchmarks.peers.evaluate`) computes every adapter's held-out loss.
Nothing here is imported by the library; the peers install from the ``peers`` extra.
"""

from __future__ import annotations

SETTINGS = {
    "lora_r": 16,
    "lora_alpha": 32,
    "lora_dropout": 0.0,
    "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    "lr": 2e-3,
    "betas": (0.9, 0.999),
    "eps": 1e-8,
    "weight_decay": 0.0,
    "schedule": "constant",
    "max_grad_norm": None,
    "precision": "fp32",
    "ranks": 2,
    "per_rank_batch": 8,
    "max_seq_len": 256,
    "seed": 0,
}
"""What every system trains with: LoRA (rank, alpha, dropout, targets), AdamW (lr, betas, eps, no weight decay, a
constant schedule, no clipping), float32, 2 ranks of 8 examples (a global batch of 16, padded to each micro-batch's
longest example), examples of at most 256 tokens, the order's seed."""


def lora_config():  # -> peft.LoraConfig
    """PEFT's ``LoraConfig`` of :data:`SETTINGS` (a causal LM)."""
    from peft import LoraConfig

    return LoraConfig(
        r=SETTINGS["lora_r"],
        lora_alpha=SETTINGS["lora_alpha"],
        lora_dropout=SETTINGS["lora_dropout"],
        target_modules=list(SETTINGS["target_modules"]),
        task_type="CAUSAL_LM",
    )


def adamw(params):  # -> torch.optim.AdamW
    """AdamW of :data:`SETTINGS` over ``params``."""
    import torch

    return torch.optim.AdamW(
        params, lr=SETTINGS["lr"], betas=SETTINGS["betas"], eps=SETTINGS["eps"], weight_decay=SETTINGS["weight_decay"]
    )
