"""Fine-tune a tiny transformers Llama with ``strategy="fsdp_plus"`` on 2 CPU processes, in plain Python.

The same run without Hydra, for users who build their own Trainer (the ``fsdp-plus-train`` app does this
from YAML).

    python examples/tiny_finetune.py [--sharding-strategy FULL_SHARD] [--devices 2] [--steps 60]

Features shown: FSDP2 sharding without hand-written ``fully_shard`` calls (decoder layers detected from
transformers' ``_no_split_modules``), the printed sharding plan, cross-shard gradient-norm clipping, and
held-out loss before and after training. No download: the model is built from a config and the data
(arithmetic token sequences) is generated in memory.
"""

from __future__ import annotations

import argparse

from lightning.pytorch import Trainer, seed_everything
from transformers import LlamaConfig, LlamaForCausalLM

import lightning_fsdp_plus  # noqa: F401  (registers strategy="fsdp_plus")
from lightning_fsdp_plus import FSDPPlusStrategy
from lightning_fsdp_plus._dist import barrier
from lightning_fsdp_plus.app.data import SyntheticLMDataModule
from lightning_fsdp_plus.app.lm import CausalLMModule

VOCAB, SEQ = 128, 32


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
    data = SyntheticLMDataModule(batch_size=16, seq_len=SEQ, vocab_size=VOCAB)
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
    before = trainer.validate(module, datamodule=data, verbose=False)[0]["val_loss"]
    trainer.fit(module, datamodule=data)
    after = trainer.callback_metrics["val_loss"].item()
    if trainer.is_global_zero:
        print(f"held-out loss: {before:.3f} -> {after:.3f} ({(1 - after / before) * 100:.0f}% lower)")


if __name__ == "__main__":
    main()
    barrier()  # ranks leave together; FSDPPlusStrategy frees the process group at exit
