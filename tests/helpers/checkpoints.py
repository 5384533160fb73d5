"""Small pretrained checkpoints saved with ``save_pretrained`` (sharded safetensors), for the loading tests."""

from __future__ import annotations

from pathlib import Path

import torch

ARCHITECTURES = ("llama", "qwen2", "gpt2")
"""Llama (untied), Qwen2 (q/k/v biases; vocab 251 and MLP width 97 split unevenly over 2 ranks) and GPT-2
(Conv1D, tied embeddings)."""


def tiny_causal_lm(arch: str, *, seed: int = 0, tied: bool = False) -> torch.nn.Module:
    """A randomly initialised causal LM of ``arch`` (a few hundred thousand parameters)."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    if arch == "llama":
        config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied)  # fmt: skip
        return LlamaForCausalLM(config)
    if arch == "qwen2":
        config = Qwen2Config(vocab_size=251, hidden_size=64, intermediate_size=97, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied)  # fmt: skip
        return Qwen2ForCausalLM(config)
    if arch == "gpt2":
        config = GPT2Config(vocab_size=255, n_embd=64, n_layer=2, n_head=4, n_positions=64, bos_token_id=0,
                            eos_token_id=0)  # fmt: skip
        return GPT2LMHeadModel(config)
    raise ValueError(f"arch={arch!r} is not one of {', '.join(ARCHITECTURES)}")


def save_checkpoint(directory: Path, arch: str, *, dtype: torch.dtype = torch.bfloat16, tied: bool = False) -> Path:
    """Save ``tiny_causal_lm(arch)`` in ``dtype`` as sharded safetensors (several files and an index)."""
    model = tiny_causal_lm(arch, tied=tied).to(dtype)
    model.save_pretrained(directory, max_shard_size="60KB")
    return directory


def mid_llama_config() -> dict:
    """A Llama of 16 M parameters (32 MB in bf16) for the loading memory check: big enough that one tensor (the
    fp32 embedding, 16 MB) is a fair allowance, small enough for the suite."""
    return {"vocab_size": 16000, "hidden_size": 256, "intermediate_size": 1024, "num_hidden_layers": 8,
            "num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": False}  # fmt: skip


def save_mid_llama(directory: Path) -> Path:
    """Save the memory-check Llama in bf16, sharded into ~10 MB files."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**mid_llama_config())).to(torch.bfloat16).save_pretrained(
        directory, max_shard_size="10MB"
    )
    return directory
