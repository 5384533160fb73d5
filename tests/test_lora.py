"""PEFT helpers in one process: config mapping, target checks, applying LoRA, exporting the adapter."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, PeftModel

from lightning_fsdp_plus.app.lm import CausalLMModule
from lightning_fsdp_plus.lora import (
    apply_lora,
    check_trainable,
    export_adapter,
    find_peft_model,
    linear_module_names,
    make_lora_config,
)
from tests.helpers.models import LORA, TokenDataset, tiny_llama


def test_mapping_becomes_lora_config_with_short_aliases():
    config = make_lora_config({"r": 8, "alpha": 16, "dropout": 0.1, "target_modules": ["q_proj"]})
    assert isinstance(config, LoraConfig)
    assert (config.r, config.lora_alpha, config.lora_dropout, config.target_modules) == (8, 16, 0.1, {"q_proj"})


def test_unknown_lora_key_lists_valid_keys_each_once():
    with pytest.raises(ValueError, match=r"lora has 'rank', which is not a LoraConfig field; valid keys: .*alpha.*"
                                         r"target_modules") as raised:  # fmt: skip
        make_lora_config({"rank": 8})
    valid = str(raised.value).split("valid keys: ")[1].split(", ")
    assert len(valid) == len(set(valid)) and "r" in valid  # 'r' was listed twice (ours and PEFT's)


def test_targets_matching_nothing_list_the_linear_layers():
    module = CausalLMModule(tiny_llama(0))
    message = (
        r"lora.target_modules=\['query', 'value'\] matches no module; "
        r"linear layers in the model: down_proj, gate_proj, k_proj, lm_head, o_proj, q_proj"
    )
    with pytest.raises(ValueError, match=message):
        apply_lora(module, {"target_modules": ["query", "value"]})


def test_apply_lora_wraps_the_transformers_model_once():
    module = CausalLMModule(tiny_llama(0))
    assert apply_lora(module, LORA) == "model"
    assert isinstance(module.model, PeftModel)
    first = module.model
    apply_lora(module, LORA)  # idempotent (validate, then fit)
    assert module.model is first
    trainable = {n for n, p in module.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    assert find_peft_model(module)[0] == "model"
    assert "q_proj" in linear_module_names(module)


def test_lora_only_without_trainable_parameters_is_refused():
    with pytest.raises(ValueError, match=r"lora_only=True shards the trainable .* but the model has none"):
        check_trainable(tiny_llama(0).requires_grad_(False))


def test_export_in_one_process_round_trips(tmp_path):
    module = CausalLMModule(tiny_llama(0))
    apply_lora(module, LORA)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "lora_B" in name:
                p.normal_()
    export_adapter(module, tmp_path / "adapter")
    probe = TokenDataset(n=2).data
    reloaded = PeftModel.from_pretrained(tiny_llama(0), tmp_path / "adapter")
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=probe).logits, module.model(input_ids=probe).logits)
    with pytest.raises(ValueError, match="has no PEFT adapter"):
        export_adapter(CausalLMModule(tiny_llama(0)), tmp_path / "none")
