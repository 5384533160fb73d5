"""Activation checkpointing as ``apply_sharding_plan`` applies it, in one process: transformers decoders with their
key/value cache on (the config's default), padding masks, GPT-2's cache passed by position, and the model's own
``gradient_checkpointing_enable()``."""

from __future__ import annotations

import copy

import pytest
import torch

from lightning_fsdp_plus.options import FSDPPlusOptions
from lightning_fsdp_plus.pipeline import checkpointed_paths
from lightning_fsdp_plus.sharding import apply_activation_checkpointing, model_checkpointed_layers
from tests.helpers.models import VOCAB, tiny_llama


def tiny_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64))


MODELS = {"llama": (tiny_llama, "model.layers"), "gpt2": (tiny_gpt2, "transformer.h")}


def padded_batch() -> dict[str, torch.Tensor]:
    torch.manual_seed(1)
    ids = torch.randint(0, VOCAB, (3, 10))
    mask = torch.ones_like(ids)
    mask[1, 7:] = mask[2, 4:] = 0  # right padding, as the instruction data's collator pads
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def grads_after_backward(model) -> dict[str, torch.Tensor]:
    model(**padded_batch()).loss.backward()  # use_cache left to the config (True)
    return {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("arch", MODELS)
def test_checkpointed_decoder_with_its_cache_on_computes_the_same_gradients(arch):
    build, layers = MODELS[arch]
    model = build()
    assert model.config.use_cache  # the default that made the recomputation append its keys twice
    reference = grads_after_backward(copy.deepcopy(model))
    apply_activation_checkpointing(model, [f"{layers}.0", f"{layers}.1"])
    grads = grads_after_backward(model)
    # equal up to float rounding: GPT-2's attention without a cache may take another kernel path (6e-8 on some
    # CPUs); keys appended twice, the bug this guards against, move gradients by orders of magnitude more
    assert max((grads[n] - g).abs().max().item() for n, g in reference.items()) < 1e-6


def test_without_gradients_a_checkpointed_layer_keeps_writing_its_cache():
    model = tiny_llama()
    apply_activation_checkpointing(model, ["model.layers.0", "model.layers.1"])
    with torch.no_grad():  # generation: no backward, no recomputation, the cache is what makes decoding fast
        cache = model(input_ids=torch.zeros(1, 5, dtype=torch.long), use_cache=True).past_key_values
    assert cache.get_seq_length() == 5


def test_the_models_own_checkpointing_becomes_the_plans_and_is_switched_off_on_those_layers():
    model = tiny_llama()
    model.gradient_checkpointing_enable()
    layers = ["model.layers.0", "model.layers.1"]
    assert list(model_checkpointed_layers(model)) == layers
    assert checkpointed_paths(model, FSDPPlusOptions()) == layers  # no activation_checkpointing option given
    assert checkpointed_paths(model, FSDPPlusOptions(activation_checkpointing="auto")) == layers  # no duplicates
    reference = grads_after_backward(copy.deepcopy(model))
    apply_activation_checkpointing(model, layers)
    assert list(model_checkpointed_layers(model)) == []  # recomputed once, by the plan's checkpoint
    grads = grads_after_backward(model)
    # equal up to float rounding: GPT-2's attention without a cache may take another kernel path (6e-8 on some
    # CPUs); keys appended twice, the bug this guards against, move gradients by orders of magnitude more
    assert max((grads[n] - g).abs().max().item() for n, g in reference.items()) < 1e-6
    assert checkpointed_paths(tiny_llama(), FSDPPlusOptions()) == []  # nothing asked, nothing checkpointed
