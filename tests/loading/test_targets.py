"""Module names to checkpoint keys, the targets of a prepared model, and a load in one process (no group)."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from lightning_fsdp_plus.app.lm import CausalLMModule, build_causal_lm
from lightning_fsdp_plus.loading import (
    PretrainedLoadError,
    checkpoint_key,
    collect_targets,
    deferred_pretrained,
    load_pretrained_weights,
)
from lightning_fsdp_plus.lora import apply_lora, init_meta_adapters
from lightning_fsdp_plus.quantization import convert_to_int8
from tests.helpers.checkpoints import save_checkpoint

LORA = {"r": 4, "alpha": 8, "dropout": 0.0}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpts")
    return {arch: save_checkpoint(root / arch, arch) for arch in ("llama", "gpt2", "qwen2")}


@pytest.mark.parametrize(
    ("name", "key"),
    [
        ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.q_proj.weight"),
        ("model.layers.0.self_attn.q_proj.base_layer.weight", "model.layers.0.self_attn.q_proj.weight"),
        ("model.layers.0.self_attn.q_proj.lora_A.default.weight", None),
        ("model.layers.0.mlp.lora_magnitude_vector.default.weight", None),
        ("lm_head.modules_to_save.default.weight", "lm_head.weight"),
        ("lm_head.original_module.weight", "lm_head.weight"),
    ],
)
def test_checkpoint_key(name, key):
    assert checkpoint_key(name) == key


def _prepared(path, *, lora=True, int8=False, seed=0):
    torch.manual_seed(seed)
    module = CausalLMModule.from_pretrained(str(path))
    if lora:
        apply_lora(module, {**LORA, "target_modules": ["c_attn"]} if "gpt2" in str(path) else LORA)
    if int8:
        convert_to_int8(module)
    return module


def test_targets_of_a_lora_int8_model(checkpoints):
    module = _prepared(checkpoints["gpt2"], int8=True)
    targets = {t.key: t for t in collect_targets(module)}
    assert not any("lora_" in t.module_path for t in targets.values())  # adapters come from PEFT, not the file
    attn = targets["transformer.h.0.attn.c_attn.weight"]  # LoRA-wrapped: its frozen base_layer is the int8 one
    assert attn.module_path == "model.base_model.model.transformer.h.0.attn.c_attn.base_layer"
    proj = targets["transformer.h.0.mlp.c_fc.weight"]  # a frozen Conv1D: quantized, stored transposed
    assert attn.quantize and attn.transposed and proj.quantize and proj.transposed and proj.attribute == "weight"
    assert not targets["transformer.h.0.attn.c_attn.bias"].quantize
    assert targets["transformer.h.0.attn.c_attn.bias"].module_path == attn.module_path
    assert "transformer.h.0.mlp.c_fc.weight_scale" not in targets  # filled with the weight
    embedding = [t for t in collect_targets(module) if t.key in ("transformer.wte.weight", "lm_head.weight")]
    assert len(embedding) == 1 and embedding[0].key == "transformer.wte.weight"  # tied: one target


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
@pytest.mark.parametrize("int8", [False, True], ids=["float", "int8"])
def test_one_process_load_equals_from_pretrained(checkpoints, arch, int8):
    # no process group: the same stage the strategy runs, on an unsharded model
    module = _prepared(checkpoints[arch], int8=int8)
    summary = load_pretrained_weights(module)
    torch.manual_seed(0)
    reference = CausalLMModule(build_causal_lm(name_or_path=str(checkpoints[arch])))
    apply_lora(reference, {**LORA, "target_modules": ["c_attn"]} if arch == "gpt2" else LORA)
    if int8:
        convert_to_int8(reference)
    got, expected = module.state_dict(), reference.state_dict()
    assert got.keys() == expected.keys()
    assert [k for k in got if not torch.equal(got[k], expected[k])] == []
    assert summary is not None and summary.bytes_read == summary.checkpoint_bytes  # one process reads it all
    assert load_pretrained_weights(module) is None  # loaded once: nothing pending


def test_peft_applied_by_the_user_on_meta_gets_initialized_adapters(checkpoints):
    model = deferred_pretrained(checkpoints["llama"])
    peft_model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))  # PEFT moves them to meta
    layer = peft_model.base_model.model.model.layers[0].self_attn.q_proj
    assert layer.lora_A.default.weight.is_meta
    done = init_meta_adapters(peft_model)
    assert len(done) == 4 and not layer.lora_A.default.weight.is_meta
    assert torch.count_nonzero(layer.lora_B.default.weight) == 0 and layer.lora_A.default.weight.abs().sum() > 0
    load_pretrained_weights(peft_model)
    reference = AutoModelForCausalLM.from_pretrained(checkpoints["llama"])
    assert torch.equal(layer.base_layer.weight, reference.model.layers[0].self_attn.q_proj.weight)


def test_a_lora_adapter_left_on_meta_is_an_error(checkpoints):
    model = get_peft_model(deferred_pretrained(checkpoints["llama"]), LoraConfig(r=4, target_modules=["q_proj"]))
    with pytest.raises(PretrainedLoadError, match=r"q_proj\.lora_A\.default\.weight \(a LoRA adapter on the meta"):
        collect_targets(model)


def test_data_dependent_lora_init_needs_the_weights(checkpoints):
    model = get_peft_model(deferred_pretrained(checkpoints["llama"]),
                           LoraConfig(r=4, target_modules=["q_proj"], init_lora_weights="eva"))  # fmt: skip
    with pytest.raises(ValueError, match=r"init_lora_weights='eva'.*low_memory_load=false"):
        init_meta_adapters(model)


@pytest.mark.parametrize(("rows", "world"), [(8, 2), (97, 2), (5, 4), (3, 8), (1, 2)])
def test_row_blocks_split_as_torch_chunk_and_dtensor_shard_do(rows, world):
    from lightning_fsdp_plus.loading.planner import row_block

    chunks = list(torch.arange(rows).chunk(world)) + [torch.arange(0)] * world  # chunk may return fewer pieces
    for rank in range(world):
        start, stop = row_block(rows, rank=rank, world=world)
        assert torch.equal(torch.arange(start, stop), chunks[rank])
