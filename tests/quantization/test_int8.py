"""Int8Linear against bitsandbytes' own Linear8bitLt, and the converter."""

from __future__ import annotations

import sys

import bitsandbytes as bnb
import pytest
import torch
from torch import nn

from lightning_fsdp_plus.quantization import Int8Linear, check_quantize_base, convert_to_int8, int8_candidates
from tests.helpers.models import lora_llama


def _pair(threshold: float = 6.0):
    torch.manual_seed(0)
    linear = nn.Linear(64, 48)
    reference = bnb.nn.Linear8bitLt(64, 48, has_fp16_weights=False, threshold=threshold)
    reference.load_state_dict(linear.state_dict())
    return linear, reference.to("cpu"), Int8Linear.from_linear(linear, threshold=threshold)


@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("threshold", [0.0, 6.0])
def test_forward_and_input_grad_equal_linear8bitlt(training, threshold):
    _, reference, ours = _pair(threshold)
    reference.train(training)
    ours.train(training)
    x = (torch.randn(3, 5, 64) * 4).requires_grad_()  # large values: outlier columns exist at threshold 6
    x_ours = x.detach().clone().requires_grad_()
    out_ref, out_ours = reference(x), ours(x_ours)
    grad = torch.randn_like(out_ref)
    out_ref.backward(grad)
    out_ours.backward(grad)
    torch.testing.assert_close(out_ours, out_ref, rtol=0, atol=0)  # the same kernels: bit-identical
    torch.testing.assert_close(x_ours.grad, x.grad, rtol=0, atol=0)


def test_quantization_error_is_small_and_conversion_from_bnb_is_lossless():
    linear, reference, ours = _pair()
    from_bnb = Int8Linear.from_bnb(reference)
    assert torch.equal(from_bnb.weight, ours.weight) and torch.equal(from_bnb.scale, ours.scale)
    error = (ours.dequantize() - linear.weight).abs().max().item()
    assert 0 < error <= linear.weight.abs().max().item() / 127  # at most one quantization step


def test_storage_is_plain_frozen_parameters_that_no_float_cast_touches():
    _, _, ours = _pair()
    scale = ours.scale.clone()
    assert [(n, p.dtype, p.requires_grad, type(p)) for n, p in ours.named_parameters()] == [
        ("weight", torch.int8, False, nn.Parameter),
        ("weight_scale", torch.int32, False, nn.Parameter),
        ("bias", torch.float32, False, nn.Parameter),
    ]
    ours.to(torch.bfloat16)
    assert torch.equal(ours.scale, scale)  # fp32 bits survive module.to(bf16)
    assert ours.bias.dtype == torch.bfloat16
    assert ours(torch.randn(2, 64, dtype=torch.bfloat16)).dtype == torch.bfloat16


def test_gradients_flow_to_the_input_so_earlier_lora_layers_train():
    _, _, ours = _pair()
    x = torch.randn(4, 64, requires_grad=True)
    ours(x).sum().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0
    assert all(p.grad is None for p in ours.parameters())


def test_converter_skips_lora_adapters_trainable_layers_and_the_lm_head():
    model = lora_llama(0)
    candidates = int8_candidates(model)
    assert candidates and all("lora_" not in c and not c.endswith("lm_head") for c in candidates)
    assert len(candidates) == 14  # 7 projections x 2 layers
    assert convert_to_int8(model) == candidates
    assert sum(isinstance(m, Int8Linear) for m in model.modules()) == 14
    assert type(model.get_submodule("base_model.model.lm_head")) is nn.Linear
    assert int8_candidates(model, skip=["lm_head", "*mlp*"]) == []  # nothing left but patterns work


def test_skip_patterns():
    model = lora_llama(0)
    kept = convert_to_int8(model, skip=["lm_head", "down_proj", "*.layers.0.*"])
    assert kept and all(".layers.1." in p and not p.endswith("down_proj") for p in kept)


def test_converter_converts_transformers_style_linear8bitlt_losslessly():
    _, reference, ours = _pair()
    container = nn.Sequential(reference)
    assert convert_to_int8(container, skip=[]) == ["0"]
    assert isinstance(container[0], Int8Linear) and torch.equal(container[0].weight, ours.weight)


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("int4", "quantize_base='int4' is not one of None, int8, nf4, fp4"),
        ("int6", "quantize_base='int6' is not one of None, int8, nf4, fp4"),
    ],
)
def test_quantize_base_values(value, message):
    with pytest.raises(ValueError, match=message):
        check_quantize_base(value)
    for accepted in (None, "int8", "nf4", "fp4"):
        check_quantize_base(accepted)


