"""Greedy generation that works on a sharded model: every rank runs the same forward passes.

``model.generate`` of a wrapped transformers model would bypass FSDP2's root unit (the LightningModule)
and its all-gathers; this loop calls a forward function you give it instead, so the same code decodes
with the sharded model (``lambda ids: strategy.model(input_ids=ids).logits`` on every rank) and with a
plain single-process model, token for token.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor


@torch.no_grad()
def greedy_generate(
    forward: Callable[[Tensor], Tensor],
    tokenizer: Any,
    prompts: list[str],
    *,
    max_new_tokens: int = 48,
    device: torch.device | str = "cpu",
) -> list[str]:
    """Decode each prompt greedily (argmax, batch of one, no cache) until EOS or ``max_new_tokens``."""
    outputs = []
    for prompt in prompts:
        ids = torch.tensor([tokenizer(prompt, add_special_tokens=False)["input_ids"]], device=device)
        new: list[int] = []
        for _ in range(max_new_tokens):
            next_id = int(forward(ids)[0, -1].argmax())
            if next_id == tokenizer.eos_token_id:
                break
            new.append(next_id)
            ids = torch.cat([ids, torch.tensor([[next_id]], device=device)], dim=1)
        outputs.append(tokenizer.decode(new, skip_special_tokens=True))
    return outputs
