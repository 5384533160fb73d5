"""``FSDPPlusFabricStrategy`` without processes (issue 49): registration, options, precision, early refusals."""

from __future__ import annotations

import pytest
from lightning.fabric import Fabric
from lightning.fabric.plugins.precision import Precision

from lightning_fsdp_plus import FSDPPlusFabricStrategy, FSDPPlusStrategy
from lightning_fsdp_plus.precision import FSDPPlusPrecision, from_fabric


def test_fabric_finds_fsdp_plus_by_name_and_options_read_as_attributes():
    fabric = Fabric(strategy="fsdp_plus", accelerator="cpu", devices=1)
    assert isinstance(fabric.strategy, FSDPPlusFabricStrategy)
    strategy = FSDPPlusFabricStrategy("SHARD_GRAD_OP", quantize_base="int8", lora={"r": 4})
    assert strategy.sharding_strategy.value == "SHARD_GRAD_OP" and strategy.quantize_base == "int8"
    assert strategy.lora == FSDPPlusStrategy(quantize_base="int8", lora={"r": 4}).lora  # the same options object


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"sharding_strategy": "auto", "memory_budget": "1GiB", "plan_batch_size": 1, "plan_seq_len": 8},
         r"sharding_strategy='auto' is not supported under Fabric: the auto plan measures a model before any"),
        ({"tensor_parallel_size": 2, "loss_parallel": True},
         r"loss_parallel=True is not supported under Fabric: Fabric's loop computes the loss outside the model"),
        ({"start_method": "spawn"}, r"start_method is not supported under Fabric: Fabric launches its own"),
    ],
)  # fmt: skip
def test_what_fabric_cannot_honour_is_refused_with_the_reason(options, message):
    with pytest.raises(ValueError, match=message):
        FSDPPlusFabricStrategy(**options)


def test_an_unknown_argument_lists_the_valid_ones():
    with pytest.raises(TypeError, match=r"unexpected argument 'shard_everything'; valid arguments: .*quantize_base"):
        FSDPPlusFabricStrategy(shard_everything=True)


def test_fabric_precision_becomes_ours_and_casts_only_after_quantization():
    fabric = Fabric(strategy="fsdp_plus", accelerator="cpu", devices=1, precision="bf16-true")
    plugin = fabric.strategy.precision
    assert isinstance(plugin, FSDPPlusPrecision) and plugin.precision == "bf16-true" and plugin.defer_conversion
    import torch

    layer = torch.nn.Linear(2, 2)
    assert plugin.convert_module(layer).weight.dtype == torch.float32  # fabric.setup's call: deferred
    assert plugin.convert_now(layer).weight.dtype == torch.bfloat16  # the pipeline's, after quantization
    assert from_fabric(Precision()).precision == "32-true"


def test_a_precision_plugin_we_do_not_take_points_at_quantize_base():
    class BitsandbytesLike(Precision):
        precision = "32-true"

    with pytest.raises(ValueError, match=r"BitsandbytesLike is not supported by fsdp_plus.*quantize_base='int8'"):
        from_fabric(BitsandbytesLike())


def test_a_world_size_the_layout_does_not_divide_fails_before_any_process():
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 does not divide the world size 3"):
        Fabric(strategy=FSDPPlusFabricStrategy(tensor_parallel_size=2), accelerator="cpu", devices=3)
