"""Precision presets, the FSDP2 policy they map to, and the plugin's contexts."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch.plugins.precision import DoublePrecision, HalfPrecision, MixedPrecision, Precision
from torch.distributed.fsdp import MixedPrecisionPolicy

from lightning_fsdp_plus.precision import (
    FSDPPlusPrecision,
    check_precision,
    mixed_precision_policy,
    validate_mixed_precision,
)


@pytest.mark.parametrize(
    ("precision", "param", "reduce"),
    [("32-true", None, None), ("bf16-mixed", torch.bfloat16, torch.float32), ("16-mixed", torch.float16, torch.float32),
     ("bf16-true", None, None), ("16-true", None, None)],
)  # fmt: skip
def test_presets_map_to_mixed_precision_policy(precision, param, reduce):
    policy = mixed_precision_policy(precision=precision)
    assert (policy.param_dtype, policy.reduce_dtype) == (param, reduce)


def test_explicit_mapping_overrides_the_preset():
    policy = mixed_precision_policy(precision="bf16-mixed", mapping={"param_dtype": "fp16", "reduce_dtype": "float32"})
    assert policy == MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float32)


@pytest.mark.parametrize(
    ("mapping", "message"),
    [
        ({"param_dtype": "fp8"}, "mixed_precision.param_dtype='fp8' is not one of float32, fp32"),
        ({"buffer_dtype": "bf16"}, "mixed_precision.buffer_dtype is not a valid key; choose from param_dtype"),
        ({"cast_forward_inputs": "yes"}, "cast_forward_inputs='yes' must be true or false"),
        ("bf16", "mixed_precision='bf16' must be None or a mapping"),
    ],
)
def test_bad_mixed_precision_mapping(mapping, message):
    with pytest.raises(ValueError, match=message):
        validate_mixed_precision(mapping)


def test_unsupported_precision_lists_choices():
    with pytest.raises(ValueError, match="precision='64-true' is not supported by fsdp_plus; choose one of 32-true, "
                                         "bf16-mixed, bf16-true, 16-mixed, 16-true"):  # fmt: skip
        check_precision("64-true", device_type="cpu")


def test_bf16_on_a_cuda_device_without_bf16_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    with pytest.raises(ValueError, match="needs bfloat16, which this CUDA device does not support; choose one of "
                                         "32-true, 16-mixed, 16-true"):  # fmt: skip
        check_precision("bf16-mixed", device_type="cuda")
    check_precision("bf16-mixed", device_type="cpu")


@pytest.mark.parametrize(
    ("plugin", "expected"),
    [
        (Precision(), "32-true"),
        (MixedPrecision("bf16-mixed", "cpu"), "bf16-mixed"),
        (HalfPrecision("bf16-true"), "bf16-true"),
    ],
)  # fmt: skip
def test_lightning_plugins_are_converted(plugin, expected):
    converted = FSDPPlusPrecision.from_lightning(plugin, device="cpu")
    assert isinstance(converted, FSDPPlusPrecision) and converted.precision == expected


def test_double_precision_is_refused():
    with pytest.raises(ValueError, match="precision='64-true' is not supported"):
        FSDPPlusPrecision.from_lightning(DoublePrecision())


def test_autocast_targets_the_plugin_device():
    plugin = FSDPPlusPrecision("bf16-mixed", device="cpu")
    with plugin.forward_context():
        assert torch.is_autocast_enabled("cpu")
        assert torch.get_autocast_dtype("cpu") == torch.bfloat16
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.bfloat16
    assert not torch.is_autocast_enabled("cpu")


def test_true_precision_converts_module_and_inputs():
    plugin = FSDPPlusPrecision("16-true")
    module = plugin.convert_module(torch.nn.Linear(2, 2))
    assert module.weight.dtype == torch.float16
    assert plugin.convert_input(torch.ones(2)).dtype == torch.float16
    assert plugin.convert_input(torch.ones(2, dtype=torch.long)).dtype == torch.long


@pytest.mark.parametrize("precision", ["32-true", "bf16-true"])
def test_a_true_precision_casts_floating_tensors_only_complex_and_integer_ones_keep_their_dtype(precision):
    """Issue 48: ``module.to(float32)`` turned a complex64 rotary table into its real part (with only a warning)."""
    module = torch.nn.Linear(4, 4).double()
    module.register_buffer("freqs_cis", torch.polar(torch.ones(3), torch.arange(3.0)))  # complex64
    module.register_buffer("codes", torch.tensor([1, -2], dtype=torch.int8))
    before = module.freqs_cis.clone()
    converted = FSDPPlusPrecision(precision).convert_module(module)
    assert converted.weight.dtype == {"32-true": torch.float32, "bf16-true": torch.bfloat16}[precision]
    assert converted.freqs_cis.dtype == torch.complex64 and torch.equal(converted.freqs_cis, before)
    assert converted.codes.dtype == torch.int8


def test_scaler_only_for_16_mixed():
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    assert isinstance(FSDPPlusPrecision("16-mixed").scaler, ShardedGradScaler)
    assert FSDPPlusPrecision("bf16-mixed").scaler is None
    with pytest.raises(ValueError, match="does not use a gradient scaler"):
        FSDPPlusPrecision("bf16-mixed", scaler=torch.amp.GradScaler("cpu"))
