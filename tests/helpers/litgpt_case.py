"""LitGPT's LoRA model with an int8 (or NF4) base, sharded by ``Fabric(strategy="fsdp_plus")`` on 2 ranks (issue 49).

    python -m torch.distributed.run --nproc_per_node=2 --standalone tests/helpers/litgpt_case.py --out DIR \
        [--quantize int8|nf4]

LitGPT's own ``finetune/lora.py`` refuses this (``setup``: "Quantization is currently not supported for multi-GPU
training", when ``devices * num_nodes > 1``) and builds its own strategy, so the loop is LitGPT's model and LoRA
layers as they ship (``litgpt.lora.GPT``, ``LoRAQKVLinear``, ``LoRALinear``, ``mark_only_lora_as_trainable``) driven
by a Fabric loop as ``finetune/lora.py``'s ``fit`` does (AdamW on the adapters, ``fabric.backward``,
``fabric.clip_gradients``). The adapter: LitGPT quantizes through its ``BitsandbytesPrecision`` plugin (CUDA only,
bitsandbytes layers swapped in at ``init_module``); here ``quantize_base`` quantizes the frozen ``nn.Linear`` inside
each LoRA layer (``LoRALinear.linear``) and shards the int8 weights. 20 steps on patterned token rows; rank 0 writes
``DIR/litgpt.json``: the losses, the quantized layers and this rank's bytes of them.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from lightning.fabric import Fabric, seed_everything

from lightning_fsdp_plus import FSDPPlusFabricStrategy
from lightning_fsdp_plus._dist import barrier, rank
from lightning_fsdp_plus.quantization import FourBitLinear, Int8Linear

STEPS, ROWS, SEQ = 20, 8, 32


def build():
    from litgpt.lora import GPT, Config, mark_only_lora_as_trainable

    config = Config(name="tiny-lora", block_size=SEQ, vocab_size=128, padded_vocab_size=128, n_layer=2, n_head=4,
                    n_query_groups=2, n_embd=64, rotary_percentage=1.0, parallel_residual=False, bias=False,
                    norm_class_name="RMSNorm", mlp_class_name="LLaMAMLP", intermediate_size=128, lora_r=8,
                    lora_alpha=16, lora_dropout=0.0, lora_query=True, lora_key=True, lora_value=True,
                    lora_projection=True, lora_mlp=True, lora_head=False)  # fmt: skip
    torch.manual_seed(0)
    model = GPT(config)
    mark_only_lora_as_trainable(model)
    return model


def main() -> None:
    from litgpt.model import Block

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--quantize", default="int8", choices=["int8", "nf4"])
    args = parser.parse_args()
    seed_everything(0)
    strategy = FSDPPlusFabricStrategy(quantize_base=args.quantize, auto_wrap_policy={Block})
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy, precision="32-true")
    fabric.launch()
    model = fabric.setup_module(build())
    optimizer = fabric.setup_optimizers(torch.optim.AdamW([p for p in model.parameters() if p.requires_grad],
                                                          lr=2e-2))  # fmt: skip
    rows = torch.stack([(torch.arange(SEQ + 1) * (r + 1) + r) % 128 for r in range(ROWS)])
    mine = rows.chunk(2)[fabric.global_rank]
    losses = []
    for _ in range(STEPS):
        logits = model(mine[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), mine[:, 1:].reshape(-1))
        fabric.backward(loss)
        fabric.clip_gradients(model, optimizer, max_norm=1.0)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(fabric.all_reduce(loss.detach(), reduce_op="mean").item())
    quantized = [n for n, m in model.named_modules() if isinstance(m, (Int8Linear, FourBitLinear))]
    base_bytes = sum(
        (p.to_local() if hasattr(p, "to_local") else p).numel() * p.element_size()
        for n, m in model.named_modules() if isinstance(m, (Int8Linear, FourBitLinear))
        for p in m.parameters(recurse=False) if not p.dtype.is_floating_point
    )  # fmt: skip
    if rank() == 0:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "litgpt.json").write_text(json.dumps({
            "losses": losses, "quantized": quantized, "base_bytes_per_rank": base_bytes,
            "trainable": sum(p.numel() for p in model.parameters() if p.requires_grad),
            "units": [u.path for u in fabric.strategy.sharding_plan.units],
        }, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
    barrier()
