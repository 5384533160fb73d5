"""Fine-tune a tiny transformers Llama with ``strategy="fsdp_plus"`` on 2 CPU processes.

    python examples/tiny_finetune.py [--sharding-strategy FULL_SHARD] [--devices 2] [--steps 60]

Features shown: FSDP2 sharding without hand-written ``fully_shard`` calls (decoder layers detected from
transformers' ``_no_split_modules``), the printed sharding plan, cross-shard gradient-norm clipping, and
held-out loss before and after training. No download: the model is built from a config and the data
(arithmetic token sequences) is generated here.
"""

from __future__ import annotations

import argparse

import torch
from lightning.pytorch import Trainer, seed_everything
from torch.utils.data import DataLoader, Dataset
from transformers import LlamaConfig, LlamaForCausalLM

import lightning_fsdp_plus  # noqa: F401  (registers strategy="fsdp_plus")
from lightning_fsdp_plus import FSDPPlusStrategy
from lightning_fsdp_plus.lm import CausalLMModule

VOCAB, SEQ = 128, 32


class ArithmeticSequences(Dataset):
    """Sequences ``a, a+d, a+2d, ... (mod VOCAB)``: a pattern a small model learns in a few dozen steps."""

    def __init__(self, n: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        start = torch.randint(0, VOCAB, (n, 1), generator=g)
        step = torch.randint(1, 8, (n, 1), generator=g)
        self.tokens = (start + step * torch.arange(SEQ)) % VOCAB

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.tokens[i]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sharding-strategy", default="FULL_SHARD")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--precision", default="32-true")
    args = parser.parse_args()

    seed_everything(0)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
    )  # fmt: skip
    module = CausalLMModule(LlamaForCausalLM(config), lr=3e-3)
    train = DataLoader(ArithmeticSequences(2048, seed=1), batch_size=16, shuffle=True)
    val = DataLoader(ArithmeticSequences(128, seed=2), batch_size=32)
    trainer = Trainer(
        strategy=FSDPPlusStrategy(args.sharding_strategy),
        accelerator="cpu",
        devices=args.devices,
        precision=args.precision,
        max_steps=args.steps,
        gradient_clip_val=1.0,
        val_check_interval=args.steps,
        log_every_n_steps=10,
        logger=False,
        enable_checkpointing=False,
        default_root_dir="outputs/tiny_finetune",
    )
    before = trainer.validate(module, val, verbose=False)[0]["val_loss"]
    trainer.fit(module, train, val)
    after = trainer.callback_metrics["val_loss"].item()
    if trainer.is_global_zero:
        print(f"held-out loss: {before:.3f} -> {after:.3f} ({(1 - after / before) * 100:.0f}% lower)")


if __name__ == "__main__":
    main()
