"""Every run's held-out loss, computed one way for all: plain transformers + PEFT in one process, the base as the run
held it (float, or LLM.int8 for an int8 base), the plan's held-out examples in micro-batches of 8, the loss summed
over their target tokens and divided by their count."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

EVAL_BATCH = 8
"""Held-out examples a forward pass."""


@torch.no_grad()
def heldout_loss(plan: dict[str, Any], adapter: Path, *, int8: bool = False) -> float:
    """Mean next-token cross-entropy of the plan's held-out examples under base + ``adapter``."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from benchmarks.peers.plan import micro_batch, target_tokens

    quantization = BitsAndBytesConfig(load_in_8bit=True) if int8 else None
    model = AutoModelForCausalLM.from_pretrained(plan["base"], dtype=torch.float32, quantization_config=quantization)
    model = PeftModel.from_pretrained(model, str(adapter)).eval()
    summed, count = 0.0, 0
    for start in range(0, len(plan["val"]), EVAL_BATCH):
        batch = micro_batch(plan["val"][start : start + EVAL_BATCH], pad_id=plan["pad_id"])
        tokens = target_tokens(batch["labels"])
        summed += float(model(**batch, use_cache=False).loss) * tokens
        count += tokens
    return summed / count
