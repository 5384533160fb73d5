"""FourBitLinear against bitsandbytes' own Linear4bit: the same bytes, the same outputs and input gradients."""

from __future__ import annotations

import bitsandbytes as bnb
import pytest
import torch
from torch import nn

from lightning_fsdp_plus.quantization.fourbit import NESTED_BLOCKSIZE, FourBitLinear

IN, OUT = 256, 96


def _pair(quant_type: str, double_quant: bool, dtype: torch.dtype, blocksize: int = 64):
    torch.manual_seed(0)
    linear = nn.Linear(IN, OUT).to(dtype)
    reference = bnb.nn.Linear4bit(IN, OUT, quant_type=quant_type, compress_statistics=double_quant)
    reference.weight.blocksize = blocksize
    reference.load_state_dict(linear.state_dict())
    ours = FourBitLinear.from_linear(linear, quant_type=quant_type, blocksize=blocksize, double_quant=double_quant)
    return reference.to("cpu"), ours


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
@pytest.mark.parametrize("double_quant", [False, True], ids=["plain", "double_quant"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_bytes_outputs_and_input_grads_equal_linear4bit(quant_type, double_quant, dtype):
    reference, ours = _pair(quant_type, double_quant, dtype)
    assert torch.equal(reference.weight.data.view(-1), ours.weight.view(-1))  # the same packed bytes, laid out by rows
    x = (torch.randn(3, 5, IN) * 2).to(dtype).requires_grad_()
    x_ours = x.detach().clone().requires_grad_()
    out_ref, out_ours = reference(x), ours(x_ours)
    grad = torch.randn_like(out_ref)
    out_ref.backward(grad)
    out_ours.backward(grad)
    torch.testing.assert_close(out_ours, out_ref, rtol=0, atol=0)
    torch.testing.assert_close(x_ours.grad, x.grad, rtol=0, atol=0)
    assert ours.weight.shape == (OUT, IN // 2) and ours.weight.dtype == torch.uint8
    assert ours.weight_absmax.shape == (OUT, IN // 64)  # sharded with the weight, row by row
    if double_quant:
        assert ours.nested_absmax.numel() == -(-(OUT * IN // 64) // NESTED_BLOCKSIZE)


def test_dequantized_weight_is_close_and_bnb_layers_convert_losslessly():
    reference, ours = _pair("nf4", False, torch.float32)
    torch.manual_seed(0)
    original = nn.Linear(IN, OUT).weight.detach()
    error = (ours.dequantize() - original).abs().max() / original.abs().max()
    assert 0 < error < 0.25  # 4-bit: coarse (one of 16 levels per block), never exact
    converted = FourBitLinear.from_bnb(reference)
    assert all(
        torch.equal(a, b) for a, b in zip(converted.state_dict().values(), ours.state_dict().values(), strict=True)
    )


def test_statistics_cannot_be_degraded_by_a_dtype_cast():
    _, ours = _pair("nf4", True, torch.float32)
    before = {k: v.clone() for k, v in ours.state_dict().items() if k != "bias"}
    ours.to(torch.bfloat16)  # what bf16-true does to the model
    assert all(torch.equal(before[k], v) for k, v in ours.state_dict().items() if k != "bias")
    assert ours.bias.dtype == torch.bfloat16


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"quant_type": "int4"}, r"quantize_base='int4' is not a 4-bit type; valid choices: nf4, fp4"),
        ({"blocksize": 48}, r"quantize_blocksize=48 is not one of 32, 64, 128"),
        ({"blocksize": 128, "in_features": 192}, r"in_features=192, not a multiple of quantize_blocksize=128"),
    ],
)
def test_bad_settings_name_the_key_and_the_choices(kwargs, message):
    settings = {"quant_type": "nf4", "blocksize": 64, "in_features": IN, **kwargs}
    with pytest.raises(ValueError, match=message):
        FourBitLinear(settings.pop("in_features"), OUT, **settings)


@pytest.mark.parametrize("double_quant", [False, True], ids=["plain", "double_quant"])
def test_model_loaded_by_transformers_in_4bit_converts_losslessly(tmp_path, double_quant):
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from lightning_fsdp_plus.quantization import convert_to_4bit
    from tests.helpers.models import LORA_LLAMA, TokenDataset, tiny_llama

    tiny_llama(0, **LORA_LLAMA).save_pretrained(tmp_path)  # 256/512 wide: whole 64-value blocks per row
    config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=double_quant,
                                bnb_4bit_compute_dtype=torch.float32)  # fmt: skip
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, quantization_config=config)
    bnb_layers = {n for n, m in loaded.named_modules() if isinstance(m, bnb.nn.Linear4bit)}
    assert bnb_layers  # transformers really built Linear4bit layers
    probe = TokenDataset(n=2).data
    loaded.train()  # the training path: Linear4bit's no-grad eval path repacks weights on AVX512-BF16 CPUs
    before = loaded(input_ids=probe).logits
    converted = convert_to_4bit(loaded, quant_type="nf4", double_quant=double_quant)
    after = loaded(input_ids=probe).logits
    assert set(converted) == bnb_layers
    assert all(m.double_quant is double_quant for m in loaded.modules() if isinstance(m, FourBitLinear))
    torch.testing.assert_close(after, before, rtol=0, atol=0)