def test_missing_bitsandbytes_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # import now raises ImportError
    with pytest.raises(ImportError, match=r"quantize_base='int8' needs bitsandbytes .* pip install 'bitsandbytes"):
        check_quantize_base("int8")


def test_model_loaded_by_transformers_in_8bit_converts_losslessly(tmp_path):
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from tests.helpers.models import TokenDataset, tiny_llama

    tiny_llama(0).save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, quantization_config=BitsAndBytesConfig(load_in_8bit=True))
    bnb_layers = {n for n, m in loaded.named_modules() if isinstance(m, bnb.nn.Linear8bitLt)}
    assert bnb_layers  # transformers really built Linear8bitLt layers
    probe = TokenDataset(n=2).data
    with torch.no_grad():
        before = loaded(input_ids=probe).logits
        converted = convert_to_int8(loaded)
        after = loaded(input_ids=probe).logits
    assert set(converted) == bnb_layers
    torch.testing.assert_close(after, before, rtol=0, atol=0)


def _tiny_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2)
    return GPT2LMHeadModel(config).eval().requires_grad_(False)


def test_gpt2_conv1d_layers_become_int8_and_compute_what_linear8bitlt_computes():
    from transformers.pytorch_utils import Conv1D

    model = _tiny_gpt2()
    conv = model.transformer.h[0].attn.c_attn  # weight [in=32, out=96]: not square, a transpose would show
    linear = nn.Linear(32, 96)
    linear.load_state_dict({"weight": conv.weight.t(), "bias": conv.bias})
    reference = bnb.nn.Linear8bitLt(32, 96, has_fp16_weights=False, threshold=6.0)
    reference.load_state_dict(linear.state_dict())
    reference = reference.to("cpu").eval()
    x = torch.randn(2, 5, 32)
    expected = reference(x)

    converted = convert_to_int8(model)
    conv_paths = [f"transformer.h.{i}.{name}" for i in range(2) for name in ("attn.c_attn", "attn.c_proj",
                                                                              "mlp.c_fc", "mlp.c_proj")]  # fmt: skip
    assert sorted(converted) == sorted(conv_paths)  # lm_head (skipped by default) stays float
    assert not any(isinstance(m, Conv1D) for m in model.modules())
    ours = model.transformer.h[0].attn.c_attn
    assert isinstance(ours, Int8Linear) and (ours.in_features, ours.out_features) == (32, 96)
    torch.testing.assert_close(ours.eval()(x), expected, rtol=0, atol=0)


def test_gpt2_in_int8_predicts_like_the_float_model():
    tokens = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    model = _tiny_gpt2()
    float_logits = model(tokens).logits
    convert_to_int8(model)
    int8_logits = model(tokens).logits
    assert (int8_logits - float_logits).abs().max().item() < 0.05 * float_logits.abs().max().item()


def test_conv1d_on_meta_becomes_an_empty_int8_layer_of_the_same_shape():
    from transformers import GPT2Config, GPT2LMHeadModel

    with torch.device("meta"):
        model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=1, n_head=2))
    model.requires_grad_(False)
    convert_to_int8(model)
    layer = model.transformer.h[0].mlp.c_fc  # Conv1D(nf=128, nx=32)
    assert isinstance(layer, Int8Linear) and layer.weight.is_meta and tuple(layer.weight.shape) == (128, 32)


def test_when_nothing_matches_the_error_lists_the_frozen_layer_types():
    from lightning_fsdp_plus.options import FSDPPlusOptions
    from lightning_fsdp_plus.pipeline import prepare_model

    options = FSDPPlusOptions(quantize_base="int8", quantize_skip=["c_*", "lm_head"])
    with pytest.raises(ValueError, match=r"layer types with frozen weights here: \['Conv1D', 'Embedding', 'LayerNorm', "
                                         r"'Linear'\]"):  # fmt: skip
        prepare_model(_tiny_gpt2(), options)


def test_training_on_cpu_does_not_keep_the_input_so_checkpointing_frees_it():
    # bitsandbytes' MatMul8bitFp keeps its input as ctx.A, out of activation checkpointing's reach
    import weakref

    from torch.utils.checkpoint import checkpoint

    _, reference, ours = _pair()
    for layer, kept in ((reference.train(), True), (ours.train(), False)):
        inner: list[weakref.ref] = []

        def block(hidden, layer=layer, inner=inner):
            scaled = hidden * 3  # made inside the checkpointed region: only the layer can keep it past forward
            inner.append(weakref.ref(scaled))
            return layer(scaled)

        x = torch.randn(8, 64, requires_grad=True)
        out = checkpoint(block, x, use_reentrant=False)
        assert (inner[0]() is not None) is kept
        out.sum().backward()  # recomputed in backward: the input gradient still arrives
        assert x.grad is not None and x.grad.abs().sum() > 0
