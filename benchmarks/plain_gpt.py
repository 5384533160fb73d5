"""The plain GPT of issue 31: a hand-written model, no transformers, as a Lightning user writes one.

Token embedding 2048 x 256, 4 blocks (LayerNorm -> one ``Linear(256, 768)`` for q/k/v -> causal
``scaled_dot_product_attention`` -> ``Linear(256, 256)``; LayerNorm -> ``Linear(256, 1024)`` -> GELU ->
``Linear(1024, 256)``; residuals), a final LayerNorm and an untied ``Linear(256, 2048)`` head. Called like a
transformers causal LM (``model(input_ids=..., labels=...)`` returns ``.loss`` and ``.logits``), so every benchmark
case (``CausalLMModule``, the hand-written loop) trains it unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class PlainGPTConfig:
    """Sizes of the plain GPT."""

    vocab_size: int = 2048
    """Tokens in the vocabulary (embedding rows, head outputs)."""
    hidden_size: int = 256
    """Width of the residual stream."""
    num_hidden_layers: int = 4
    """Blocks."""
    num_heads: int = 4
    """Attention heads per block."""


@dataclass
class CausalLMOutput:
    """What ``forward`` returns: the logits and, with labels, the mean next-token cross-entropy."""

    logits: torch.Tensor
    loss: torch.Tensor | None = None


class Block(nn.Module):
    """Pre-norm block: causal self-attention, then a GELU MLP, each with a residual."""

    def __init__(self, config: PlainGPTConfig) -> None:
        super().__init__()
        d = config.hidden_size
        self.heads = config.num_heads
        self.ln1, self.qkv, self.proj = nn.LayerNorm(d), nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.ln2, self.fc, self.out = nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        attention = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(attention)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class PlainGPT(nn.Module):
    """Embedding, ``num_hidden_layers`` blocks, final LayerNorm, untied head."""

    def __init__(self, config: PlainGPTConfig) -> None:
        super().__init__()
        self.emb = nn.Embedding(config.vocab_size, config.hidden_size)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.num_hidden_layers))
        self.ln = nn.LayerNorm(config.hidden_size)
        self.head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None, **_: object) -> CausalLMOutput:
        x = self.emb(input_ids)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln(x))
        if labels is None:
            return CausalLMOutput(logits)
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), labels[:, 1:].reshape(-1))
        return CausalLMOutput(logits, loss)
