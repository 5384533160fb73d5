"""Tokenizers for the app: the model's (``AutoTokenizer``), or a byte-level one built in code for a model built
from a config (the default tiny Llama), so own data runs without any tokenizer files."""

from __future__ import annotations

from typing import Any

BYTE_EOS = "<|endoftext|>"
"""End-of-sequence token of the byte-level tokenizer (id 256)."""
BYTE_PAD = "<pad>"
"""Padding token of the byte-level tokenizer (id 257)."""


def byte_tokenizer() -> Any:
    """A byte-level tokenizer with no merges: 256 byte tokens, then ``<|endoftext|>`` and ``<pad>`` (258 in all).

    Any text round-trips (no unknown tokens), it needs no files, and it is the same on every machine, so a
    model built from a config gets the same token ids in every run. Built with ``tokenizers`` and wrapped as a
    transformers fast tokenizer, so ``save_pretrained`` and ``AutoTokenizer`` work on it as on any other.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())  # the 256 characters byte-level BPE maps bytes onto
    backend = Tokenizer(models.BPE(vocab={char: i for i, char in enumerate(alphabet)}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=BYTE_EOS, pad_token=BYTE_PAD)


def load_tokenizer(name_or_path: str | None) -> Any:
    """``AutoTokenizer.from_pretrained(name_or_path)`` with a pad token (EOS when it has none), or the byte-level
    tokenizer when ``name_or_path`` is ``None``; a GGUF file's is its conversion's
    (:func:`~lightning_fsdp_plus.loading.gguf.converted_checkpoint`)."""
    if name_or_path is None:
        return byte_tokenizer()
    from transformers import AutoTokenizer

    from lightning_fsdp_plus.loading.gguf import resolve_model_source

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_source(name_or_path))  # a GGUF file: its conversion's
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer
